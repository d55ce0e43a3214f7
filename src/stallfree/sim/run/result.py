"""What one simulation records and what it needs of a scheduler: SimResult, the SchedulerLike
protocol, the request states of the event loop, the kinds of rejection and SimulationError.

Imports allowed: the standard library and stallfree.core.

SimResult stores per-token times without per-token objects: a request emits its first token at the
end of the step of its last prefill chunk and then one per step it decodes in, so its token times
are the end times of those steps. Per step it keeps its end time and how many decode steps have
happened so far; per request only the step of its first token and of its finish, plus the rare
exceptions: steps in which a decoding request was left out while others decoded (decode overflow,
`skips`) and preemptions (`segments`). Steps with no decodes at all (prefill-only steps) are seen
from the step arrays.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from stallfree.core.errors import StallfreeError
from stallfree.core.metrics import RequestTimeline
from stallfree.core.plan import StepPlan
from stallfree.core.queries import SchedulerStats
from stallfree.core.request import FinishReason, Request

__all__ = [
    "CONTEXT_LENGTH",
    "KV_CAPACITY",
    "ClusterError",
    "RequestState",
    "SchedulerLike",
    "SimResult",
    "SimulationError",
    "verify_cluster_tokens",
    "verify_tokens",
]


class SimulationError(StallfreeError, RuntimeError):
    """The simulation cannot go on: a scheduler made no progress, emitted inconsistently, or the
    invariant checker is unavailable."""


class ClusterError(StallfreeError, ValueError):
    """A cluster option is out of range (the message names the field and the value)."""


class SchedulerLike(Protocol):
    """What the simulator needs of a scheduler (stallfree.Scheduler and the baselines have it)."""

    last_finished: dict[Hashable, FinishReason]

    def add(self, req: Request) -> None: ...
    def stop_after(self, rid: Hashable, num_tokens: int) -> None: ...
    def schedule(self) -> StepPlan: ...
    def complete(self, plan: StepPlan, stopped: Iterable[Hashable] = ()) -> tuple[Hashable, ...]: ...
    def has_unfinished(self) -> bool: ...
    @property
    def kv_free(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    def stats(self) -> SchedulerStats: ...
    def cached_prefix_len(self, request: Request) -> int: ...


#: Kinds of rejection (SimResult.rejected_kind).
CONTEXT_LENGTH = "context_length"
KV_CAPACITY = "kv_capacity"


class RequestState(IntEnum):
    """Where a request stands in a replica's event-loop bookkeeping (not the scheduler's own state).

    Stored compactly, one byte per request (Replica.state, a bytearray of these values).
    WAITING: not yet emitting (queued, prefilling, or preempted until its recompute ends);
    DECODING: has a first token and decodes; DONE: finished or rejected.
    """

    WAITING = 0
    DECODING = 2
    DONE = 3


@dataclass(slots=True)
class SimResult:
    """Everything one simulation recorded. Requests are indexed by workload position (their rid).

    Per request (lists of length n): arrival (s), prompt_len, target (output tokens it should
    receive: min(output_len, max_new)), max_new (its reservation), admit_step / first_step /
    finish_step (step numbers, -1 if it never happened, e.g. rejected) and finish_reason ("length",
    "stop", "" if rejected). Per step (arrays): start and end (s), num_tokens, num_decodes,
    kv_used (reserved KV after the step, tokens), num_waiting (after the step), ticks (decode steps
    so far, including this one). `skips` and `segments` hold the rare irregular histories (see the
    module docstring). `rejected` lists (rid, reason); `rejected_kind` maps each rejected rid to
    its kind: "context_length" (prompt plus reserved output over the model's context length,
    refused at arrival) or "kv_capacity" (its reservation can never fit the KV cache).
    With LoRA adapters (stallfree.sim.run.lora): `lora` names each request's adapter (None: the base
    model), `lora_load_s` the seconds its adapter's loads took for it (0: a warm start), and
    lora_loads / lora_storage_loads count the adapters loaded into GPU slots / read from storage.
    """

    label: str
    workload: str
    config: dict[str, Any]
    arrival: tuple[float, ...]
    prompt_len: tuple[int, ...]
    target: list[int]
    max_new: list[int]
    admit_step: list[int]
    first_step: list[int]
    finish_step: list[int]
    finish_reason: list[str]
    rejected: list[tuple[int, str]]
    kv_total: int
    step_start: array[float] = field(default_factory=lambda: array("d"))
    step_end: array[float] = field(default_factory=lambda: array("d"))
    # The integer step arrays are C ints (array "i", 4 bytes: a step's tokens, decodes, reserved KV and
    # waiting requests, and the decode steps so far, are all far below 2**31; a value past it raises
    # OverflowError rather than wrapping): a run's step rows are most of what it holds.
    step_tokens: array[int] = field(default_factory=lambda: array("i"))
    step_decodes: array[int] = field(default_factory=lambda: array("i"))
    step_kv_used: array[int] = field(default_factory=lambda: array("i"))
    step_waiting: array[int] = field(default_factory=lambda: array("i"))
    step_ticks: array[int] = field(default_factory=lambda: array("i"))
    skips: dict[int, list[int]] = field(default_factory=dict)
    segments: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    wall_s: float = 0.0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    #: Prefix caching (None when off): hit prompt tokens / prompt tokens looked up at admissions
    #: (readmissions after preemption included), the infinite-cache bound from the trace alone, and
    #: cached blocks evicted.
    prefix_cache_hit_rate: float | None = None
    prefix_cache_hit_rate_bound: float | None = None
    prefix_cache_evictions: int = 0
    #: The hit rate over first admissions only (readmissions after preemption left out).
    prefix_cache_hit_rate_first_admission: float | None = None
    #: A CPU KV tier's figures (stallfree.sim.run.simulator.tier_figures), None without one.
    kv_tier: dict[str, Any] | None = None
    rejected_kind: dict[int, str] = field(default_factory=dict)
    #: Sessions (stallfree.sim.inputs.sessions): per request its (session_id, turn); None for other workloads.
    session_keys: tuple[tuple[Any, int], ...] | None = None
    lora: tuple[str | None, ...] | None = None
    lora_load_s: list[float] | None = None
    lora_loads: int = 0
    lora_storage_loads: int = 0
    #: Per request its tenant ("default" for none), when the workload names tenants; else None.
    tenant: tuple[str, ...] | None = None
    #: A cluster's replicas share one set of per-request arrays (admit_step, first_step, finish_step,
    #: finish_reason; each request is written by its own replica alone), so that they take 8 bytes per
    #: request and field, not that times the replicas. Then `owner` is, per request, the index of
    #: the replica it was routed to (-1: none) and `replica` this result's: a request is this result's
    #: when owner[rid] == replica (owns). None: every request of the arrays is this result's.
    owner: Sequence[int] | None = None
    replica: int = -1

    def owns(self, rid: int) -> bool:
        """Whether request `rid`'s per-request fields are this result's (see `owner`)."""
        return self.owner is None or self.owner[rid] == self.replica

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        """Rejected requests counted by kind ("context_length", "kv_capacity"), kinds with none left out."""
        counts: dict[str, int] = {}
        for rid, _ in self.rejected:
            kind = self.rejected_kind.get(rid, KV_CAPACITY)
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    @property
    def num_requests(self) -> int:
        """Requests in the workload (including rejected ones)."""
        return len(self.arrival)

    @property
    def num_steps(self) -> int:
        """Steps simulated."""
        return len(self.step_end)

    def request_segments(self, rid: int) -> list[tuple[int, int]]:
        """(emitting step, last step it could decode in) of each stretch a request ran without
        being preempted; one stretch unless it was preempted. Empty if it never emitted."""
        if rid in self.segments:
            return self.segments[rid]
        a, b = self.first_step[rid], self.finish_step[rid]
        return [] if a < 0 else [(a, b)]

    def token_steps(self, rid: int) -> list[int]:
        """The steps in which request `rid` emitted its tokens, in order (one per token)."""
        skipped = set(self.skips.get(rid, ()))
        dec = self.step_decodes
        out: list[int] = []
        for a, b in self.request_segments(rid):
            out.append(a)
            out.extend(s for s in range(a + 1, b + 1) if dec[s] and s not in skipped)
        return out

    def token_times(self, rid: int) -> list[float]:
        """When request `rid` emitted each token, s (the end of each step in token_steps)."""
        end = self.step_end
        return [end[s] for s in self.token_steps(rid)]

    def num_tokens(self, rid: int) -> int:
        """Tokens request `rid` emitted, counted in O(1) from the step arrays (plus its exceptions)."""
        ticks, total = self.step_ticks, 0
        skips = self.skips.get(rid, ())
        for a, b in self.request_segments(rid):
            total += 1 + ticks[b] - ticks[a] - sum(1 for s in skips if a < s <= b)
        return total

    def timelines(self) -> list[Any]:
        """One stallfree.core.metrics.RequestTimeline per request that was not rejected."""
        out = []
        for r in range(self.num_requests):
            if self.finish_step[r] < 0 or not self.owns(r):
                continue
            adm = self.admit_step[r]
            out.append(
                RequestTimeline(
                    rid=r,
                    arrival=self.arrival[r],
                    token_times=tuple(self.token_times(r)),
                    prompt_len=self.prompt_len[r],
                    admitted=self.step_start[adm] if adm >= 0 else None,
                    finish=self.step_end[self.finish_step[r]],
                )
            )
        return out


def verify_tokens(res: SimResult) -> None:
    """Check that every request that finished (not aborted, not shed by a queue time limit) emitted exactly
    its target tokens.

    Raises:
        SimulationError: a request emitted more or fewer tokens than res.target says.
    """
    for r in range(res.num_requests):
        if res.finish_step[r] >= 0 and res.finish_reason[r] not in ("abort", "timeout") and res.owns(r):
            got = res.num_tokens(r)
            if got != res.target[r]:
                raise SimulationError(
                    f"request {r} emitted {got} tokens, expected {res.target[r]} "
                    f"(finish reason {res.finish_reason[r]!r})"
                )


def verify_cluster_tokens(results: Sequence[SimResult], owner: Sequence[int]) -> None:
    """verify_tokens for a cluster's replicas sharing per-request arrays: each request checked once, in its
    own replica's result (`owner[rid]`, the index in `results`; -1: none), O(requests) in all rather than
    per replica.

    Raises:
        SimulationError: as verify_tokens.
    """
    if not results:
        return
    first = results[0]
    finish_step, finish_reason, target = first.finish_step, first.finish_reason, first.target
    for r, k in enumerate(owner):
        if k >= 0 and finish_step[r] >= 0 and finish_reason[r] not in ("abort", "timeout"):
            got = results[k].num_tokens(r)
            if got != target[r]:
                raise SimulationError(
                    f"request {r} emitted {got} tokens, expected {target[r]} (finish reason {finish_reason[r]!r})"
                )
