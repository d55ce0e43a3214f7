"""The simulator's single-replica entry point: replays a Workload through a scheduler, pricing each
StepPlan with a cost model, and records when every request arrived, was admitted, and emitted each
token. Also the replica's scheduler record (ReplicaConfig) and what every run decides before its loop.

Imports allowed: the standard library, stallfree.core and stallfree.sim (its stdlib modules only).

Time model. The clock starts at the first arrival. Before each step every request that has arrived
by then (arrival <= now) is added, in workload order; then the step is scheduled, its duration is
cost_model.step_time(plan), and its tokens are emitted at its end. With nothing to run the clock
jumps to the next arrival. Requests the scheduler rejects (they can never fit) are counted and
reported, not dropped silently. The loop itself is stallfree.sim.run.loop.EventLoop with one
stallfree.sim.run.replica.Replica and the trivial router; a cluster (stallfree.sim.run.cluster) is the
same loop with N replicas, disaggregation (stallfree.sim.run.disagg) two groups and a transfer hook.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any, cast

from stallfree.core.kv_tier import TieredKV
from stallfree.core.queries import SchedulerStats
from stallfree.core.request import DEFAULT_TENANT, Request
from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig, async_of, make_scheduler, wrap_checker
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, PassGate, Router
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    SchedulerLike,
    SimResult,
    SimulationError,
    verify_tokens,
)
from stallfree.sim.run.session_run import SessionArrivals, SessionEntry, close_sessions, run_sessions
from stallfree.sim.run.tally import RunTally

__all__ = [
    "CONTEXT_LENGTH",
    "KV_CAPACITY",
    "SATURATION_SAMPLE",
    "SATURATION_STEPS",
    "SATURATION_WINDOWS",
    "SchedulerLike",
    "SimResult",
    "SimulationError",
    "new_result",
    "no_records_tally",
    "plan_run",
    "request_maker",
    "run_group",
    "saturated_throughput",
    "saturation_sample",
    "shared_fields",
    "simulate",
]


def _stats(inner: object) -> SchedulerStats:
    """`inner`'s SchedulerStats (every scheduler the simulator builds has stats())."""
    return cast(SchedulerLike, inner).stats()


#: The largest value of a 2-byte step column (array "H").
_NARROW_MAX = 0xFFFF


def step_count_codes(inner: object) -> tuple[str, str]:
    """The array type codes of a result's step_tokens and step_decodes for the scheduler `inner`: "H" (2
    bytes, unsigned) where its configuration bounds the column by 65,535 (a Scheduler spends at most its
    token budget in a step and runs at most max_seqs requests: invariants its checker tests), else "i" (4
    bytes). A run's step rows are most of its memory (docs/costmodel.md, "Whole runs"); a value past a
    column's type raises OverflowError when written, never wraps."""
    from stallfree.core.scheduler import Scheduler

    cfg = inner.config if isinstance(inner, Scheduler) else None
    budget, seqs = getattr(cfg, "token_budget", None), getattr(cfg, "max_seqs", None)

    def code(limit: object) -> str:
        return "H" if isinstance(limit, int) and 0 < limit <= _NARROW_MAX else "i"

    return code(budget), code(seqs)


def new_result(
    label: str, wl: Workload, config: dict[str, Any], target: list[int], max_new: list[int], inner: object,
    shared: tuple[Any, Any, Any, list[str]] | None = None,
) -> SimResult:
    """An empty SimResult for `wl` (no step, no request started), KV total from `inner`'s stats() (0 for None),
    its step_tokens and step_decodes of step_count_codes(inner).

    shared: (admit_step, first_step, finish_step, finish_reason) to use rather than new ones: the
    arrays a cluster's replicas share (SimResult.owner; shared_fields makes them).
    """
    n = len(wl)
    admit, first, finish, reason = shared if shared is not None else ([-1] * n, [-1] * n, [-1] * n, [""] * n)
    tokens_code, decodes_code = step_count_codes(inner)
    return SimResult(
        label=label,
        workload=wl.name,
        config=dict(config),
        arrival=wl.arrivals,
        prompt_len=wl.prompt_lens,
        target=target,
        max_new=max_new,
        admit_step=admit,
        first_step=first,
        finish_step=finish,
        finish_reason=reason,
        rejected=[],
        kv_total=0 if inner is None else _stats(inner).kv_total,
        lora=wl.loras,
        lora_load_s=[0.0] * n if wl.loras is not None else None,
        tenant=None if wl.tenants is None else tuple(t or DEFAULT_TENANT for t in wl.tenants),
        step_tokens=array(tokens_code),
        step_decodes=array(decodes_code),
    )


def shared_fields(n: int, steps: int = 0) -> tuple[Any, Any, Any, list[str]]:
    """(admit_step, first_step, finish_step, finish_reason) for `n` requests, none started, as one
    group's replicas share them: the step numbers as array('i') (C ints, 4 bytes each; array('q'), 8
    bytes, when `steps`, the most steps they will number, reaches 2**31), the reasons a list (of
    shared strings). A replica numbers its own steps: one past 2**31 - 1 raises OverflowError when
    written, never wraps."""
    code = "i" if steps < 2**31 else "q"
    none = array(code, [-1]) * n
    return none, array(code, none), array(code, none), [""] * n


def run_group(
    reps: list[Replica], router: Router | None, workload: Workload, max_new: list[int], too_long: dict[int, str],
    closed_loop: ClosedLoop | None,
) -> tuple[Arrivals, Entry, float]:
    """Run the event loop over one group of replicas behind `router` (None: the single replica),
    each request entering as request_maker builds it; return (the arrivals, the entry (routes,
    refusals, imbalance ratios), the loop's wall time, s). Closed-loop load, when given, sends the
    next request as one finishes or is refused.

    Raises:
        SimulationError, ClusterError: as EventLoop.run and route_to.
    """
    if isinstance(workload, SessionWorkload):
        if closed_loop is not None:
            raise ValueError("sessions send each turn after the last one's answer: closed-loop load "
                             f"(concurrency {closed_loop.concurrency}) does not apply to them")
        return run_sessions(reps, router, workload, max_new, too_long)
    arrivals = Arrivals(workload, closed_loop)
    entry = Entry(reps, router, request_maker(workload, max_new, reps[0].inner, arrivals.times), too_long,
                  arrivals, track_imbalance=router is not None)
    closed = closed_loop is not None
    loop = EventLoop(reps, arrivals, entry, arrivals.on_finish if closed else None,
                     PassGate(arrivals.ended if closed else None))
    loop.arrivals_at_step_ends = router is None
    t0 = time.perf_counter()
    loop.run()
    return arrivals, entry, time.perf_counter() - t0


def request_maker(
    wl: Workload, max_new: list[int], inner: object, times: Sequence[float]
) -> Callable[[int], Request]:
    """make(rid) -> the Request a scheduler like `inner` sees for request rid: its prompt, max_new
    and arrival (times[rid], s), and its prompt's block hashes when `inner` caches prefixes and the
    workload has prefix ids, and its LoRA adapter when the workload names them (then a request's block
    hashes carry its adapter, so that only requests on the same adapter, or the base model, share KV)."""
    st = _stats(inner)
    caching = st.enable_prefix_caching and wl.prefix_ids is not None
    hashes, bs, plens, tenants = wl.block_hashes, st.block_size or 1, wl.prompt_lens, wl.tenants
    loras = wl.loras
    if loras is not None:
        def with_lora(i: int) -> Request:
            a = loras[i]
            h: tuple[Hashable, ...] | None = hashes(i, bs) if caching else None
            if h is not None and a is not None:
                # KV computed under an adapter is that adapter's: its blocks hash apart, as in vLLM.
                h = tuple((a, x) for x in h)
            return Request(i, plens[i], max_new[i], 0, times[i], h, lora=a,
                           tenant=tenants[i] if tenants is not None else None)

        return with_lora

    def make(i: int) -> Request:
        return Request(i, plens[i], max_new[i], 0, times[i], hashes(i, bs) if caching else None,
                       tenant=tenants[i] if tenants is not None else None)

    return make


def simulate(
    workload: Workload,
    scheduler: ReplicaConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    max_tokens: int | None = None,
    check: bool = False,
    label: str | None = None,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
    closed_loop: ClosedLoop | None = None,
    records: bool = True,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> SimResult:
    """Replay `workload` through a fresh scheduler, pricing steps with `cost_model`.

    Args:
        workload: the requests (arrival s, prompt and output lengths in tokens).
        scheduler: a ReplicaConfig, or a zero-argument factory returning any object with the
            add()/schedule()/complete() interface and last_finished, kv_free, num_waiting,
            has_unfinished(). (Picklable when it is a ReplicaConfig, for worker processes.)
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
            workload's arrival times are then ignored (stallfree.sim.run.load). The result's arrival
            holds the times the requests were sent, and its config concurrency and think_time_s.
        records: False keeps no per-step or per-request records: the summary's figures are built as
            the run goes (the result's `tally`, stallfree.sim.run.tally; percentiles within its ALPHA),
            in memory that grows with the requests in flight; open-loop replays of plain workloads only
            (no closed loop, sessions, LoRA adapters or tenants).
        slo_ttft, slo_tpot: with records=False, the objectives (s; None: none) goodput is counted
            against as requests finish (summarize_result must be given the same).

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
    inner = make_scheduler(scheduler)
    sched = wrap_checker(inner) if check else inner
    max_new, too_long, target, config, label = plan_run(
        workload, scheduler, cost_model, max_tokens, max_model_len, cut_output_to_fit, label, closed_loop
    )
    res = new_result(label or type(inner).__name__, workload, config, target, max_new, inner)
    tally = None if records else no_records_tally(workload, closed_loop, slo_ttft, slo_tpot)
    reps = [Replica(0, sched, inner, res, cost_model, async_of(scheduler), tally)]
    arrivals, entry, res.wall_s = run_group(reps, None, workload, max_new, too_long, closed_loop)
    reps[0].finish_tally()
    res.tally = tally
    _close_run(res, entry, tuple(arrivals.times) if closed_loop is not None else None, reps[0], workload, check)
    if isinstance(arrivals, SessionArrivals) and isinstance(entry, SessionEntry):
        close_sessions(res, workload, arrivals, entry)  # type: ignore[arg-type]
    return res


def _close_run(res: SimResult, entry: Entry, sent: tuple[float, ...] | None, rep: Replica, workload: Workload,
               check: bool) -> None:
    """After simulate's loop: the requests refused for the context length join the rejected (rid
    order), the times requests were sent (closed loop: `sent`, s) replace the arrivals, the
    scheduler's counters are copied, then the end-of-run checks (verify_tokens)."""
    for rid, why in entry.refused:
        res.rejected.append((rid, why))
        res.rejected_kind[rid] = CONTEXT_LENGTH
    res.rejected.sort()  # rid order: the order requests arrive in
    if sent is not None:
        res.arrival = sent
    _scheduler_figures(res, rep.inner, workload)
    if check:
        # End-of-run invariants: every request finished and all KV returned.
        rep.sched.check_final()  # type: ignore[attr-defined]
    if res.tally is None:  # a run without records checked each request's tokens as it finished
        verify_tokens(res)


def no_records_tally(workload: Workload, closed_loop: ClosedLoop | None, slo_ttft: float | None,
                     slo_tpot: float | None) -> RunTally:
    """The tally of a run that keeps no records (simulate(records=False)), after checking that the run is
    one such a run models.

    Raises:
        ValueError: a closed loop, a session workload, LoRA adapters or tenants (their figures read
            per-request records).
    """
    why = ("closed-loop load" if closed_loop is not None else
           "sessions" if isinstance(workload, SessionWorkload) else
           "LoRA adapters" if workload.loras is not None else
           "tenants" if workload.tenants is not None else None)
    if why is not None:
        raise ValueError(f"records=False: a run without records does not build the figures of {why} "
                         f"({workload.name}): keep the records")
    return RunTally(slo_ttft, slo_tpot)


def _scheduler_figures(res: SimResult, inner: SchedulerLike, workload: Workload) -> None:
    """Copy the scheduler's own counters into `res`: preemptions, recomputed tokens and, with prefix
    caching on, the hit rates (all admissions and first admissions), evictions and the trace's bound."""
    st = inner.stats()
    res.num_preemptions = st.num_preemptions
    res.num_recomputed_tokens = st.num_recomputed_tokens
    if not st.enable_prefix_caching:
        return
    queries = st.prefix_cache_queries
    res.prefix_cache_hit_rate = st.prefix_cache_hits / queries if queries else 0.0
    first = st.prefix_cache_first_queries
    res.prefix_cache_hit_rate_first_admission = st.prefix_cache_first_hits / first if first else 0.0
    res.prefix_cache_evictions = st.num_evictions
    res.prefix_cache_hit_rate_bound = workload.prefix_hit_bound(st.block_size or DEFAULT_BLOCK_SIZE)
    res.kv_tier = tier_figures(inner, st)


def tier_figures(inner: object, st: Any) -> dict[str, Any] | None:
    """A CPU KV tier's figures (None without one): its size (cpu_blocks, cpu_kv_tokens), hit rates per
    tier over all admissions and over first admissions (fractions of the tokens looked up: gpu + cpu
    = the scheduler's prefix cache hit rate), and block copies (kv_loads, kv_offloads) and CPU blocks
    dropped (cpu_drops, the tier full). `st`: the scheduler's stats()."""
    kv = getattr(inner, "kv_manager", None)
    if not isinstance(kv, TieredKV):
        return None
    tier = kv.tier_stats
    q, fq = st.prefix_cache_queries, st.prefix_cache_first_queries
    return {
        "cpu_blocks": kv.cpu_blocks,
        "cpu_kv_tokens": kv.cpu_blocks * kv.block_size,
        "hit_rate_gpu": tier.gpu_hits / q if q else 0.0,
        "hit_rate_cpu": tier.cpu_hits / q if q else 0.0,
        "first_admission_hit_rate_gpu": tier.first_gpu_hits / fq if fq else 0.0,
        "first_admission_hit_rate_cpu": tier.first_cpu_hits / fq if fq else 0.0,
        "kv_loads": kv.tier.num_loads,
        "kv_offloads": kv.tier.num_stores,
        "cpu_drops": kv.tier.num_drops,
    }


def context_overflows(
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


def plan_run(
    workload: Workload,
    scheduler: ReplicaConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    max_tokens: int | None,
    max_model_len: int | None,
    cut_output_to_fit: bool,
    label: str | None,
    closed_loop: ClosedLoop | None = None,
) -> tuple[list[int], dict[int, str], list[int], dict[str, Any], str | None]:
    """What a run decides before its loop, shared by simulate() and the cluster's simulate_cluster():
    (max_new per request, requests refused for the context length (rid -> reason), tokens each will
    emit, the result's config record, the label).

    Raises:
        ValueError: max_model_len not an integer >= 1.
    """
    n = len(workload)
    outs = workload.output_lens
    # C arrays: C ints (4 bytes a request) unless a length of 2**31 or more needs 8-byte ones; a list takes
    # 8 plus, for values read from a workload's arrays, an int object of 28 each.
    largest = max_tokens if max_tokens is not None else max(outs, default=0)
    code = "q" if largest >= 2**31 else "i"
    max_new = array(code, outs) if max_tokens is None else array(code, (max_tokens,)) * n
    too_long = context_overflows(workload, max_new, max_model_len, cut_output_to_fit)  # type: ignore[arg-type]
    target = array(code, map(min, outs, max_new))
    config: dict[str, Any] = {"cost_model": repr(cost_model), "max_tokens": max_tokens}
    frontend = getattr(cost_model, "frontend_s", 0.0)  # an engine profile's front end (report adds it)
    if frontend:
        config["frontend_s"] = float(frontend)
    if max_model_len is not None:
        config.update(max_model_len=max_model_len, cut_output_to_fit=cut_output_to_fit)
    if closed_loop is not None:
        config.update(concurrency=closed_loop.concurrency, think_time_s=closed_loop.think_time)
    if isinstance(scheduler, ReplicaConfig):
        config.update(
            batching=scheduler.batching,
            token_budget=scheduler.token_budget,
            max_seqs=scheduler.max_seqs,
            kv_tokens=scheduler.kv_tokens,
            kv=scheduler.scheduler.kv_policy,
        )
        if scheduler.scheduler.cpu_blocks:
            config["cpu_kv_tokens"] = scheduler.scheduler.cpu_blocks * (scheduler.scheduler.block_size or 1)
        if scheduler.async_scheduling:
            config["async_scheduling"] = True
        label = label or scheduler.label
    return max_new, too_long, target, config, label  # type: ignore[return-value]


#: Requests in the burst saturated_throughput times.
SATURATION_SAMPLE = 5000
#: The most steps saturated_throughput's cycled burst (a workload of fewer than SATURATION_SAMPLE requests) is
#: estimated to take (burst_steps_per_request): about 4 s of simulation at the ~7.5 us a step takes. Past
#: it the burst is cut to fewer copies of the workload, never below the workload's own requests.
SATURATION_STEPS = 500_000
#: Runs of consecutive requests that make up the burst of a workload of more than SATURATION_SAMPLE
#: requests (saturation_sample): 10 of 500.
SATURATION_WINDOWS = 10


def saturation_sample(n_requests: int, sample: int = SATURATION_SAMPLE, windows: int = SATURATION_WINDOWS) -> list[int]:
    """The positions, in a workload of `n_requests` requests, of the `sample` requests that
    saturated_throughput releases at once, in the burst's order: rid i of the burst is request
    result[i].

    Up to `sample` requests: all of them, cycled up to `sample` (0, 1, ..., n - 1, 0, 1, ...): a few
    requests never fill a replica, and the time to finish them is their longest one's, not a rate.

    More: `windows` runs of consecutive requests (sample // windows each, the remainder one apiece to
    the first runs), evenly spaced from the first request to the last. Not the first `sample`: a
    trace's mix drifts over its span (the bundled Azure conversation trace's first 5,000 requests
    average 257.5 output tokens against 211.1 over all 19,366, and read the default replica's capacity
    8% low). Runs rather than single requests, so that the prefixes that neighbouring requests share
    (and a session's turns) stay together.

    Args:
        n_requests: requests in the workload, >= 1.
        sample: requests in the burst, >= 1.
        windows: runs of a workload of more than `sample` requests, >= 1 (at most `sample` are used).

    Raises:
        ValueError: an argument < 1.
    """
    if n_requests < 1 or sample < 1 or windows < 1:
        raise ValueError(f"saturation_sample needs n_requests, sample and windows >= 1, got "
                         f"{n_requests}, {sample}, {windows}")
    if n_requests <= sample:
        return [i % n_requests for i in range(sample)]
    w = min(windows, sample)
    gap = n_requests - sample  # requests left out, spread evenly between the runs
    out: list[int] = []
    for k in range(w):
        before = k * sample // w  # requests in the runs before run k
        first = before + (k * gap // (w - 1) if w > 1 else 0)
        out.extend(range(first, first + (k + 1) * sample // w - before))
    return out


def saturated_throughput(
    workload: Workload,
    scheduler: ReplicaConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    max_tokens: int | None = None,
    sample: int = SATURATION_SAMPLE,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
) -> float:
    """Estimate a replica's capacity, requests/s: `sample` requests of the workload all arriving at
    0 s, completed requests over the time to finish them all. The requests are saturation_sample's:
    runs of consecutive requests spread over the whole workload, or a workload of up to `sample`
    requests cycled up to `sample` (its mix of lengths, repeated: 6 requests alone gave 2.0 req/s
    where the same mix sustains 26).

    Each request keeps its prompt and output lengths, LoRA adapter, tenant and, when the workload has
    more than `sample` requests, its prefix ids (a cycled workload's copies would hit their own
    earlier copies' prefixes, so a cycled burst has none). A SessionWorkload's turns are replayed as
    single requests with their whole prompts (Workload.take). Hits between runs are lost, so with a
    cache that holds much of the workload this reads low (the bundled Mooncake trace with 200M tokens of
    KV: 1.27 requests/s, where the whole trace released at once completes 1.48).

    A cycled burst is cut so that its steps, as burst_steps_per_request estimates them, stay within
    SATURATION_STEPS (500,000), never below the workload's own requests: the copies of a few long prompts
    at a small token budget (5 prompts of 20,000 tokens at 1 token a step, cycled to 5,000: 100 M steps)
    or under a step time target whose steps hold a few tokens would otherwise run for minutes where the
    replay takes a second. The default budget of 2,048 tokens and 256 sequences stays within it unless
    the requests average more than about 100 steps each (e.g. outputs of 25,000 tokens).

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
    n = len(workload)
    size = sample
    if n < sample:
        per = burst_steps_per_request(workload, scheduler, max_tokens)
        if per is not None and per * sample > SATURATION_STEPS:
            size = max(n, int(SATURATION_STEPS / per))
    burst = workload.take(saturation_sample(n, size))
    burst = replace(burst, arrivals=(0.0,) * size,
                    prefix_ids=burst.prefix_ids if n > sample else None)
    res = simulate(
        burst, scheduler, cost_model, max_tokens, max_model_len=max_model_len, cut_output_to_fit=cut_output_to_fit
    )
    done = sum(1 for f in res.finish_step if f >= 0)
    return done / res.step_end[-1] if res.num_steps and res.step_end[-1] > 0 else float("inf")


def burst_steps_per_request(
    workload: Workload, scheduler: ReplicaConfig | Callable[[], SchedulerLike], max_tokens: int | None = None
) -> float | None:
    """An estimate of the steps a burst of `workload`'s requests takes, per request: their prompt tokens
    over the tokens a step prefills, plus their output tokens over the decodes a step holds. A step
    prefills the token budget's tokens and decodes min(max_seqs, token budget) requests; under a step
    time target (a TimeBudgetConfig) the tokens of a lone chunk, and the decodes at the requests' mean
    context, whose step fits the target (at least 1 of each). None for a scheduler factory of another
    kind (nothing to read the budget from).
    """
    config = getattr(scheduler, "scheduler", None)
    budget, seqs = getattr(config, "token_budget", None), getattr(config, "max_seqs", None)
    if not isinstance(budget, int) or not isinstance(seqs, int) or len(workload) == 0:
        return None
    outputs = [min(o, max_tokens) if max_tokens else o for o in workload.output_lens]
    prompt, output = sum(workload.prompt_lens), sum(outputs)
    prefill, decodes = budget, min(seqs, budget)
    target = getattr(scheduler, "target_s", None)
    if target is not None:
        from stallfree.sim.run.time_budget import time_model

        model = time_model(scheduler.cost_model)  # type: ignore[union-attr]  # a TimeBudgetConfig's
        prefill = min(max(model.max_tokens_within(target, 0, 0, 0), 1), budget)
        context = (prompt + output // 2) // len(workload) + 1
        lo, hi = 1, decodes  # the most decodes whose step fits the target, at least 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if model.decode_step_time(mid, context) <= target else (lo, mid - 1)
        decodes = lo
    return (prompt / prefill + output / decodes) / len(workload)
