"""The discrete-event simulator: replays a Workload through a scheduler, pricing each StepPlan with a
cost model, and records when every request arrived, was admitted, and emitted each token.

Imports allowed: the standard library, stallfree.core and stallfree.sim (its stdlib modules only).

Time model. The clock starts at the first arrival. Before each step every request that has arrived
by then (arrival <= now) is added, in workload order; then the step is scheduled, its duration is
cost_model.step_time(plan), and its tokens are emitted at its end. With nothing to run the clock
jumps to the next arrival. Requests the scheduler rejects (they can never fit) are counted and
reported, not dropped silently.

Per-token times are derived, not stored: a request emits its first token at the end of the step
of its last prefill chunk and then one per step it decodes in, so its token times are the end
times of those steps. The simulator keeps, per step, its end time and how many decode steps have
happened so far; per request only the step of its first token and of its finish, plus the rare
exceptions: steps in which a decoding request was left out while others decoded (decode overflow)
and preemptions (paged schedulers). Steps with no decodes at all (prefill-only steps) are seen
from the step arrays. So the loop costs O(prefill chunks + finishes) per step, never O(decodes).

Why one module of over 400 lines: the event loop and the per-step bookkeeping it writes into
SimResult are one hot loop whose state (step arrays, exception lists) is read by SimResult's
derived views; kept together so that the cost of a step stays visible in one place.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from stallfree.core.errors import RequestRejected, StallfreeError
from stallfree.core.invariants import InvariantChecker
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request
from stallfree.core.scheduler import Scheduler
from stallfree.sim.baselines import NoChunkScheduler, PrefillFirstScheduler
from stallfree.sim.costs import StepCostModel
from stallfree.sim.load import Arrivals, ClosedLoop
from stallfree.sim.workload import Workload

__all__ = [
    "BATCHING_MODES",
    "SchedulerConfig",
    "SchedulerLike",
    "SimResult",
    "SimulationError",
    "saturated_throughput",
    "simulate",
]

#: Batching modes: the contract (chunked prefill) and the two baselines of stallfree.sim.baselines.
BATCHING_MODES = ("chunked", "prefill-first", "no-chunk")


class SimulationError(StallfreeError, RuntimeError):
    """The simulation cannot go on: a scheduler made no progress, emitted inconsistently, or the
    invariant checker is unavailable."""


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


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """A picklable description of a scheduler, so that a worker process can build its own.

    Args:
        kv_tokens: KV cache capacity, tokens.
        token_budget: tokens per step, >= 1.
        max_seqs: the most running requests, >= 1.
        batching: "chunked" (stallfree.Scheduler, the contract), "prefill-first" or "no-chunk".
        kv: "reserve" (prompt_len + max_new reserved at admission) or "paged" (stallfree.PagedScheduler:
            blocks of `block_size` tokens taken as tokens are computed, `watermark` of the blocks kept
            free at admission, preemption by recompute); "paged" applies to chunked batching only.
        block_size: tokens per KV block (paged).
        watermark: fraction of blocks kept free at admission (paged), in [0, 1).
        prefix_caching: paged only: enable_prefix_caching=True; requests carry the workload's
            prefix blocks as block hashes (Workload.block_hashes).
        partial_prefills: None (the contract), or (K, L, T): Scheduler's max_num_partial_prefills,
            max_long_partial_prefills and long_prefill_token_threshold (chunked batching only).

    Raises:
        ValueError: an unknown batching or kv mode, kv="paged" with a baseline, or prefix_caching
            without kv="paged" (the numbers are checked by the scheduler at build()).
    """

    kv_tokens: int
    token_budget: int = 2048
    max_seqs: int = 256
    batching: str = "chunked"
    kv: str = "reserve"
    block_size: int = 16
    watermark: float = 0.01
    prefix_caching: bool = False
    partial_prefills: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}; got {self.batching!r}")
        if self.kv not in ("reserve", "paged"):
            raise ValueError(f"kv must be 'reserve' or 'paged'; got {self.kv!r}")
        if self.kv == "paged" and self.batching != "chunked":
            raise ValueError(f"the paged scheduler runs chunked batching only; got batching={self.batching!r}")
        if self.prefix_caching and self.kv != "paged":
            raise ValueError(f"prefix caching needs the paged scheduler (kv='paged'); got kv={self.kv!r}")

    def build(self) -> SchedulerLike:
        """Make a fresh scheduler.

        Raises:
            InvalidConfig: a number is out of range.
        """
        if self.partial_prefills is not None and self.batching == "chunked":
            k, lng, thr = self.partial_prefills
            paged = {"kv_policy": "paged", "block_size": self.block_size, "watermark": self.watermark,
                     "enable_prefix_caching": self.prefix_caching}
            return Scheduler(
                self.token_budget, self.max_seqs, self.kv_tokens, max_num_partial_prefills=k,
                max_long_partial_prefills=lng, long_prefill_token_threshold=thr,
                **(paged if self.kv == "paged" else {}),  # type: ignore[arg-type]
            )
        if self.kv == "paged":
            return Scheduler(
                self.token_budget, self.max_seqs, self.kv_tokens, kv_policy="paged",
                block_size=self.block_size, watermark=self.watermark, enable_prefix_caching=self.prefix_caching,
            )
        classes: dict[str, Callable[[int, int, int], SchedulerLike]] = {
            "chunked": Scheduler,
            "prefill-first": PrefillFirstScheduler,
            "no-chunk": NoChunkScheduler,
        }
        return classes[self.batching](self.token_budget, self.max_seqs, self.kv_tokens)

    @property
    def label(self) -> str:
        """A short name for tables: "chunked/2048", or "paged/2048" for the paged scheduler."""
        kind = ("paged+cache" if self.prefix_caching else "paged") if self.kv == "paged" else self.batching
        base = f"{kind}/{self.token_budget}"
        if self.partial_prefills is not None:
            base += "/K{}L{}T{}".format(*self.partial_prefills)
        return base


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
    step_tokens: array[int] = field(default_factory=lambda: array("q"))
    step_decodes: array[int] = field(default_factory=lambda: array("q"))
    step_kv_used: array[int] = field(default_factory=lambda: array("q"))
    step_waiting: array[int] = field(default_factory=lambda: array("q"))
    step_ticks: array[int] = field(default_factory=lambda: array("q"))
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
    rejected_kind: dict[int, str] = field(default_factory=dict)

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
        from stallfree.core.metrics import RequestTimeline

        out = []
        for r in range(self.num_requests):
            if self.finish_step[r] < 0:
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


def _make_scheduler(scheduler: SchedulerConfig | Callable[[], SchedulerLike]) -> SchedulerLike:
    if isinstance(scheduler, SchedulerConfig):
        return scheduler.build()
    return scheduler()


def _wrap_checker(sched: SchedulerLike) -> SchedulerLike:
    # One checker for both KV policies (and for a time-budget wrapper, which reads as a Scheduler).
    return cast(SchedulerLike, InvariantChecker(sched))  # type: ignore[arg-type]


def simulate(
    workload: Workload,
    scheduler: SchedulerConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    max_tokens: int | None = None,
    check: bool = False,
    label: str | None = None,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
    closed_loop: ClosedLoop | None = None,
) -> SimResult:
    """Replay `workload` through a fresh scheduler, pricing steps with `cost_model`.

    Args:
        workload: the requests (arrival s, prompt and output lengths in tokens).
        scheduler: a SchedulerConfig, or a zero-argument factory returning any object with the
            add()/schedule()/complete() interface and last_finished, kv_free, num_waiting,
            has_unfinished(). (Picklable when it is a SchedulerConfig, for worker processes.)
        cost_model: anything with step_time(plan) -> seconds.
        max_tokens: each request's max_new (its KV reservation); a request whose real output is
            shorter stops early (the scheduler's stop_after(), finish reason "stop"), a longer one is cut
            at max_tokens ("length"). None: max_new = the output length.
        check: wrap the scheduler in stallfree.core.invariants.InvariantChecker (raises on the
            first violated invariant).
        label: a name for reports (default: the config's label).
        max_model_len: the model's context length, tokens, or None for no limit. A request whose
            prompt_len + max_new exceeds it is refused at arrival (kind "context_length"), as vLLM's
            server answers a request whose prompt plus max_tokens exceeds max_model_len with a 400.
        cut_output_to_fit: instead, cut max_new to max_model_len - prompt_len (what vLLM does when
            the client sets no max_tokens), refusing only a prompt that leaves no room for one token.
        closed_loop: None (open loop: the workload's arrival times), or a ClosedLoop: that many
            requests in flight, the next sent (in workload order) think_time after one ends; the
            workload's arrival times are then ignored (stallfree.sim.load). The result's arrival
            holds the times the requests were sent, and its config concurrency and think_time_s.

    Returns:
        A SimResult; every request not rejected has received exactly min(output_len, max_new) tokens.

    Raises:
        ValueError: max_tokens < 1 or max_model_len < 1.
        SimulationError: the scheduler stalled with work left, emitted inconsistently with its
            plans, or check=True without an invariant checker available.
        InvariantViolation (from the checker): with check=True, a violated invariant.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    inner = _make_scheduler(scheduler)
    sched = _wrap_checker(inner) if check else inner
    max_new, too_long, target, config, label = _run_plan(
        workload, scheduler, cost_model, max_tokens, max_model_len, cut_output_to_fit, label, closed_loop
    )
    kv_total = int(getattr(inner, "kv_total", 0))
    n = len(workload)
    res = SimResult(
        label=label or type(inner).__name__,
        workload=workload.name,
        config=config,
        arrival=workload.arrivals,
        prompt_len=workload.prompt_lens,
        target=target,
        max_new=max_new,
        admit_step=[-1] * n,
        first_step=[-1] * n,
        finish_step=[-1] * n,
        finish_reason=[""] * n,
        rejected=[],
        kv_total=kv_total,
    )
    arrivals = Arrivals(workload, closed_loop)
    t0 = time.perf_counter()
    _Loop(res, sched, inner, workload, cost_model, too_long, arrivals).run()
    res.wall_s = time.perf_counter() - t0
    if closed_loop is not None:
        res.arrival = tuple(arrivals.times)
    res.num_preemptions = int(getattr(inner, "num_preemptions", 0))
    res.num_recomputed_tokens = int(getattr(inner, "num_recomputed_tokens", 0))
    if getattr(inner, "enable_prefix_caching", False):
        queries = int(getattr(inner, "prefix_cache_queries", 0))
        res.prefix_cache_hit_rate = int(getattr(inner, "prefix_cache_hits", 0)) / queries if queries else 0.0
        first = int(getattr(inner, "prefix_cache_first_queries", 0))
        res.prefix_cache_hit_rate_first_admission = (
            int(getattr(inner, "prefix_cache_first_hits", 0)) / first if first else 0.0)
        res.prefix_cache_evictions = int(getattr(inner, "num_evictions", 0))
        res.prefix_cache_hit_rate_bound = workload.prefix_hit_bound(int(getattr(inner, "block_size", 16)))
    if check:
        # End-of-run invariants: every request finished and all KV returned.
        sched.check_final()  # type: ignore[attr-defined]
    _verify_tokens(res)
    return res


#: Kinds of rejection (SimResult.rejected_kind).
CONTEXT_LENGTH = "context_length"
KV_CAPACITY = "kv_capacity"


def _context_overflows(
    workload: Workload, max_new: list[int], max_model_len: int | None, cut: bool
) -> dict[int, str]:
    """The requests refused for the context length, rid -> reason; with `cut`, shortens max_new in place."""
    if max_model_len is None:
        return {}
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be an integer >= 1 token, got {max_model_len!r}")
    out: dict[int, str] = {}
    for i, p in enumerate(workload.prompt_lens):
        m = max_new[i]
        if p + m <= max_model_len:
            continue
        if cut and p < max_model_len:
            max_new[i] = max_model_len - p
            continue
        out[i] = (
            f"request {i}: prompt_len {p} + max_new {m} = {p + m} tokens exceeds the model's context "
            f"length {max_model_len}"
            if not cut
            else f"request {i}: prompt_len {p} leaves no room for output in the model's context length "
            f"{max_model_len}"
        )
    return out


def _verify_tokens(res: SimResult) -> None:
    for r in range(res.num_requests):
        if res.finish_step[r] >= 0 and res.finish_reason[r] != "abort":
            got = res.num_tokens(r)
            if got != res.target[r]:
                raise SimulationError(
                    f"request {r} emitted {got} tokens, expected {res.target[r]} "
                    f"(finish reason {res.finish_reason[r]!r})"
                )


_DECODING = 2
_DONE = 3


class _Loop:
    """One run of the event loop; state that only the loop touches, in local-friendly attributes."""

    def __init__(
        self,
        res: SimResult,
        sched: SchedulerLike,
        inner: SchedulerLike,
        workload: Workload,
        cost_model: StepCostModel,
        too_long: dict[int, str] | None = None,
        arrivals: Arrivals | None = None,
    ) -> None:
        self.res, self.sched, self.inner, self.wl, self.cost = res, sched, inner, workload, cost_model
        self.too_long = too_long or {}
        self.arrivals = arrivals if arrivals is not None else Arrivals(workload)
        self.closed = self.arrivals.closed is not None  # a request's end sends the next one
        n = len(workload)
        # What the loop records, not what the scheduler tracks: a request whose output is shorter than its
        # max_new is handed to the scheduler's stop_after(), which ends it on its last wanted token.
        self.state = bytearray(n)  # 0 waiting or prefilling, 2 decoding, 3 done or rejected
        self.decoding: set[int] = set()  # to see skipped decodes (for the token times)
        self.tick = 0  # steps with decodes so far (res.step_ticks)
        self.seg_open: dict[int, int] = {}  # emitting step of the current stretch after a preemption

    def run(self) -> None:
        res, wl, sched, inner = self.res, self.wl, self.sched, self.inner
        arr, plens, max_new = self.arrivals.times, wl.prompt_lens, res.max_new
        ended = self.arrivals.ended if self.closed else None
        n = len(arr)
        add, schedule, complete = sched.add, sched.schedule, sched.complete
        stop_after = getattr(sched, "stop_after", None)
        target = res.target
        if stop_after is None and any(t < m for t, m in zip(target, max_new, strict=True)):
            raise SimulationError(
                f"{type(inner).__name__} has no stop_after(), needed for outputs shorter than max_new"
            )
        step_time = self.cost.step_time
        kv_total = res.kv_total
        s_start, s_end, s_tok = res.step_start.append, res.step_end.append, res.step_tokens.append
        s_dec, s_kv, s_wait = res.step_decodes.append, res.step_kv_used.append, res.step_waiting.append
        s_tick = res.step_ticks.append
        admit_step, state, decoding = res.admit_step, self.state, self.decoding
        i, step = 0, 0
        now = arr[0] if n else 0.0
        caching = bool(getattr(inner, "enable_prefix_caching", False)) and wl.prefix_ids is not None
        hashes, bs = wl.block_hashes, int(getattr(inner, "block_size", 0) or 1)
        too_long, kinds = self.too_long, res.rejected_kind
        while True:
            while i < n and arr[i] <= now:
                if too_long and i in too_long:
                    # Refused at arrival, before the scheduler sees it (a server's 400).
                    res.rejected.append((i, too_long[i]))
                    kinds[i] = CONTEXT_LENGTH
                    state[i] = _DONE
                    if ended is not None:
                        ended(now)
                    i += 1
                    continue
                try:
                    add(Request(i, plens[i], max_new[i], 0, arr[i], hashes(i, bs) if caching else None))
                except RequestRejected as exc:
                    res.rejected.append((i, str(exc)))
                    kinds[i] = KV_CAPACITY
                    state[i] = _DONE
                    if ended is not None:
                        ended(now)
                else:
                    if target[i] < max_new[i]:
                        stop_after(i, target[i])  # type: ignore[misc]
                i += 1
            if not inner.has_unfinished():
                if i >= n:
                    break
                if arr[i] == math.inf:
                    raise SimulationError(f"closed-loop load: request {i} is never sent with nothing in flight")
                now = arr[i]
                continue
            plan = schedule()
            nd = plan.num_decodes
            if plan.preempted:
                self._preempt(plan.preempted, step)
            if nd != len(decoding):
                self._skips(plan, step)
            for rid in plan.admitted:
                if admit_step[rid] < 0:  # type: ignore[call-overload]
                    admit_step[rid] = step  # type: ignore[call-overload]
            start = now
            now += step_time(plan)
            complete(plan)
            if nd:
                self.tick += 1
            if plan.prefills:
                self._emitted_from_prefill(plan, step)
            s_start(start)
            s_end(now)
            s_tok(plan.num_tokens)
            s_dec(nd)
            s_kv(kv_total - inner.kv_free)
            s_wait(inner.num_waiting)
            s_tick(self.tick)
            # After this step's row is recorded: closing a preempted request's segments reads it.
            finished = inner.last_finished
            if finished:
                self._finished(finished, step)
            step += 1
            if not plan.num_tokens and not plan.preempted:
                if i >= n or arr[i] == math.inf:
                    raise SimulationError(f"the scheduler made no progress at step {step - 1} with work left")
                now = max(now, arr[i])

    def _emitted_from_prefill(self, plan: StepPlan, step: int) -> None:
        """A last prefill chunk emitted a token: the first, or the next after a preemption."""
        res = self.res
        for c in plan.prefills:
            if not c.is_last:
                continue
            r = cast(int, c.rid)
            if res.first_step[r] < 0:
                res.first_step[r] = step
            else:
                self.seg_open[r] = step
            self.state[r] = _DECODING
            self.decoding.add(r)

    def _finished(self, finished: dict[Hashable, FinishReason], step: int) -> None:
        res = self.res
        for r, why in finished.items():
            ri = cast(int, r)
            res.finish_step[ri] = step
            res.finish_reason[ri] = str(why)
            if self.state[ri] == _DECODING:
                self.decoding.discard(ri)
            self.state[ri] = _DONE
            if ri in self.seg_open or ri in res.segments:
                self._close_segment(ri, step)
            if self.closed:
                self.arrivals.ended(res.step_end[step])

    def _skips(self, plan: StepPlan, step: int) -> None:
        """Some decoding requests are not decoding in this step: record it (rare but for steps
        without any decode, which the step arrays already show)."""
        nd = plan.num_decodes
        if nd > len(self.decoding):
            raise SimulationError(
                f"step {step} decodes {nd} requests but only {len(self.decoding)} have a first token"
            )
        if nd == 0:
            return
        present = set(plan.decode_rids)
        for r in self.decoding - present:
            self.res.skips.setdefault(r, []).append(step)

    def _preempt(self, rids: Iterable[Hashable], step: int) -> None:
        """Preempted requests (paged schedulers) stop decoding until their recompute prefill ends."""
        for rid in rids:
            r = cast(int, rid)
            if self.state[r] != _DECODING:
                continue
            self._close_segment(r, step - 1)
            self.state[r] = 0
            self.decoding.discard(r)

    def _close_segment(self, r: int, last: int) -> int:
        """End request r's current stretch at step `last`; return its tokens so far."""
        res = self.res
        segs = res.segments.setdefault(r, [])
        start = self.seg_open.pop(r, res.first_step[r])
        segs.append((start, last))
        return res.num_tokens(r)


def _run_plan(
    workload: Workload,
    scheduler: SchedulerConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    max_tokens: int | None,
    max_model_len: int | None,
    cut_output_to_fit: bool,
    label: str | None,
    closed_loop: ClosedLoop | None = None,
) -> tuple[list[int], dict[int, str], list[int], dict[str, Any], str | None]:
    """What a run decides before its loop, shared by simulate() and the cluster's simulate_cluster():
    (max_new per request, requests refused for the context length, tokens each will emit, the
    result's config record, the label)."""
    n = len(workload)
    outs = workload.output_lens
    max_new = list(outs) if max_tokens is None else [max_tokens] * n
    too_long = _context_overflows(workload, max_new, max_model_len, cut_output_to_fit)
    target = [min(o, m) for o, m in zip(outs, max_new, strict=True)]
    config: dict[str, Any] = {"cost_model": repr(cost_model), "max_tokens": max_tokens}
    frontend = getattr(cost_model, "frontend_s", 0.0)  # an engine profile's front end (report adds it)
    if frontend:
        config["frontend_s"] = float(frontend)
    if max_model_len is not None:
        config.update(max_model_len=max_model_len, cut_output_to_fit=cut_output_to_fit)
    if closed_loop is not None:
        config.update(concurrency=closed_loop.concurrency, think_time_s=closed_loop.think_time)
    if isinstance(scheduler, SchedulerConfig):
        config.update(
            batching=scheduler.batching,
            token_budget=scheduler.token_budget,
            max_seqs=scheduler.max_seqs,
            kv_tokens=scheduler.kv_tokens,
            kv=scheduler.kv,
        )
        label = label or scheduler.label
    return max_new, too_long, target, config, label


def saturated_throughput(
    workload: Workload,
    scheduler: SchedulerConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    max_tokens: int | None = None,
    sample: int = 5000,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
) -> float:
    """Estimate a replica's capacity, requests/s: the first `sample` requests all arriving at 0 s,
    completed requests over the time to finish them all.

    The drain at the end (fewer requests left than max_seqs) makes this a slight underestimate;
    with 5,000 requests and max_seqs 256 it is a few percent. Requests refused for the context
    length (max_model_len, cut_output_to_fit: as simulate) do not count. Infinite when no step ran.

    Raises:
        ValueError: the workload is empty or sample < 1.
    """
    if len(workload) == 0 or sample < 1:
        raise ValueError(
            f"saturated_throughput needs requests and sample >= 1, got {len(workload)}, {sample}"
        )
    head = workload.head(sample)
    burst = Workload((0.0,) * len(head), head.prompt_lens, head.output_lens, head.name)
    res = simulate(
        burst, scheduler, cost_model, max_tokens, max_model_len=max_model_len, cut_output_to_fit=cut_output_to_fit
    )
    done = sum(1 for f in res.finish_step if f >= 0)
    return done / res.step_end[-1] if res.num_steps and res.step_end[-1] > 0 else float("inf")
