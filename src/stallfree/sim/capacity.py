"""Former path of `stallfree.sim.studies.capacity`, kept for one release: import from the new path.

Capacity planning: the smallest number of replicas, and the router, whose cluster meets the SLOs on a workload, and
whether disaggregated prefill/decode does it on fewer GPUs. Every public name this module had is re-exported from
where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.routers import ROUTERS, make_router
from stallfree.sim.run.simulator import saturated_throughput
from stallfree.sim.studies.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_ROUTERS,
    DISAGG_PREFILL_SHARES,
    ROW_KEYS,
    SPLITS_PER_COUNT,
    PlanPoint,
    PlanResult,
    attainment_of,
    disagg_splits,
    next_counts,
    plan,
    plan_report,
    run_plan_point,
    walk_mixed_split,
)
from stallfree.sim.studies.cluster_study import cluster_summary
from stallfree.sim.studies.disagg_search import run_disagg_experiment
from stallfree.sim.studies.executors import Executor, SerialExecutor
from stallfree.sim.studies.experiment import scheduler_for
from stallfree.sim.studies.split_bound import SplitBound, split_bound, split_order

__all__ = [
    "DEFAULT_ATTAINMENT",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_ROUTERS",
    "DEFAULT_TOKEN_BUDGET",
    "DISAGG_PREFILL_SHARES",
    "Executor",
    "PlanPoint",
    "PlanResult",
    "ROUTERS",
    "ROW_KEYS",
    "SPLITS_PER_COUNT",
    "SerialExecutor",
    "SplitBound",
    "attainment_of",
    "cluster_summary",
    "disagg_splits",
    "make_router",
    "next_counts",
    "plan",
    "plan_report",
    "run_disagg_experiment",
    "run_plan_point",
    "saturated_throughput",
    "scheduler_for",
    "simulate_cluster",
    "split_bound",
    "split_order",
    "walk_mixed_split",
]
