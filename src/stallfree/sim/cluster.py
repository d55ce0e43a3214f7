"""Many replicas behind a router, in one event loop with one simulated clock.

Imports allowed: the standard library, stallfree.core and stallfree.sim (its stdlib modules only).

Each replica is a scheduler driven by the single-replica simulator's per-request bookkeeping
(stallfree.sim.simulator's loop state), so a replica behaves exactly as `simulate` would with
the requests routed to it. Replicas interact only through the router, at arrival time.

Time model. Events are step ends and arrivals. At each instant t, in this order: every step
ending at t completes (replicas in index order); every request arriving by t is routed, in
workload order, seeing each replica as of its last completed step (plus the requests already
routed to it); then every idle replica with work starts a step at t. A request routed to a busy
replica waits until that replica's step ends, which is when the single-replica simulator would
have added it too. With one replica the cluster reproduces `simulate` step for step (tested).

Results. `simulate_cluster` returns a ClusterResult: one SimResult per replica (indexed by the
global rid, rows only for the requests routed to it) and `merged`, a SimResult of the whole
cluster whose step arrays are the replicas' laid end to end, so every single-run report
(summaries, records, latency arrays) reads it unchanged.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stallfree.core.errors import RequestRejected, StallfreeError
from stallfree.core.request import Request
from stallfree.sim.costs import StepCostModel
from stallfree.sim.simulator import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    SchedulerConfig,
    SchedulerLike,
    SimResult,
    SimulationError,
    _Loop,
    _make_scheduler,
    _run_plan,
    _verify_tokens,
    _wrap_checker,
)
from stallfree.sim.workload import Workload

__all__ = [
    "DEFAULT_AFFINITY_LOAD_FACTOR",
    "DEFAULT_AFFINITY_LOAD_MARGIN",
    "DEFAULT_PREFIX_THRESHOLD",
    "DEFAULT_ROUTER_SEED",
    "ROUTERS",
    "ClusterError",
    "ClusterResult",
    "LeastKVRouter",
    "LeastOutstandingRouter",
    "PrefixAffinityRouter",
    "RandomRouter",
    "Replica",
    "RoundRobinRouter",
    "Router",
    "cluster_summary",
    "make_router",
    "run_cluster_experiment",
    "run_cluster_study",
    "simulate_cluster",
]

#: prefix-affinity: tokens of cached prefix a replica must hold to win the request (default 256:
#: sixteen 16-token blocks, so that a shared system prompt counts but a chance one-block match does not).
DEFAULT_PREFIX_THRESHOLD = 256
#: prefix-affinity load cap: a replica may win a request for its cached prefix only while its
#: unfinished requests are at most max(load_factor x the least loaded replica's, that + load_margin).
#: The defaults (1.5 and 4 requests) are this project's choice from the grid measured on the Mooncake
#: trace in docs/cluster.md (the best hit rate there, at least-outstanding's TTFT). The rule has the
#: shape of SGLang's cache-aware router's (cache affinity while loads are within a relative or an
#: absolute margin, else the shortest queue), which compares the most and least loaded workers
#: rather than the candidate and the least loaded.
DEFAULT_AFFINITY_LOAD_FACTOR = 1.5
DEFAULT_AFFINITY_LOAD_MARGIN = 4
#: random router: the default seed.
DEFAULT_ROUTER_SEED = 0


class ClusterError(StallfreeError, ValueError):
    """A cluster option is out of range (the message names the field and the value)."""


class Replica:
    """One replica as a router sees it, and the loop state that drives its scheduler.

    Attributes:
        index: position in the cluster, 0-based.
        num_outstanding: requests routed here and not finished or rejected.
        num_routed: requests routed here.
    """

    def __init__(self, index: int, sched: SchedulerLike, inner: SchedulerLike, loop: _Loop) -> None:
        self.index = index
        self.sched, self.inner, self.loop = sched, inner, loop
        self.num_outstanding = 0
        self.num_routed = 0
        self.pending: list[Request] = []
        self.busy = False
        self.stalled = False
        self.step = 0

    @property
    def kv_free(self) -> int:
        """Free KV as of the last step started, tokens."""
        return int(self.inner.kv_free)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: in the scheduler's queue or routed here since its last step."""
        return int(self.inner.num_waiting) + len(self.pending)

    @property
    def kv_total(self) -> int:
        """KV capacity, tokens (0 when the scheduler does not say)."""
        return int(getattr(self.inner, "kv_total", 0))

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of `request`'s prompt whose KV this replica holds in its prefix cache.

        0 when the scheduler keeps no prefix cache or the request carries no block hashes; a
        scheduler with a `cached_prefix_len(request)` method answers for itself.
        """
        probe = getattr(self.inner, "cached_prefix_len", None)
        if probe is None or getattr(request, "block_hashes", None) is None:
            return 0
        return int(probe(request))


class Router(Protocol):
    """Chooses a replica for each arriving request: one method.

    `route` gets the request and the replicas (a sequence of Replica, index order) and returns an
    index in [0, len(replicas)). It may keep state of its own (a round-robin cursor, a seeded RNG).
    """

    def route(self, request: Request, replicas: Sequence[Replica]) -> int: ...


@dataclass(slots=True)
class RoundRobinRouter:
    """Replicas 0, 1, ..., N-1, 0, ... in arrival order."""

    cursor: int = 0

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the next replica in turn."""
        k = self.cursor % len(replicas)
        self.cursor += 1
        return k


@dataclass(slots=True)
class LeastOutstandingRouter:
    """The replica with the fewest unfinished requests; ties go to the lowest index."""

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the least loaded replica."""
        return min(range(len(replicas)), key=lambda k: (replicas[k].num_outstanding, k))


@dataclass(slots=True)
class LeastKVRouter:
    """The replica with the most free KV (tokens, as of its last step, less what the requests
    already routed to it but not yet admitted will reserve: prompt_len + max_new each); ties go to
    the lowest index."""

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the replica with the most free KV."""

        def free(k: int) -> int:
            r = replicas[k]
            return r.kv_free - sum(p.prompt_len + p.max_new for p in r.pending)

        return min(range(len(replicas)), key=lambda k: (-free(k), k))


@dataclass(slots=True)
class PrefixAffinityRouter:
    """The replica holding the longest cached prefix of the request, among the replicas not too
    loaded, if it holds more than `threshold` tokens of it; otherwise the least loaded
    (LeastOutstandingRouter). Equal prefixes go to the less loaded replica, then the lower index
    (so that replicas holding the same prefix share its requests).

    Load cap: with `low` the fewest unfinished requests on any replica, a replica may win on its
    cache only while its unfinished requests are <= max(load_factor x low, low + load_margin).
    Without it, every request sharing a popular prefix piles onto the one replica that cached it
    first (on the Mooncake trace, 2,986 of 3,000 requests onto one of 4 replicas: docs/cluster.md).
    load_factor = inf (or load_margin large) turns the cap off. Without prefix caching every
    replica holds 0 tokens, so it routes as least-outstanding.

    Args:
        threshold: cached-prefix tokens needed to win, >= 0.
        load_factor: the relative cap, >= 1 (may be math.inf).
        load_margin: the absolute cap, requests, >= 0.

    Raises:
        ClusterError: threshold < 0, load_factor < 1 (or nan), load_margin < 0.
    """

    threshold: int = DEFAULT_PREFIX_THRESHOLD
    load_factor: float = DEFAULT_AFFINITY_LOAD_FACTOR
    load_margin: int = DEFAULT_AFFINITY_LOAD_MARGIN
    fallback: LeastOutstandingRouter = field(default_factory=LeastOutstandingRouter)

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 0:
            raise ClusterError(f"prefix-affinity threshold must be an integer >= 0 tokens, got {self.threshold!r}")
        f = self.load_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1:
            raise ClusterError(f"prefix-affinity load factor must be a number >= 1, got {f!r}")
        m = self.load_margin
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ClusterError(f"prefix-affinity load margin must be an integer >= 0 requests, got {m!r}")

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the replica under the load cap with the longest cached prefix over the threshold,
        else the least loaded."""
        low = min(r.num_outstanding for r in replicas)
        cap = math.inf if self.load_factor == math.inf else max(low * self.load_factor, low + self.load_margin)
        best, best_len = -1, self.threshold
        for k, r in enumerate(replicas):
            if r.num_outstanding > cap:
                continue
            n = r.cached_prefix_len(request)
            if n > best_len or (n == best_len and best >= 0 and r.num_outstanding < replicas[best].num_outstanding):
                best, best_len = k, n
        return best if best >= 0 else self.fallback.route(request, replicas)


@dataclass(slots=True)
class RandomRouter:
    """A replica drawn uniformly with Python's random.Random(seed): the same seed, the same routes."""

    seed: int = DEFAULT_ROUTER_SEED
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return a uniformly drawn replica."""
        return self.rng.randrange(len(replicas))


#: Router names for the command line.
ROUTERS = ("round-robin", "least-outstanding", "least-kv", "prefix-affinity", "random")


def make_router(
    name: str,
    seed: int = DEFAULT_ROUTER_SEED,
    threshold: int = DEFAULT_PREFIX_THRESHOLD,
    load_factor: float = DEFAULT_AFFINITY_LOAD_FACTOR,
    load_margin: int = DEFAULT_AFFINITY_LOAD_MARGIN,
) -> Router:
    """Build a router by name (one of ROUTERS).

    Args:
        name: the router.
        seed: random: the RNG seed.
        threshold: prefix-affinity: tokens of cached prefix needed to win, >= 0.
        load_factor, load_margin: prefix-affinity: its load cap (PrefixAffinityRouter).

    Raises:
        ClusterError: an unknown name, or a prefix-affinity option out of range.
    """
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-outstanding":
        return LeastOutstandingRouter()
    if name == "least-kv":
        return LeastKVRouter()
    if name == "prefix-affinity":
        return PrefixAffinityRouter(threshold, load_factor, load_margin)
    if name == "random":
        return RandomRouter(seed)
    raise ClusterError(f"unknown router {name!r} (choose from {', '.join(ROUTERS)})")


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
    scheduler: SchedulerConfig | Callable[[], SchedulerLike],
    cost_model: StepCostModel,
    num_replicas: int,
    router: Router | None = None,
    max_tokens: int | None = None,
    check: bool = False,
    label: str | None = None,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
) -> ClusterResult:
    """Replay `workload` onto `num_replicas` identical replicas behind `router`.

    Args:
        workload: the requests (arrival s, prompt and output lengths, tokens).
        scheduler: each replica's scheduler: a SchedulerConfig or a zero-argument factory (called
            once per replica), as for stallfree.sim.simulator.simulate.
        cost_model: prices each replica's steps, s.
        num_replicas: N >= 1.
        router: a Router (default LeastOutstandingRouter()).
        max_tokens, check, max_model_len, cut_output_to_fit: as simulate.
        label: a name for reports (default: the config's label, then "xN <router>").

    Returns:
        A ClusterResult; every request not rejected finished exactly once on exactly one replica.

    Raises:
        ClusterError: num_replicas < 1, or the router returned an index out of range.
        ValueError, SimulationError, InvariantViolation: as simulate.
    """
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ClusterError(f"replicas must be an integer >= 1, got {num_replicas!r}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    router = router if router is not None else LeastOutstandingRouter()
    max_new, too_long, target, config, label = _run_plan(
        workload, scheduler, cost_model, max_tokens, max_model_len, cut_output_to_fit, label
    )
    router_name = type(router).__name__
    config.update(replicas=num_replicas, router=router_name)
    reps: list[Replica] = []
    results: list[SimResult] = []
    for k in range(num_replicas):
        inner = _make_scheduler(scheduler)
        sched = _wrap_checker(inner) if check else inner
        res = _empty_result(f"{label or type(inner).__name__}#{k}", workload, config, target, max_new, inner)
        results.append(res)
        reps.append(Replica(k, sched, inner, _Loop(res, sched, inner, workload, cost_model)))
    cluster_label = f"{label or type(reps[0].inner).__name__} x{num_replicas}"
    t0 = time.perf_counter()
    routed, ratios = _run(workload, reps, router, cost_model, too_long)
    wall = time.perf_counter() - t0
    for rep, res in zip(reps, results, strict=True):
        res.wall_s = wall
        res.num_preemptions = int(getattr(rep.inner, "num_preemptions", 0))
        res.num_recomputed_tokens = int(getattr(rep.inner, "num_recomputed_tokens", 0))
        if check:
            rep.sched.check_final()  # type: ignore[attr-defined]
        _verify_tokens(res)
    merged, base = _merge(cluster_label, workload, config, target, max_new, results, routed, too_long)
    merged.wall_s = wall
    _prefix_cache_figures(workload, reps, results, merged, routed)
    imb_mean = sum(ratios) / len(ratios) if ratios else None
    return ClusterResult(merged, results, routed, base, imb_mean, max(ratios) if ratios else None, wall)


def _prefix_cache_figures(
    wl: Workload, reps: list[Replica], results: list[SimResult], merged: SimResult, routed: list[int]
) -> None:
    """With prefix caching on: each replica's hit rate, evictions and bound (as simulate reports
    them, the bound over the requests routed to it), and the cluster's: hits / queries summed over
    the replicas, evictions summed, and the bound of the whole workload (one infinite cache seeing
    every request), which routing can only lose from."""
    inner0 = reps[0].inner
    if not getattr(inner0, "enable_prefix_caching", False):
        return
    bs = int(getattr(inner0, "block_size", 16))
    hits = queries = evictions = 0
    for rep, res in zip(reps, results, strict=True):
        q = int(getattr(rep.inner, "prefix_cache_queries", 0))
        h = int(getattr(rep.inner, "prefix_cache_hits", 0))
        e = int(getattr(rep.inner, "num_evictions", 0))
        hits, queries, evictions = hits + h, queries + q, evictions + e
        res.prefix_cache_hit_rate = h / q if q else 0.0
        res.prefix_cache_evictions = e
        mine = [i for i, k in enumerate(routed) if k == rep.index]
        ids = wl.prefix_ids
        sub = Workload(
            tuple(wl.arrivals[i] for i in mine), tuple(wl.prompt_lens[i] for i in mine),
            tuple(wl.output_lens[i] for i in mine), wl.name,
            prefix_ids=tuple(ids[i] for i in mine) if ids is not None else None, prefix_block=wl.prefix_block,
        )
        res.prefix_cache_hit_rate_bound = sub.prefix_hit_bound(bs)
    merged.prefix_cache_hit_rate = hits / queries if queries else 0.0
    merged.prefix_cache_evictions = evictions
    merged.prefix_cache_hit_rate_bound = wl.prefix_hit_bound(bs)


def _empty_result(
    label: str, wl: Workload, config: dict[str, Any], target: list[int], max_new: list[int], inner: object
) -> SimResult:
    n = len(wl)
    return SimResult(
        label=label,
        workload=wl.name,
        config=dict(config),
        arrival=wl.arrivals,
        prompt_len=wl.prompt_lens,
        target=target,
        max_new=max_new,
        admit_step=[-1] * n,
        first_step=[-1] * n,
        finish_step=[-1] * n,
        finish_reason=[""] * n,
        rejected=[],
        kv_total=int(getattr(inner, "kv_total", 0)),
    )


def _run(
    wl: Workload, reps: list[Replica], router: Router, cost: StepCostModel, too_long: dict[int, str]
) -> tuple[list[int], list[float]]:
    """The event loop; returns (replica of each request, imbalance ratio at each arrival)."""
    arr, plens = wl.arrivals, wl.prompt_lens
    n, nrep = len(arr), len(reps)
    routed = [-1] * n
    ratios: list[float] = []
    ends: list[tuple[float, int, Any]] = []  # (end time, replica, in-flight step)
    i = 0
    now = arr[0] if n else 0.0
    # Prefix caching, as in the single-replica loop: requests carry their prompt's block hashes.
    inner0 = reps[0].inner
    caching = bool(getattr(inner0, "enable_prefix_caching", False)) and wl.prefix_ids is not None
    hashes, bs = wl.block_hashes, int(getattr(inner0, "block_size", 0) or 1)
    while True:
        # 1. Steps ending now complete.
        while ends and ends[0][0] <= now:
            _, k, inflight = heapq.heappop(ends)
            _finish_step(reps[k], inflight, routed)
        # 2. Arrivals by now are routed.
        while i < n and arr[i] <= now:
            if i in too_long:
                i += 1  # refused at arrival, before any router sees it (_merge records it)
                continue
            req = Request(i, plens[i], reps[0].loop.res.max_new[i], 0, arr[i], hashes(i, bs) if caching else None)
            total = sum(r.num_outstanding for r in reps)
            if total >= nrep:
                ratios.append(max(r.num_outstanding for r in reps) * nrep / total)
            k = router.route(req, reps)
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < nrep:
                raise ClusterError(f"router {type(router).__name__} returned replica {k!r}; expected 0..{nrep - 1}")
            rep = reps[k]
            routed[i] = k
            rep.num_routed += 1
            rep.num_outstanding += 1
            rep.pending.append(req)
            rep.stalled = False
            i += 1
        # 3. Idle replicas with work start a step.
        for rep in reps:
            if rep.busy or rep.stalled:
                continue
            if rep.pending:
                _add_pending(rep)
            if not rep.inner.has_unfinished():
                continue
            inflight = _start_step(rep, now, cost)
            if inflight is None:
                rep.stalled = True  # nothing schedulable: wait for a request routed here
                continue
            rep.busy = True
            heapq.heappush(ends, (inflight[0], rep.index, inflight))
        if ends:
            nxt = ends[0][0]
            if i < n:
                nxt = min(nxt, arr[i])
            now = max(now, nxt)
        elif i < n:
            now = max(now, arr[i])
        else:
            stuck = [r.index for r in reps if r.inner.has_unfinished()]
            if stuck:
                raise SimulationError(f"replicas {stuck} made no progress with work left")
            break
    return routed, ratios


def _add_pending(rep: Replica) -> None:
    res, loop = rep.loop.res, rep.loop
    for req in rep.pending:
        rid = int(req.rid)  # type: ignore[call-overload]
        try:
            rep.sched.add(req)
        except RequestRejected as exc:
            res.rejected.append((rid, str(exc)))
            res.rejected_kind[rid] = KV_CAPACITY
            loop.state[rid] = 3
            rep.num_outstanding -= 1
        else:
            # As in the single-replica loop: an output shorter than max_new ends on its last wanted token.
            if res.target[rid] < req.max_new:
                rep.sched.stop_after(rid, res.target[rid])
    rep.pending.clear()


def _start_step(rep: Replica, now: float, cost: StepCostModel) -> tuple[float, float, Any, list[int]] | None:
    """Schedule one step on `rep` at `now`; the simulator loop's first half. None: an empty plan."""
    loop, res = rep.loop, rep.loop.res
    plan = rep.sched.schedule()
    if not plan.num_tokens and not plan.preempted:
        # Same as the single-replica loop: the empty step is completed and recorded, the replica waits.
        rep.sched.complete(plan)
        _record(rep, plan, now, now)
        return None
    step = rep.step
    nd = plan.num_decodes
    if plan.preempted:
        loop._preempt(plan.preempted, step)
    if nd != len(loop.decoding):
        loop._skips(plan, step)
    for rid in plan.admitted:
        if res.admit_step[rid] < 0:  # type: ignore[call-overload]
            res.admit_step[rid] = step  # type: ignore[call-overload]
    return (now + cost.step_time(plan), now, plan, [])


def _finish_step(rep: Replica, inflight: tuple[float, float, Any, list[int]], routed: list[int]) -> None:
    """The simulator loop's second half: complete the plan at its end time and record the step."""
    end, start, plan, _ = inflight
    loop = rep.loop
    rep.sched.complete(plan)
    if plan.num_decodes:
        loop.tick += 1
    if plan.prefills:
        loop._emitted_from_prefill(plan, rep.step)
    _record(rep, plan, start, end)
    rep.busy = False


def _record(rep: Replica, plan: Any, start: float, end: float) -> None:
    loop, res, inner = rep.loop, rep.loop.res, rep.inner
    res.step_start.append(start)
    res.step_end.append(end)
    res.step_tokens.append(plan.num_tokens)
    res.step_decodes.append(plan.num_decodes)
    res.step_kv_used.append(res.kv_total - inner.kv_free)
    res.step_waiting.append(inner.num_waiting)
    res.step_ticks.append(loop.tick)
    finished = inner.last_finished
    if finished:
        loop._finished(finished, rep.step)
        rep.num_outstanding -= len(finished)
    rep.step += 1


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
    """Lay the replicas' step arrays end to end; shift each request's step numbers by its replica's base."""
    n = len(wl)
    m = _empty_result(label, wl, config, target, max_new, None)
    m.kv_total = sum(r.kv_total for r in results)
    base, tick_base = [0], 0
    for r in results:
        m.step_start.extend(r.step_start)
        m.step_end.extend(r.step_end)
        m.step_tokens.extend(r.step_tokens)
        m.step_decodes.extend(r.step_decodes)
        m.step_kv_used.extend(r.step_kv_used)
        m.step_waiting.extend(r.step_waiting)
        m.step_ticks.extend(array("q", (t + tick_base for t in r.step_ticks)))
        tick_base += r.step_ticks[-1] if len(r.step_ticks) else 0
        base.append(base[-1] + r.num_steps)
    for rid in range(n):
        k = routed[rid]
        if k < 0:
            continue
        r, b = results[k], base[k]
        for name in ("admit_step", "first_step", "finish_step"):
            v = getattr(r, name)[rid]
            getattr(m, name)[rid] = v + b if v >= 0 else -1
        m.finish_reason[rid] = r.finish_reason[rid]
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
    for rid, why in too_long.items():
        m.rejected.append((rid, why))
        m.rejected_kind[rid] = CONTEXT_LENGTH
    m.rejected.sort()
    return m, base


def cluster_summary(
    result: ClusterResult, slo_ttft: float | None = None, slo_tpot: float | None = None
) -> dict[str, Any]:
    """The cluster-wide summary with the single-run keys (report.summarize_result of `merged`),
    plus `replicas` (one summary per replica, each with `replica`, the requests routed to it as
    `num_requests`) and the imbalance figures `load_imbalance_mean` and `load_imbalance_max`.

    With prefix caching on, prefix_cache_hit_rate (cached prompt tokens / prompt tokens looked up,
    summed over replicas), prefix_cache_hit_rate_bound (one infinite cache over the whole
    workload) and prefix_cache_evictions (summed); each replica's entry has its own three (its
    bound over the requests routed to it). Without caching all are None, as in a single run.

    mean_kv_utilization and max_kv_utilization of the cluster are the mean and the max of the
    replicas' figures (a replica's own KV is what it can use).
    """
    from stallfree.sim.report import summarize_result

    out = summarize_result(result.merged, slo_ttft, slo_tpot)
    reps = []
    for k, res in enumerate(result.replicas):
        s = summarize_result(res, slo_ttft, slo_tpot)
        s["replica"] = k
        s["num_requests"] = sum(1 for r in result.routed if r == k)
        # A replica that served nothing still states its cache figures (0 hits, its bound).
        s.setdefault("prefix_cache_hit_rate", res.prefix_cache_hit_rate)
        s.setdefault("prefix_cache_hit_rate_bound", res.prefix_cache_hit_rate_bound)
        s.setdefault("prefix_cache_evictions", res.prefix_cache_evictions)
        reps.append(s)
    kv_means = [s["mean_kv_utilization"] for s in reps if s.get("mean_kv_utilization") is not None]
    kv_maxes = [s["max_kv_utilization"] for s in reps if s.get("max_kv_utilization") is not None]
    if "mean_kv_utilization" in out:
        out["mean_kv_utilization"] = sum(kv_means) / len(kv_means) if kv_means else None
        out["max_kv_utilization"] = max(kv_maxes) if kv_maxes else None
    out["load_imbalance_mean"] = result.imbalance_mean
    out["load_imbalance_max"] = result.imbalance_max
    out["replicas"] = reps
    if out.get("duration_s") and math.isfinite(out["duration_s"]):
        out["sim_requests_per_wall_s"] = out.get("completed", 0) / result.wall_s if result.wall_s > 0 else None
    return out



def run_cluster_experiment(
    setup: Any,
    *,
    replicas: int,
    router: Router | str = "least-outstanding",
    budget: int | None = None,
    step_time_target: float | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> Any:
    """`stallfree simulate --replicas N`: run_cluster_study's Experiment (its arguments, results
    and errors)."""
    study, _ = run_cluster_study(
        setup, replicas=replicas, router=router, budget=budget, step_time_target=step_time_target, check=check,
        slo_ttft=slo_ttft, slo_tpot=slo_tpot,
    )
    return study


def run_cluster_study(
    setup: Any,
    *,
    replicas: int,
    router: Router | str = "least-outstanding",
    budget: int | None = None,
    step_time_target: float | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> tuple[Any, ClusterResult]:
    """The setup's workload on N replicas of its scheduler: (Experiment, ClusterResult), the latter
    with each replica's own SimResult (for a per-replica timeline).

    Args:
        setup: a stallfree.sim.setup.Setup (each replica is its hardware, KV and scheduler).
        replicas: N >= 1.
        router: a Router or one of ROUTERS (default least-outstanding).
        budget, step_time_target, check, slo_ttft, slo_tpot: as experiment.run_experiment.

    Returns:
        (a stallfree.sim.experiment.Experiment with one result (the merged cluster) and one summary
        (cluster_summary, plus capacity_req_s: N times one replica's saturated throughput, and load),
        the ClusterResult).

    Raises:
        ClusterError: replicas < 1 or an unknown router.
        SetupError, SimulationError: as run_experiment.
    """
    from stallfree.sim.experiment import Experiment, _check_options, _scheduler_for
    from stallfree.sim.setup import TIME_BUDGET_CAP
    from stallfree.sim.simulator import saturated_throughput

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ClusterError(f"replicas must be an integer >= 1, got {replicas!r}")
    rt = make_router(router) if isinstance(router, str) else router
    _check_options(setup, ["chunked"], step_time_target, check)
    if budget is None:
        budget = 2048 if step_time_target is None else TIME_BUDGET_CAP
    sched = _scheduler_for(setup, "chunked", budget, step_time_target)
    opts = setup.workload_options
    result = simulate_cluster(
        setup.workload,
        sched,
        setup.cost_model,
        replicas,
        rt,
        max_tokens=opts.max_tokens,
        check=check,
        label=getattr(sched, "label", None),
        max_model_len=setup.context_length,
        cut_output_to_fit=opts.cut_output_to_fit,
    )
    result.merged.config.update(router=router if isinstance(router, str) else type(router).__name__)
    summary = cluster_summary(result, slo_ttft, slo_tpot)
    summary["router"] = result.merged.config["router"]
    one = saturated_throughput(
        setup.workload, sched, setup.cost_model, opts.max_tokens,
        max_model_len=setup.context_length, cut_output_to_fit=opts.cut_output_to_fit,
    )
    capacity = one * replicas
    load = setup.workload.mean_rate / capacity if capacity > 0 else math.inf
    summary["capacity_req_s"] = capacity if math.isfinite(capacity) else None
    summary["load"] = load if math.isfinite(load) else None
    header = setup.header()
    if not math.isfinite(header["offered_rate"]):
        header["offered_rate"] = None
    header.update(token_budget=budget, step_time_target_s=step_time_target, replicas=replicas,
                  router=summary["router"])
    return Experiment(header, [result.merged], [summary]), result
