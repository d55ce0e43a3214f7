"""Former path of `stallfree.sim.run.cluster`, kept for one release: import from the new path.

Many replicas behind a router, in one event loop with one simulated clock. Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.setup import TIME_BUDGET_CAP, Setup
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.cluster import ClusterResult, simulate_cluster
from stallfree.sim.run.config import ReplicaConfig, async_of, make_scheduler, wrap_checker
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.loop import Router
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import CONTEXT_LENGTH, ClusterError, SchedulerLike, SimResult, verify_tokens
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
from stallfree.sim.run.simulator import new_result, plan_run, run_group, saturated_throughput
from stallfree.sim.studies.cluster_study import cluster_summary, run_cluster_experiment, run_cluster_study
from stallfree.sim.studies.experiment import Experiment, check_options, record_capacity, scheduler_for, study_header

__all__ = [
    "CONTEXT_LENGTH",
    "ClosedLoop",
    "ClusterError",
    "ClusterResult",
    "DEFAULT_AFFINITY_LOAD_FACTOR",
    "DEFAULT_AFFINITY_LOAD_MARGIN",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_PREFIX_THRESHOLD",
    "DEFAULT_ROUTER_SEED",
    "DEFAULT_TOKEN_BUDGET",
    "Experiment",
    "LeastKVRouter",
    "LeastOutstandingRouter",
    "PrefixAffinityRouter",
    "ROUTERS",
    "RandomRouter",
    "Replica",
    "ReplicaConfig",
    "RoundRobinRouter",
    "Router",
    "SchedulerLike",
    "SessionArrivals",
    "SessionEntry",
    "SessionWorkload",
    "Setup",
    "SimResult",
    "StepCostModel",
    "TIME_BUDGET_CAP",
    "Workload",
    "async_of",
    "check_options",
    "close_sessions",
    "cluster_summary",
    "make_router",
    "make_scheduler",
    "new_result",
    "plan_run",
    "record_capacity",
    "run_cluster_experiment",
    "run_cluster_study",
    "run_group",
    "saturated_throughput",
    "scheduler_for",
    "simulate_cluster",
    "study_header",
    "summarize_result",
    "verify_tokens",
    "wrap_checker",
]
