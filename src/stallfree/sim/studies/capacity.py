"""Capacity planning: the smallest number of replicas, and the router, whose cluster meets the SLOs on
a workload, and whether disaggregated prefill/decode does it on fewer GPUs. `stallfree plan`
(stallfree.sim.commands.plan) prints it.

Imports allowed: the standard library and stallfree.sim.

"Meets the SLOs": the share of all requests (a refused request misses) whose TTFT <= slo_ttft and
TPOT <= slo_tpot is at least `attainment` (default 0.99).

The search (`plan`), assuming attainment does not fall as replicas are added:

1. Bound: one replica's saturated throughput mu_1 (simulator.saturated_throughput); a start at
   N0 = ceil(offered rate / mu_1), clamped to [1, max_replicas]. N0 is simulated, not assumed: a
   finite trace may be served by fewer replicas than its mean rate needs, if its SLOs allow a queue.
2. Gallop: from N0 upward (N0 + 1, N0 + 3, N0 + 7, ...: gaps doubling) until a count passes, or
   downward (N0 - 1, N0 - 2, N0 - 4, ...) until one fails; then bisection between the largest failing
   and the smallest passing count. Each round simulates as many counts as the executor has workers
   (`width`), spread over the interval, so a pool of workers shortens the search rather than idling.
   All with the first router (least-outstanding by default).
3. The other routers one count below the answer (and lower while one passes there).
4. Disaggregation: P:D splits on fewer replicas than the answer (fewer GPUs), each side the setup's
   replica, P over the whole range 1..N-1. Each side's capacity bounds the splits before any is
   simulated (`split_bound`): one prefill replica's saturated throughput mu_p (the prompts with one
   output token each) and one decode replica's mu_d (the outputs after the first, priced at their true
   context) give P >= ceil(rate / mu_p) and D >= ceil(rate / mu_d); a split below either side's mean
   load is not simulated. The counts N = P + D are searched as in step 2, from the bound's
   P_min + D_min up to the answer - 1; at each count the allowed splits are tried nearest the balanced
   share first (P / N = (1 / mu_p) / (1 / mu_p + 1 / mu_d): both sides equally loaded), at most
   SPLITS_PER_COUNT of them, and a count passes when one of them meets the SLOs. Disaggregation beats
   the aggregated answer when some split meets the SLOs on fewer replicas; a split may put more
   replicas on prefill than on decode (a prefill-heavy workload).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stallfree.sim.defaults import DEFAULT_ATTAINMENT, DEFAULT_MAX_REPLICAS, DEFAULT_ROUTERS, DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.routers import ROUTERS, make_router
from stallfree.sim.run.simulator import saturated_throughput
from stallfree.sim.studies.cluster_study import cluster_summary
from stallfree.sim.studies.disagg_search import run_disagg_experiment
from stallfree.sim.studies.executors import Executor, SerialExecutor
from stallfree.sim.studies.experiment import scheduler_for
from stallfree.sim.studies.split_bound import SplitBound, split_bound, split_order

__all__ = [
    "DEFAULT_ATTAINMENT",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_ROUTERS",
    "DISAGG_PREFILL_SHARES",
    "SPLITS_PER_COUNT",
    "PlanPoint",
    "PlanResult",
    "SplitBound",
    "attainment_of",
    "disagg_splits",
    "next_counts",
    "plan",
    "plan_report",
    "split_bound",
    "split_order",
    "walk_mixed_split",
]

#: The prefill shares of disagg_splits: P = round(share x replicas), within [1, replicas - 1] (kept for
#: callers; plan itself tries every split its capacity bound allows, split_order).
DISAGG_PREFILL_SHARES = (1 / 6, 1 / 4, 1 / 3, 1 / 2)
#: The most P:D splits plan simulates at one replica count, nearest the balanced share first: the
#: capacity bound says where the balance lies, so a split far from it is not expected to pass where
#: the three nearest do not (this project's choice, to keep the search a few simulations per count).
SPLITS_PER_COUNT = 3
#: The per-run keys a plan keeps (its table and --json rows).
ROW_KEYS = (
    "label", "kind", "replicas", "prefill", "decode", "prefill_tp", "decode_tp", "prefill_budget", "decode_budget",
    "router", "num_gpus", "attainment", "slo_attainment",
    "request_goodput", "goodput_per_gpu", "completed", "rejected", "median_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "sim_wall_s",
)


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One cluster to simulate (picklable: an executor's item).

    Attributes:
        setup: the stallfree.sim.inputs.setup.Setup (workload, replica, scheduler).
        replicas: aggregated replicas (kind "aggregated"), or P + D.
        router: a name of stallfree.sim.run.routers.ROUTERS.
        budget: token budget per step, tokens.
        slo_ttft, slo_tpot: the SLOs, s (None: none).
        prefill: P of a disaggregated split, or None (aggregated).
        link: the disaggregated KV link (stallfree.sim.run.disagg_link.Interconnect), or None for the default.
        sides_tp: a split's (prefill TP, decode TP) when they differ from the setup's, or None.
        side_budgets: a split's (prefill, decode) token budgets per step, tokens, or None for `budget`.
    """

    setup: Setup
    replicas: int
    router: str
    budget: int
    slo_ttft: float | None
    slo_tpot: float | None
    prefill: int | None = None
    link: Any = None
    sides_tp: tuple[int, int] | None = None
    side_budgets: tuple[int, int] | None = None


def attainment_of(summary: dict[str, Any]) -> float:
    """Requests within both SLOs over all requests (refused ones miss), from a summary's
    slo_attainment (over completed requests), completed and num_requests."""
    n = summary.get("num_requests") or 0
    if not n:
        return 0.0
    return float(summary.get("slo_attainment") or 0.0) * (summary.get("completed") or 0) / n


def run_plan_point(point: PlanPoint) -> dict[str, Any]:
    """Worker: simulate one point; its summary reduced to ROW_KEYS (plus by_prompt_len)."""
    setup = point.setup
    tp = setup.hardware_options.tp
    gpus = point.replicas * tp
    if point.prefill is None:
        sched = scheduler_for(setup, "chunked", point.budget, None)
        opts = setup.workload_options
        result = simulate_cluster(
            setup.workload, sched, setup.cost_model, point.replicas, make_router(point.router),
            max_tokens=opts.max_tokens, label=getattr(sched, "label", None), max_model_len=setup.context_length,
            cut_output_to_fit=opts.cut_output_to_fit, closed_loop=setup.engine_closed_loop,
        )
        s = cluster_summary(result, point.slo_ttft, point.slo_tpot)
        s.update(kind="aggregated", label=f"x{point.replicas} {point.router}", prefill=None, decode=None)
    else:
        tp_p, tp_d = point.sides_tp or (tp, tp)
        decode = point.replicas - point.prefill
        bp, bd = point.side_budgets or (point.budget, point.budget)
        _, s, _ = run_disagg_experiment(
            setup, prefill=point.prefill, decode=decode, link=point.link, prefill_tp=tp_p, decode_tp=tp_d,
            router=point.router, budget=point.budget, slo_ttft=point.slo_ttft, slo_tpot=point.slo_tpot,
            prefill_budget=bp, decode_budget=bd,
        )
        gpus = point.prefill * tp_p + decode * tp_d
        label = f"disagg {point.prefill}P:{decode}D" + (f" tp {tp_p}/{tp_d}" if point.sides_tp else "")
        s.update(kind="disaggregated", label=label, prefill=point.prefill, decode=decode)
    s.update(replicas=point.replicas, router=point.router, num_gpus=gpus, attainment=attainment_of(s))
    s["goodput_per_gpu"] = (s.get("request_goodput") or 0.0) / gpus
    return {k: s.get(k) for k in ROW_KEYS} | {"by_prompt_len": s.get("by_prompt_len")}


def next_counts(fail: int | None, ok: int | None, start: int, tried: set[int], width: int,
                max_replicas: int) -> list[int]:
    """The counts of the next search round (module docstring, step 2); [] when the search is done.

    Args:
        fail: the largest count known to fail, or None.
        ok: the smallest count known to pass, or None.
        start: N0.
        tried: counts already simulated.
        width: counts per round (>= 1).
        max_replicas: the largest count allowed.
    """
    out: list[int] = []
    if ok is None:
        k = 0
        while len(out) < width:
            n = start + (1 << k) - 1
            if n > max_replicas:
                # The gallop overshoots the cap: the cap itself is the last count to try.
                top = max_replicas
                if top not in tried and top not in out and (fail is None or top > fail):
                    out.append(top)
                break
            if n not in tried and (fail is None or n > fail):
                out.append(n)
            k += 1
        return out
    if fail is None:
        if ok == 1:
            return []
        k = 0
        while len(out) < width:
            n = start - (1 << k)
            if n < 1:
                if 1 not in tried and 1 not in out and 1 < ok:
                    out.append(1)
                break
            if n not in tried and n < ok:
                out.append(n)
            k += 1
        return out
    gap = ok - fail
    if gap <= 1:
        return []
    picks = sorted({fail + max(1, min(gap - 1, round(i * gap / (width + 1)))) for i in range(1, width + 1)})
    return [n for n in picks if n not in tried]


def disagg_splits(replicas: int) -> list[int]:
    """The prefill counts P of the P:D splits at DISAGG_PREFILL_SHARES of `replicas`, ascending;
    [] below 2 replicas."""
    if replicas < 2:
        return []
    return sorted({min(replicas - 1, max(1, round(f * replicas))) for f in DISAGG_PREFILL_SHARES})


@dataclass(slots=True)
class PlanResult:
    """What `plan` found.

    Attributes:
        replicas: the smallest count that meets the SLOs, or None when none up to max_replicas does.
        router: the router of that answer.
        bound: N0, the start from one replica's capacity; single_capacity: mu_1, req/s.
        offered_rate: the workload's mean arrival rate, req/s.
        rows: every simulated cluster's row (ROW_KEYS), in the order simulated.
        disaggregated: the best disaggregated row that meets the SLOs on fewer replicas, or None.
        disagg_tried: whether disaggregation was searched.
        attainment: the target share.
        wall_s: the search's wall time, s.
        gpus_per_replica: the setup's tensor parallelism.
        split_bound: the P:D splits' capacity bound (SplitBound), or None when splits were not searched.
        splits_bounded: P:D splits of the counts searched that the bound ruled out unsimulated.
    """

    replicas: int | None
    router: str | None
    bound: int
    single_capacity: float
    offered_rate: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    disaggregated: dict[str, Any] | None = None
    disagg_tried: bool = False
    attainment: float = DEFAULT_ATTAINMENT
    wall_s: float = 0.0
    gpus_per_replica: int = 1
    split_bound: SplitBound | None = None
    splits_bounded: int = 0

    @property
    def answer_row(self) -> dict[str, Any] | None:
        """The row of the aggregated answer (replicas, router), or None."""
        for r in self.rows:
            if r["kind"] == "aggregated" and r["replicas"] == self.replicas and r["router"] == self.router:
                return r
        return None


class _Search:
    """The search's state: the setup and targets, the executor, and every row simulated so far."""

    def __init__(self, setup: Setup, slo: tuple[float | None, float | None], attainment: float, budget: int,
                 link: Any, executor: Executor, progress: Callable[[int, int], None] | None,
                 side_budgets: tuple[int, int] | None = None) -> None:
        self.setup, self.slo, self.attainment, self.budget, self.link = setup, slo, attainment, budget, link
        self.executor, self.progress, self.side_budgets = executor, progress, side_budgets
        self.rows: list[dict[str, Any]] = []

    def run(self, points: Sequence[tuple[Any, ...]]) -> list[dict[str, Any]]:
        """Simulate (replicas, router, prefill or None[, sides_tp]) points on the executor; keep and return
        their rows."""
        base = len(self.rows)
        planned = base + len(points)

        def tick(k: int) -> None:
            if self.progress:
                self.progress(base + k, planned)

        items = [PlanPoint(self.setup, n, r, self.budget, *self.slo, p, self.link,
                           sides_tp=rest[0] if rest else None,
                           side_budgets=self.side_budgets if p is not None else None)
                 for n, r, p, *rest in points]
        rows = self.executor.map(run_plan_point, items, tick)
        self.rows.extend(rows)
        return rows

    def passes(self, row: dict[str, Any]) -> bool:
        return bool(row["attainment"] >= self.attainment)

    def smallest(self, router: str, start: int, width: int, max_replicas: int) -> int | None:
        """Step 2: the smallest passing count with `router` (gallop, then bisection), or None."""
        return self._search(lambda counts: [self.passes(r) for r in self.run([(n, router, None) for n in counts])],
                            start, width, max_replicas)

    def _search(self, verdicts: Callable[[list[int]], list[bool]], start: int, width: int,
                max_replicas: int) -> int | None:
        """The smallest count that `verdicts` passes (gallop from `start`, then bisection), or None."""
        fail: int | None = None
        ok: int | None = None
        tried: set[int] = set()
        while counts := next_counts(fail, ok, start, tried, width, max_replicas):
            for n, passed in zip(counts, verdicts(counts), strict=True):
                tried.add(n)
                if passed:
                    ok = n if ok is None else min(ok, n)
                else:
                    fail = n if fail is None else max(fail, n)
        return ok

    def other_routers(self, result: PlanResult, others: list[str]) -> None:
        """Step 3: lower the answer while another router passes one count below it."""
        while result.replicas is not None and result.replicas > 1 and others:
            winners = [r for r in self.run([(result.replicas - 1, o, None) for o in others]) if self.passes(r)]
            if not winners:
                return
            best = max(winners, key=lambda r: (r["attainment"], -(r["p99_ttft_ms"] or math.inf)))
            result.replicas, result.router = result.replicas - 1, best["router"]
            others = [r["router"] for r in winners]

    def disaggregation(self, result: PlanResult, router: str, bound: SplitBound, most: int, width: int) -> None:
        """Step 4: the fewest replicas, at most `most`, on which a P:D split meets the SLOs; its best
        row (highest attainment, then goodput per GPU) becomes result.disaggregated."""
        result.disagg_tried, result.split_bound = True, bound
        if most < 2:
            return
        found: dict[int, dict[str, Any]] = {}

        def verdicts(counts: list[int]) -> list[bool]:
            points, bounded = [], 0
            for n in counts:
                order = split_order(n, bound)
                points += [(n, router, p) for p in order[:SPLITS_PER_COUNT]]
                bounded += (n - 1) - len(order[:SPLITS_PER_COUNT])
            result.splits_bounded += bounded
            rows = self.run(points) if points else []
            out = []
            for n in counts:
                winners = [r for r in rows if r["replicas"] == n and self.passes(r)]
                if winners:
                    found[n] = max(winners, key=lambda r: (r["attainment"], r["goodput_per_gpu"]))
                out.append(bool(winners))
            return out

        start = min(max(2, bound.p_min + bound.d_min), most)
        per_round = max(1, width // SPLITS_PER_COUNT)
        n = self._search(verdicts, start, per_round, most)
        result.disaggregated = found.get(n) if n is not None else None


def walk_mixed_split(
    setup: Setup, slo: tuple[float | None, float | None], sides_tp: tuple[int, int], start: tuple[int, int], *,
    fits: Callable[[int, int], bool], attainment: float, router: str, budget: int, executor: Executor,
    link: Any = None, progress: Callable[[int, int], None] | None = None,
    side_budgets: tuple[int, int] | None = None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A P:D split whose sides use different tensor parallelism: from `start` (each side's bound, P_min
    and D_min at its TP) add one replica at a time to the side whose SLO misses more (p99 TTFT over its
    objective against p99 TPOT over its objective: TTFT is the prefill side's, TPOT the decode side's)
    until a split meets the SLOs or `fits(P, D)` refuses it (the cost cap). One simulation a step.

    Args:
        setup: the GPU type's Setup (any TP: each side is rebuilt at its own).
        slo: (slo_ttft, slo_tpot), s.
        sides_tp: (prefill TP, decode TP).
        start: (P, D) to begin with, each >= 1.
        fits: whether a split (P, D) may be tried.
        attainment, router, budget, executor, link, progress, side_budgets: as plan.

    Returns:
        (the passing row or None, every row simulated).
    """
    search = _Search(setup, slo, attainment, budget, link, executor, progress, side_budgets)
    p, d = max(1, start[0]), max(1, start[1])
    while fits(p, d):
        row = search.run([(p + d, router, p, sides_tp)])[0]
        if search.passes(row):
            return row, search.rows
        over_ttft = (row.get("p99_ttft_ms") or math.inf) / (slo[0] * 1e3) if slo[0] else 0.0
        over_tpot = (row.get("p99_tpot_ms") or math.inf) / (slo[1] * 1e3) if slo[1] else 0.0
        if over_ttft >= over_tpot:
            p += 1
        else:
            d += 1
    return None, search.rows


def _check_plan_options(slo_ttft: float | None, slo_tpot: float | None, attainment: float,
                        routers: Sequence[str], max_replicas: int, width: int) -> None:
    """Refuse plan's options before any simulation (plan's Args).

    Raises:
        ValueError: no SLO, attainment outside (0, 1], max_replicas < 1, width < 1, no router, or an
            unknown router; the message names the field and the value.
    """
    if slo_ttft is None and slo_tpot is None:
        raise ValueError("plan needs an SLO: give slo_ttft and/or slo_tpot")
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment!r}")
    if max_replicas < 1 or width < 1:
        raise ValueError(f"max_replicas and width must be >= 1, got {max_replicas!r}, {width!r}")
    if not routers or any(r not in ROUTERS for r in routers):
        raise ValueError(f"routers must be names of {', '.join(ROUTERS)}, got {list(routers)!r}")


def plan(
    setup: Setup,
    slo_ttft: float | None,
    slo_tpot: float | None,
    *,
    attainment: float = DEFAULT_ATTAINMENT,
    routers: Sequence[str] = DEFAULT_ROUTERS,
    budget: int = DEFAULT_TOKEN_BUDGET,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    executor: Executor | None = None,
    width: int = 1,
    disaggregate: bool = True,
    link: Any = None,
    progress: Callable[[int, int], None] | None = None,
    disagg_max_replicas: int | None = None,
    single_capacity: float | None = None,
    side_budgets: tuple[int, int] | None = None,
) -> PlanResult:
    """The smallest replica count and router meeting the SLOs on the setup's workload (module docstring).

    Args:
        setup: a stallfree.sim.inputs.setup.Setup; each replica is its hardware and scheduler.
        slo_ttft, slo_tpot: the SLOs, s (at least one).
        attainment: the share of requests that must meet them, in (0, 1].
        routers: names of stallfree.sim.run.routers.ROUTERS; the first leads the search.
        budget: token budget per step, tokens.
        max_replicas: the largest count tried (>= 1).
        executor: where the simulations run (default serial).
        width: counts simulated per round (the executor's workers).
        disaggregate: also search P:D splits on fewer replicas.
        link: the disaggregated KV link (None: the default interconnect).
        progress: called with (finished, planned) simulations.
        disagg_max_replicas: the most replicas a P:D split may use, besides fewer than the aggregated
            answer (None: no other limit, and no split is searched when there is no aggregated answer).
        single_capacity: mu_1, one replica's saturated throughput, requests/s, when the caller has it
            (stallfree.sim.studies.fleet bounds every shape first); None: simulated here.
        side_budgets: the P:D splits' (prefill, decode) token budgets per step, tokens (None: `budget` on
            both sides, as the aggregated replicas').

    Returns:
        A PlanResult.

    Raises:
        ValueError: no SLO, attainment outside (0, 1], max_replicas < 1, width < 1, no router, or an
            unknown router; SimulationError, SetupError: as the simulations.
    """
    _check_plan_options(slo_ttft, slo_tpot, attainment, routers, max_replicas, width)
    t0 = time.perf_counter()
    opts = setup.workload_options
    mu1 = single_capacity if single_capacity is not None else saturated_throughput(
        setup.workload, scheduler_for(setup, "chunked", budget, None), setup.cost_model, opts.max_tokens,
        max_model_len=setup.context_length, cut_output_to_fit=opts.cut_output_to_fit)
    offered = setup.workload.mean_rate
    n0 = math.ceil(offered / mu1) if math.isfinite(offered) and mu1 > 0 and math.isfinite(mu1) else 1
    n0 = min(max(1, n0), max_replicas)
    search = _Search(setup, (slo_ttft, slo_tpot), attainment, budget, link, executor or SerialExecutor(), progress,
                     side_budgets)
    lead = routers[0]
    ok = search.smallest(lead, n0, width, max_replicas)
    result = PlanResult(ok, lead if ok is not None else None, n0, mu1, offered, attainment=attainment,
                        gpus_per_replica=setup.hardware_options.tp)
    search.other_routers(result, list(routers[1:]))
    most = result.replicas - 1 if result.replicas is not None else None
    if disagg_max_replicas is not None:
        most = disagg_max_replicas if most is None else min(most, disagg_max_replicas)
    if disaggregate and most is not None:
        if most >= 2:
            search.disaggregation(result, lead, split_bound(setup, budget, side_budgets), most, width)
        else:
            result.disagg_tried = True  # nothing to split: 1 replica cannot be prefill and decode
    result.rows = search.rows
    result.wall_s = time.perf_counter() - t0
    return result


def plan_report(result: PlanResult, header: dict[str, Any], slo_ttft: float | None,
                slo_tpot: float | None) -> dict[str, Any]:
    """The JSON report of a plan: header, SLOs (s), the target, the answer (replicas, router, GPUs,
    its row; None when none meets the SLOs), the bound, the disaggregated finding, every row, wall_s."""
    row = result.answer_row
    return {
        "header": header,
        "slo_ttft_s": slo_ttft,
        "slo_tpot_s": slo_tpot,
        "slo_attainment_target": result.attainment,
        "answer": None if row is None else {
            "replicas": result.replicas, "router": result.router, "num_gpus": row["num_gpus"], "row": row},
        "bound": {"single_replica_capacity_req_s": result.single_capacity, "offered_rate": result.offered_rate,
                  "start_replicas": result.bound},
        "disaggregation": {
            "searched": result.disagg_tried,
            "beats_aggregated": result.disaggregated is not None,
            "best": result.disaggregated,
            "splits_not_simulated": result.splits_bounded,
            "bound": None if result.split_bound is None else {
                "prefill_capacity_req_s": result.split_bound.prefill_capacity,
                "decode_capacity_req_s": result.split_bound.decode_capacity,
                "min_prefill": result.split_bound.p_min, "min_decode": result.split_bound.d_min},
        },
        "rows": result.rows,
        "simulations": len(result.rows),
        "wall_s": result.wall_s,
        "gpus_per_replica": result.gpus_per_replica,
    }
