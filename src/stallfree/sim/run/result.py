"""What one simulation records and what it needs of a scheduler: SimResult, the SchedulerLike
protocol, the request states of the event loop, the kinds of rejection and SimulationError.

Imports allowed: the standard library and stallfree.core.

SimResult stores per-token times without per-token objects: a request emits its first token at the
end of the step of its last prefill chunk and then one per step it decodes in, so its token times
are the end times of those steps. Per step it keeps its end time and its decodes (how many decode
steps have happened so far is counted from them: DecodeTicks); per request only the step of its first
token and of its finish, plus the rare exceptions: steps in which a decoding request was left out
while others decoded (decode overflow, `skips`) and preemptions (`segments`). Steps with no decodes
at all (prefill-only steps) are seen from the step arrays.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Hashable, Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import accumulate, compress, count, islice, repeat
from operator import eq, ne
from typing import Any, Protocol

from stallfree.core.errors import StallfreeError
from stallfree.core.metrics import RequestTimeline
from stallfree.core.plan import StepPlan
from stallfree.core.queries import SchedulerStats
from stallfree.core.request import FinishReason, Request

__all__ = [
    "CONTEXT_LENGTH",
    "DecodeTicks",
    "StepStarts",
    "KV_CAPACITY",
    "ClusterError",
    "RequestState",
    "SchedulerLike",
    "SimResult",
    "same_float",
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


class DecodeTicks:
    """SimResult.step_ticks: per step, the steps with decodes so far, this one included (the decode
    "ticks"), derived from the result's step_decodes instead of stored (4 bytes a step less).

    It takes rows as the other step columns do (append(x), extend(iterable)) but keeps nothing of
    them: a replica's tick count is, by definition, its steps with decodes so far, which step_decodes
    already holds. Reading it (len, an index or slice, iteration) counts them: the counts are made on
    the first read, kept while no step is added, and let go by release().

    Args:
        decodes: the result's step_decodes (any sequence of ints, read as it grows).
    """

    __slots__ = ("_cache", "append", "decodes")

    def __init__(self, decodes: Sequence[int]) -> None:
        self.decodes = decodes
        # A C function that takes one row's value and keeps nothing: the hot loop's append costs no more
        # than an array's.
        self.append = id
        self._cache: array[int] | None = None

    def extend(self, values: Iterable[int]) -> None:
        """Take a run of rows' values (not kept: see the class docstring)."""

    def __len__(self) -> int:
        return len(self.decodes)

    def _ticks(self) -> array[int]:
        cache = self._cache
        if cache is None or len(cache) != len(self.decodes):
            cache = self._cache = array("i", accumulate(map(bool, self.decodes)))  # C-level: True counts 1
        return cache

    def __getitem__(self, i: Any) -> Any:
        return self._ticks()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ticks())

    def release(self) -> None:
        """Let go of the counts made by a read (the next read makes them again)."""
        self._cache = None


def same_float(a: float, b: float) -> bool:
    """a and b are the same float, bit for bit (0.0 and -0.0 differ; NaN is never the same)."""
    return a == b and (a != 0.0 or str(a) == str(b))


class StepStarts:
    """A result's step_start, s, held as its exceptions to "a step starts when the step before it
    ended" (a replica runs its steps back to back while it has work): `at` lists the steps whose start
    is not the previous step's end, bit for bit (the first always), `value` their starts; every other
    start is read from `end`. Read-only: len, an index (negative ones too) or slice, iteration, as the
    array it replaces (a cluster's results hold one after the merge: 8 bytes a step less).

    Args:
        end: the result's step_end (any sequence of floats, s).
        at: the steps with a start of their own, ascending (array('q')).
        value: their starts, s (array('d')), as long as `at`.

    Raises:
        ValueError: `at` and `value` differ in length.
    """

    __slots__ = ("at", "end", "value")

    def __init__(self, end: Sequence[float], at: array[int], value: array[float]) -> None:
        if len(at) != len(value):
            raise ValueError(f"StepStarts: {len(at)} steps but {len(value)} starts")
        self.end, self.at, self.value = end, at, value

    @classmethod
    def of(cls, start: Sequence[float], end: Sequence[float], base: int = 0,
           at: array[int] | None = None, value: array[float] | None = None) -> StepStarts:
        """The exceptions of `start` against `end` (the same steps), appended to `at` and `value` (new
        ones if None) with their step numbers shifted by `base`; a StepStarts over `end` with them."""
        at = array("q") if at is None else at
        value = array("d") if value is None else value
        if len(start):
            at.append(base)
            value.append(start[0])
        # start[i] against end[i - 1] (`end` is one longer than the starts after the first), compared at C
        # speed; equal zeros (0.0 == -0.0) are looked at again for their signs.
        own = list(compress(count(1), map(ne, islice(start, 1, None), end)))
        zeros = [i for i in compress(count(1), map(eq, islice(start, 1, None), repeat(0.0)))
                 if end[i - 1] == 0.0 and not same_float(start[i], end[i - 1])]
        for i in sorted(own + zeros) if zeros else own:
            at.append(base + i)
            value.append(start[i])
        return cls(end, at, value)

    def __len__(self) -> int:
        return len(self.end)

    def _one(self, i: int) -> float:
        n = len(self.end)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"step {i} out of range (0 to {n - 1})")
        j = bisect_right(self.at, i) - 1
        if j >= 0 and self.at[j] == i:
            return self.value[j]
        return self.end[i - 1]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return array("d", (self._one(k) for k in range(*i.indices(len(self.end)))))
        return self._one(int(i))

    def __iter__(self) -> Iterator[float]:
        at, value, end = self.at, self.value, self.end
        j, na = 0, len(at)
        for i in range(len(end)):
            if j < na and at[j] == i:
                yield value[j]
                j += 1
            else:
                yield end[i - 1]


@dataclass(slots=True)
class SimResult:
    """Everything one simulation recorded. Requests are indexed by workload position (their rid).

    Per request (lists of length n): arrival (s), prompt_len, target (output tokens it should
    receive: min(output_len, max_new)), max_new (its reservation), admit_step / first_step /
    finish_step (step numbers, -1 if it never happened, e.g. rejected) and finish_reason ("length",
    "stop", "" if rejected). Per step (arrays): start and end (s), num_tokens, num_decodes,
    kv_used (reserved KV after the step, tokens), num_waiting (after the step), ticks (decode steps
    so far, including this one: a DecodeTicks, counted from step_decodes, not stored). `skips` and
    `segments` hold the rare irregular histories (see the module docstring). `rejected` lists (rid,
    reason); `rejected_kind` maps each rejected rid to its kind: "context_length" (prompt plus
    reserved output over the model's context length, refused at arrival) or "kv_capacity" (its
    reservation can never fit the KV cache).
    With LoRA adapters (stallfree.sim.run.lora): `lora` names each request's adapter (None: the base
    model), `lora_load_s` the seconds its adapter's loads took for it (0: a warm start), and
    lora_loads / lora_storage_loads count the adapters loaded into GPU slots / read from storage.
    """

    label: str
    workload: str
    config: dict[str, Any]
    arrival: Sequence[float]
    prompt_len: Sequence[int]
    target: MutableSequence[int]
    max_new: MutableSequence[int]
    admit_step: MutableSequence[int]
    first_step: MutableSequence[int]
    finish_step: MutableSequence[int]
    finish_reason: MutableSequence[str]
    rejected: list[tuple[int, str]]
    kv_total: int
    # A cluster's results hold a StepStarts after the merge (the same values, read-only).
    step_start: array[float] = field(default_factory=lambda: array("d"))
    step_end: array[float] = field(default_factory=lambda: array("d"))
    # The integer step arrays are C ints (array "i", 4 bytes: a step's tokens, decodes, reserved KV and
    # waiting requests, and the decode steps so far, are all far below 2**31; a value past it raises
    # OverflowError rather than wrapping): a run's step rows are most of what it holds. A simulation's
    # step_tokens and step_decodes are 2-byte ones ("H") where its scheduler's token budget and max_seqs
    # bound them by 65,535 (simulator.step_count_codes).
    step_tokens: array[int] = field(default_factory=lambda: array("i"))
    step_decodes: array[int] = field(default_factory=lambda: array("i"))
    step_kv_used: array[int] = field(default_factory=lambda: array("i"))
    step_waiting: array[int] = field(default_factory=lambda: array("i"))
    # Derived from step_decodes (DecodeTicks), not stored: made in __post_init__ unless given.
    step_ticks: DecodeTicks = None  # type: ignore[assignment]
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
    #: A run that kept no records (simulate(records=False)): its figures, built as it ran
    #: (stallfree.sim.run.tally.RunTally); its step arrays are then empty and its per-request step numbers
    #: say only which requests started and finished. None: every record is kept.
    tally: Any = None

    def __post_init__(self) -> None:
        if self.step_ticks is None:
            self.step_ticks = DecodeTicks(self.step_decodes)

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
    try:
        for r in range(res.num_requests):
            if res.finish_step[r] >= 0 and res.finish_reason[r] not in ("abort", "timeout") and res.owns(r):
                got = res.num_tokens(r)
                if got != res.target[r]:
                    raise SimulationError(
                        f"request {r} emitted {got} tokens, expected {res.target[r]} "
                        f"(finish reason {res.finish_reason[r]!r})"
                    )
    finally:
        res.step_ticks.release()  # the counts its reads made (4 bytes a step)


def verify_cluster_tokens(results: Sequence[SimResult], owner: Sequence[int]) -> None:
    """verify_tokens for a cluster's replicas sharing per-request arrays: each request checked once, in its
    own replica's result (`owner[rid]`, the index in `results`; -1: none), O(requests) in all rather than
    per replica. One replica at a time (its requests gathered first, 4 bytes each), so that the decode-tick
    counts its reads make (DecodeTicks, 4 bytes a step) are held for one replica, not every one at once.

    Raises:
        SimulationError: as verify_tokens.
    """
    if not results:
        return
    first = results[0]
    finish_step, finish_reason, target = first.finish_step, first.finish_reason, first.target
    mine: list[array[int]] = [array("i") for _ in results]
    for r, k in enumerate(owner):
        if k >= 0:
            mine[k].append(r)
    first_step = first.first_step
    for k, res in enumerate(results):
        irregular = res.segments.keys() | res.skips.keys()
        try:
            ticks = res.step_ticks
            counts = ticks._ticks() if isinstance(ticks, DecodeTicks) else ticks  # read once, not per request
            for r in mine[k]:
                b = finish_step[r]
                if b < 0:
                    continue
                a = first_step[r]
                if r in irregular or a < 0:
                    got = res.num_tokens(r)
                else:
                    # Neither preempted nor skipped: its first token, then one in each step with decodes up
                    # to its finish (num_tokens of one segment without skips).
                    got = 1 + counts[b] - counts[a]
                if got != target[r] and finish_reason[r] not in ("abort", "timeout"):
                    raise SimulationError(
                        f"request {r} emitted {got} tokens, expected {target[r]} "
                        f"(finish reason {finish_reason[r]!r})"
                    )
        finally:
            res.step_ticks.release()  # the counts its reads made (4 bytes a step)
        mine[k] = array("i")
