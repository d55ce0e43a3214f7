"""Many replicas behind a router, in one event loop with one simulated clock.

Imports allowed: the standard library, stallfree.core and stallfree.sim (its stdlib modules only).

Each replica is a stallfree.sim.run.replica.Replica in the one event loop (stallfree.sim.run.loop), as in
`simulate`, so a replica behaves exactly as `simulate` would with the requests routed to it.
Replicas interact only through the router (stallfree.sim.run.routers), at arrival time.

Time model (the loop's). At each instant t, in this order: every step ending at t completes; every
request arriving by t is routed, in workload order, seeing each replica as of its last completed
step (plus the requests already routed to it); then every idle replica with work starts a step at
t, in index order. A request routed to a busy replica waits until that replica's step ends, which
is when the single-replica simulator would have added it too. With one replica the cluster
reproduces `simulate` step for step (tested). Since replicas meet only at arrivals, the loop runs each
on its own between two arrivals (EventLoop._run_apart): the same steps, in the same order per replica.

Results. `simulate_cluster` returns a ClusterResult: one SimResult per replica (indexed by the
global rid, rows only for the requests routed to it) and `merged`, a SimResult of the whole
cluster whose step arrays are the replicas' laid end to end, so every single-run report
(summaries, records, latency arrays) reads it unchanged.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig, async_of, make_scheduler, wrap_checker
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.loop import Router
from stallfree.sim.run.memory import give_back, map_large_blocks
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import (
    CONTEXT_LENGTH,
    ClusterError,
    DecodeTicks,
    SchedulerLike,
    SimResult,
    StepStarts,
    verify_cluster_tokens,
)
from stallfree.sim.run.routers import (
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_AFFINITY_LOAD_MARGIN,
    DEFAULT_PREFIX_THRESHOLD,
    DEFAULT_ROUTER_SEED,
    ROUTERS,
    LeastKVRouter,
    LeastOutstandingRouter,
    PrefixAffinityRouter,
    RandomRouter,
    RoundRobinRouter,
    make_router,
)
from stallfree.sim.run.session_run import SessionArrivals, SessionEntry, close_sessions
from stallfree.sim.run.simulator import new_result, no_records_tally, plan_run, run_group, shared_fields
from stallfree.sim.run.tally import RunTally

__all__ = [
    "ClusterError",
    "ClusterResult",
    "DEFAULT_AFFINITY_LOAD_FACTOR",
    "DEFAULT_AFFINITY_LOAD_MARGIN",
    "DEFAULT_PREFIX_THRESHOLD",
    "DEFAULT_ROUTER_SEED",
    "LeastKVRouter",
    "LeastOutstandingRouter",
    "PrefixAffinityRouter",
    "ROUTERS",
    "RandomRouter",
    "Replica",
    "RoundRobinRouter",
    "Router",
    "make_router",
    "simulate_cluster",
]

@dataclass(slots=True)
class ClusterResult:
    """One cluster simulation.

    Attributes:
        merged: the whole cluster as one SimResult (rids are workload positions; steps of replica
            k occupy rows [step_base[k], step_base[k + 1])).
        replicas: one SimResult per replica, same rid indexing; a replica's rows are its own steps.
        routed: per request, the replica it was routed to (-1: refused at arrival for its length).
        step_base: per replica, its first row in merged's step arrays; length N + 1.
        imbalance_mean: mean over arrivals of max / mean outstanding requests per replica (1.0 is
            perfect balance; arrivals that find fewer requests in the cluster than replicas are left
            out, since then some replica must be empty); None when there were none.
        imbalance_max: the largest of those ratios, or None.
        wall_s: wall time of the loop, s.
    """

    merged: SimResult
    replicas: list[SimResult]
    routed: list[int]
    step_base: list[int]
    imbalance_mean: float | None
    imbalance_max: float | None
    wall_s: float


def simulate_cluster(
    workload: Workload,
    scheduler: ReplicaConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    num_replicas: int,
    router: Router | None = None,
    max_tokens: int | None = None,
    check: bool = False,
    label: str | None = None,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
    closed_loop: ClosedLoop | None = None,
    group: Callable[..., Any] | None = None,
    records: bool = True,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> ClusterResult:
    """Replay `workload` onto `num_replicas` identical replicas behind `router`.

    Args:
        workload: the requests (arrival s, prompt and output lengths, tokens).
        scheduler: each replica's scheduler: a ReplicaConfig or a zero-argument factory (called
            once per replica), as for stallfree.sim.run.simulator.simulate.
        cost_model: prices each replica's steps, s.
        num_replicas: N >= 1.
        router: a Router (default LeastOutstandingRouter()).
        max_tokens, check, max_model_len, cut_output_to_fit, closed_loop: as simulate (closed-loop
            load: `concurrency` requests in flight across the whole cluster).
        label: a name for reports (default: the config's label, then "xN <router>").
        group: runs the event loop over the replicas, with run_group's arguments and result (default
            run_group; stallfree.sim.run.autoscale.runner puts an autoscaler between arrivals and router).
        records, slo_ttft, slo_tpot: as simulate: with records=False each replica builds its figures as it
            runs (its result's tally) and the merged result's tally is theirs added up; no step rows are
            kept or merged.

    Returns:
        A ClusterResult; every request not rejected finished exactly once on exactly one replica.

    Raises:
        ClusterError: num_replicas < 1, or the router returned an index out of range.
        ValueError, SimulationError, InvariantViolation: as simulate.
    """
    _check_replicas(num_replicas)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    router = router if router is not None else LeastOutstandingRouter()
    map_large_blocks()  # the replicas' growing step arrays leave no holes in the C heap
    max_new, too_long, target, config, label = plan_run(
        workload, scheduler, cost_model, max_tokens, max_model_len, cut_output_to_fit, label, closed_loop
    )
    config.update(replicas=num_replicas, router=type(router).__name__)
    # One set of per-request arrays (and one state byte per request) for every replica: each request
    # is written by its own replica alone (SimResult.owner).
    shared = shared_fields(len(workload))
    state = bytearray(len(workload))  # one, not one per replica (the peak of a run of millions of requests)
    reps = [_replica(k, scheduler, cost_model, check, workload, config, target, max_new, label, shared,
                     None if records else no_records_tally(workload, closed_loop, slo_ttft, slo_tpot), state)
            for k in range(num_replicas)]
    results = [rep.res for rep in reps]
    cluster_label = f"{label or type(reps[0].inner).__name__} x{num_replicas}"
    arrivals, entry, wall = (group or run_group)(reps, router, workload, max_new, too_long, closed_loop)
    closed = closed_loop is not None
    routed, ratios = entry.routed, entry.ratios
    owner = array("i", routed)
    for k, res in enumerate(results):
        res.owner, res.replica = owner, k
    sessions = isinstance(arrivals, SessionArrivals) and isinstance(entry, SessionEntry)
    sent = tuple(arrivals.sent_at) if isinstance(arrivals, SessionArrivals) else None
    for rep in reps:
        _close_replica(rep, wall, tuple(arrivals.times) if closed else sent, check)
    # A session's turn is refused for its length only if it was sent (an earlier refusal ends the session).
    refused = dict(entry.refused) if sessions else too_long
    if records:
        verify_cluster_tokens(results, owner)
        merged, base = _merge(cluster_label, workload, config, target, max_new, results, routed, refused)
    else:  # each request's tokens were checked as it finished
        merged, base = _merge_tallies(cluster_label, workload, config, target, max_new, results, refused, shared)
    merged.wall_s = wall
    if closed:
        merged.arrival = tuple(arrivals.times)
    if isinstance(arrivals, SessionArrivals) and isinstance(entry, SessionEntry):
        close_sessions(merged, workload, arrivals, entry)  # type: ignore[arg-type]
    _prefix_cache_figures(workload, reps, results, merged, routed)
    imb_mean = sum(ratios) / len(ratios) if ratios else None
    return ClusterResult(merged, results, routed, base, imb_mean, max(ratios) if ratios else None, wall)


def _check_replicas(replicas: int) -> None:
    """Raise ClusterError unless `replicas` is an integer >= 1."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ClusterError(f"replicas must be an integer >= 1, got {replicas!r}")


def _replica(
    k: int, scheduler: ReplicaConfig | Callable[[], SchedulerLike], cost_model: StepCostModel, check: bool,
    workload: Workload, config: dict[str, Any], target: list[int], max_new: list[int], label: str | None,
    shared: tuple[Any, Any, Any, list[str]] | None = None, tally: RunTally | None = None,
    state: bytearray | None = None,
) -> Replica:
    """Replica k of a cluster: a fresh scheduler (in the checker with `check`) and an empty result
    labelled "<label>#k" (its per-request arrays `shared`, if given: simulator.shared_fields); with a
    `tally`, one that keeps no records."""
    inner = make_scheduler(scheduler)
    sched = wrap_checker(inner) if check else inner
    res = new_result(f"{label or type(inner).__name__}#{k}", workload, config, target, max_new, inner, shared)
    # Keeping every row, the starts are held as their exceptions as the run goes (what the merge makes them).
    return Replica(k, sched, inner, res, cost_model, async_of(scheduler), tally, state, compact_starts=tally is None)


def _close_replica(rep: Replica, wall: float, sent: tuple[float, ...] | None, check: bool) -> None:
    """After the loop: a replica's result gets the wall time, s, its scheduler's preemption counts and,
    under closed-loop load, the times requests were sent (`sent`, s); then the checker's end-of-run check
    (each request's tokens are checked once for the whole cluster: verify_cluster_tokens)."""
    res = rep.res
    res.wall_s = wall
    rep.finish_tally()
    res.tally = rep.tally
    st = rep.inner.stats()
    res.num_preemptions, res.num_recomputed_tokens = st.num_preemptions, st.num_recomputed_tokens
    if sent is not None:
        res.arrival = sent
    if check:
        rep.sched.check_final()  # type: ignore[attr-defined]


def _prefix_cache_figures(
    wl: Workload, reps: list[Replica], results: list[SimResult], merged: SimResult, routed: list[int]
) -> None:
    """With prefix caching on: each replica's hit rate, evictions and bound (as simulate reports
    them, the bound over the requests routed to it), and the cluster's: hits / queries summed over
    the replicas, evictions summed, and the bound of the whole workload (one infinite cache seeing
    every request), which routing can only lose from."""
    st0 = reps[0].inner.stats()
    if not st0.enable_prefix_caching:
        return
    bs = st0.block_size or DEFAULT_BLOCK_SIZE
    hits = queries = evictions = 0
    routed_to: dict[int, list[int]] = {rep.index: [] for rep in reps}  # one pass, not one per replica
    for i, k in enumerate(routed):
        if k >= 0:  # -1: refused at arrival for its length
            routed_to[k].append(i)
    for rep, res in zip(reps, results, strict=True):
        st = rep.inner.stats()
        q, h, e = st.prefix_cache_queries, st.prefix_cache_hits, st.num_evictions
        hits, queries, evictions = hits + h, queries + q, evictions + e
        res.prefix_cache_hit_rate = h / q if q else 0.0
        res.prefix_cache_evictions = e
        mine = routed_to[rep.index]
        if isinstance(wl, SessionWorkload):
            res.prefix_cache_hit_rate_bound = wl.subset_bound(mine, bs)
            continue
        ids = wl.prefix_ids
        sub = Workload(
            tuple(wl.arrivals[i] for i in mine), tuple(wl.prompt_lens[i] for i in mine),
            tuple(wl.output_lens[i] for i in mine), wl.name,
            prefix_ids=tuple(ids[i] for i in mine) if ids is not None else None, prefix_block=wl.prefix_block,
            tenants=tuple(wl.tenants[i] for i in mine) if wl.tenants is not None else None,
        )
        res.prefix_cache_hit_rate_bound = sub.prefix_hit_bound(bs)
    merged.prefix_cache_hit_rate = hits / queries if queries else 0.0
    merged.prefix_cache_evictions = evictions
    merged.prefix_cache_hit_rate_bound = wl.prefix_hit_bound(bs)


def _merge_tallies(
    label: str, wl: Workload, config: dict[str, Any], target: list[int], max_new: list[int],
    results: list[SimResult], too_long: dict[int, str], shared: tuple[Any, Any, Any, list[str]],
) -> tuple[SimResult, list[int]]:
    """The merged result of replicas that kept no records: no step rows, the replicas' per-request arrays
    (shared), their rejections and counters, and their tallies added up (RunTally.merge); with the step
    bases _merge would give (each replica's steps counted)."""
    m = new_result(label, wl, config, target, max_new, None, shared)
    m.kv_total = sum(r.kv_total for r in results)
    m.tally = RunTally(results[0].tally.slo_ttft, results[0].tally.slo_tpot)
    base = [0]
    for r in results:
        m.tally.merge(r.tally)
        base.append(base[-1] + r.tally.num_steps)
        m.rejected.extend(r.rejected)
        m.rejected_kind.update(r.rejected_kind)
        m.num_preemptions += r.num_preemptions
        m.num_recomputed_tokens += r.num_recomputed_tokens
    _refused_for_length(m, too_long)
    return m, base


def _refused_for_length(m: SimResult, too_long: dict[int, str]) -> None:
    """The requests refused at arrival for the context length join the merged result's rejected (rid order)."""
    for rid, why in too_long.items():
        m.rejected.append((rid, why))
        m.rejected_kind[rid] = CONTEXT_LENGTH
    m.rejected.sort()


#: The step arrays of a SimResult.
#: The stored step arrays of a SimResult (step_ticks is derived from step_decodes: DecodeTicks), the starts
#: first (merged as their exceptions: StepStarts).
_STEP_FIELDS = ("step_start", "step_end", "step_tokens", "step_decodes", "step_kv_used", "step_waiting")


def _merge(
    label: str,
    wl: Workload,
    config: dict[str, Any],
    target: list[int],
    max_new: list[int],
    results: list[SimResult],
    routed: list[int],
    too_long: dict[int, str],
) -> tuple[SimResult, list[int]]:
    """Lay the replicas' step arrays end to end; shift each request's step numbers by its replica's base.

    The step arrays are held once: the first replica's array of each field grows into the merged one
    (the others' rows appended, each emptied as it is copied, so that the peak is the rows plus one
    replica's), and each replica's become read-only views (memoryview) of its rows of the merged ones (a
    run's step rows outweigh its per-request fields several times). The starts are held as their exceptions
    (StepStarts, over the merged step_end and each replica's view of it). The merged per-request step numbers
    are arrays as the replicas' (simulator.shared_fields: C ints, 8-byte ones from 2**31 steps on).
    """
    n = len(wl)
    base = [0]
    for r in results:
        base.append(base[-1] + r.num_steps)
    m = new_result(label, wl, config, target, max_new, None, shared_fields(n, base[-1]))
    m.kv_total = sum(r.kv_total for r in results)
    # The starts first, as their exceptions (StepStarts: a step that starts when the one before it on its
    # replica ended keeps no start of its own), each replica's array emptied once read.
    at, value = array("q"), array("d")
    spans = [0]
    for k, r in enumerate(results):
        starts = r.step_start
        if isinstance(starts, StepStarts):  # made as the run went (Replica's compact_starts)
            at.extend([a + base[k] for a in starts.at])
            value.extend(starts.value)
        else:
            StepStarts.of(starts, r.step_end, base[k], at, value)
            del starts[:]  # frees it now (the replica's loop still holds the array object)
        spans.append(len(at))
    for name in _STEP_FIELDS[1:]:
        # The first replica's array grows into the merged one (its rows are already in place), each other
        # replica's rows appended and its array emptied at once: the peak is the rows plus one replica's.
        whole = getattr(results[0], name)
        for r in results[1:]:
            mine = getattr(r, name)
            whole.extend(mine)
            del mine[:]  # frees it now (the replica's loop still holds the array object)
        setattr(m, name, whole)
        view = memoryview(whole)
        for k, r in enumerate(results):
            setattr(r, name, view[base[k]:base[k + 1]])
        give_back()  # the replicas' arrays, freed in the middle of the heap
    # Each result's decode ticks count its own step_decodes (a replica's from its first row, as it recorded them).
    for r in (m, *results):
        r.step_ticks = DecodeTicks(r.step_decodes)
    m.step_start = StepStarts(m.step_end, at, value)  # type: ignore[assignment]
    for k, r in enumerate(results):
        mine = array("q", (a - base[k] for a in at[spans[k]:spans[k + 1]]))
        r.step_start = StepStarts(r.step_end, mine, value[spans[k]:spans[k + 1]])  # type: ignore[assignment]
    # Per request, its replica's columns (read once per replica, not by name per request: O(requests)).
    m_admit, m_first, m_finish, m_reason, m_lora = m.admit_step, m.first_step, m.finish_step, m.finish_reason, \
        m.lora_load_s
    columns = [(r.admit_step, r.first_step, r.finish_step, r.finish_reason,
                r.lora_load_s if m_lora is not None else None, base[k]) for k, r in enumerate(results)]
    for rid in range(n):
        k = routed[rid]
        if k < 0:
            continue
        admit, first, finish, reason, lora, b = columns[k]
        v = admit[rid]
        m_admit[rid] = v + b if v >= 0 else -1
        v = first[rid]
        m_first[rid] = v + b if v >= 0 else -1
        v = finish[rid]
        m_finish[rid] = v + b if v >= 0 else -1
        m_reason[rid] = reason[rid]
        if lora is not None:
            m_lora[rid] = lora[rid]  # type: ignore[index]
    for k, r in enumerate(results):
        b = base[k]
        m.rejected.extend(r.rejected)
        m.rejected_kind.update(r.rejected_kind)
        for rid, steps in r.skips.items():
            m.skips[rid] = [s + b for s in steps]
        for rid, segs in r.segments.items():
            m.segments[rid] = [(a + b, c + b) for a, c in segs]
        m.num_preemptions += r.num_preemptions
        m.num_recomputed_tokens += r.num_recomputed_tokens
        m.lora_loads += r.lora_loads
        m.lora_storage_loads += r.lora_storage_loads
    _refused_for_length(m, too_long)
    return m, base


