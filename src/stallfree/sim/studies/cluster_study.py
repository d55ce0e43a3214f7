"""A cluster as a study: N replicas of a Setup's scheduler behind a router, run as `stallfree simulate
--replicas N` runs it, and the cluster-wide summary (the single-run keys of the merged result, plus
each replica's).

Imports allowed: the standard library, stallfree.core and stallfree.sim.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.setup import TIME_BUDGET_CAP, Setup
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.cluster import ClusterResult, _check_replicas, simulate_cluster
from stallfree.sim.run.loop import Router
from stallfree.sim.run.memory import give_back
from stallfree.sim.run.routers import make_router
from stallfree.sim.run.simulator import saturated_throughput
from stallfree.sim.studies.experiment import (
    Experiment,
    check_options,
    record_capacity,
    scheduler_for,
    study_header,
)

__all__ = [
    "cluster_summary",
    "run_cluster_experiment",
    "run_cluster_study",
]


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
    out = summarize_result(result.merged, slo_ttft, slo_tpot)
    routed_to = Counter(result.routed)  # one pass, not one per replica
    reps = []
    for k, res in enumerate(result.replicas):
        s = summarize_result(res, slo_ttft, slo_tpot)
        s["replica"] = k
        s["num_requests"] = routed_to[k]
        # A replica that served nothing still states its cache figures (0 hits, its bound).
        s.setdefault("prefix_cache_hit_rate", res.prefix_cache_hit_rate)
        s.setdefault("prefix_cache_hit_rate_bound", res.prefix_cache_hit_rate_bound)
        s.setdefault("prefix_cache_evictions", res.prefix_cache_evictions)
        reps.append(s)
        give_back()  # its latency arrays, freed in the middle of the heap
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
    setup: Setup,
    *,
    replicas: int,
    router: Router | str = "least-outstanding",
    budget: int | None = None,
    step_time_target: float | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> Experiment:
    """`stallfree simulate --replicas N`: run_cluster_study's Experiment (its arguments, results
    and errors)."""
    study, _ = run_cluster_study(
        setup, replicas=replicas, router=router, budget=budget, step_time_target=step_time_target, check=check,
        slo_ttft=slo_ttft, slo_tpot=slo_tpot,
    )
    return study


def run_cluster_study(
    setup: Setup,
    *,
    replicas: int,
    router: Router | str = "least-outstanding",
    budget: int | None = None,
    step_time_target: float | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    capacity: bool = True,
    group: Callable[..., Any] | None = None,
) -> tuple[Experiment, ClusterResult]:
    """The setup's workload on N replicas of its scheduler: (Experiment, ClusterResult), the latter
    with each replica's own SimResult (for a per-replica timeline).

    Args:
        setup: a stallfree.sim.inputs.setup.Setup (each replica is its hardware, KV and scheduler).
        replicas: N >= 1.
        router: a Router or one of ROUTERS (default least-outstanding).
        budget, step_time_target, check, slo_ttft, slo_tpot, capacity: as experiment.run_experiment.
        group: the event loop's runner (simulate_cluster's `group`; default run_group).

    Returns:
        (a stallfree.sim.studies.experiment.Experiment with one result (the merged cluster) and one summary
        (cluster_summary, plus capacity_req_s: N times one replica's saturated throughput, and load),
        the ClusterResult).

    Raises:
        ClusterError: replicas < 1 or an unknown router.
        SetupError, SimulationError: as run_experiment.
    """
    _check_replicas(replicas)
    rt = make_router(router) if isinstance(router, str) else router
    check_options(setup, ["chunked"], step_time_target, check)
    if budget is None:
        budget = DEFAULT_TOKEN_BUDGET if step_time_target is None else TIME_BUDGET_CAP
    sched = scheduler_for(setup, "chunked", budget, step_time_target)
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
        closed_loop=setup.engine_closed_loop,
        group=group,
        records=setup.keep_records,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
    )
    result.merged.config.update(router=router if isinstance(router, str) else type(router).__name__)
    summary = cluster_summary(result, slo_ttft, slo_tpot)
    summary["router"] = result.merged.config["router"]
    if capacity:
        one = saturated_throughput(
            setup.workload, sched, setup.cost_model, opts.max_tokens,
            max_model_len=setup.context_length, cut_output_to_fit=opts.cut_output_to_fit,
        )
        record_capacity(setup, summary, one * replicas)
    header = study_header(setup)
    header.update(token_budget=budget, step_time_target_s=step_time_target, replicas=replicas,
                  router=summary["router"])
    return Experiment(header, [result.merged], [summary]), result
