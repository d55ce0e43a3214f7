"""Former path of `stallfree.sim.run.disagg`, kept for one release: import from the new path.

Disaggregated prefill and decode: P prefill replicas and D decode replicas in one event loop. Every public name this
module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.options import SetupError
from stallfree.sim.inputs.pricing import build_cost_model
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.disagg_report import RECORD_FIELDS, disagg_records, disagg_summary
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.config import ReplicaConfig, make_scheduler, wrap_checker
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.disagg import DisaggResult, parse_disaggregate, simulate_disaggregated
from stallfree.sim.run.disagg_link import DEFAULT_INTERCONNECT, INTERCONNECTS, Interconnect
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, Router, route_to
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    ClusterError,
    RequestState,
    SchedulerLike,
    SimResult,
    verify_tokens,
)
from stallfree.sim.run.routers import LeastOutstandingRouter, make_router
from stallfree.sim.run.simulator import context_overflows, new_result
from stallfree.sim.studies.cluster_study import run_cluster_experiment
from stallfree.sim.studies.disagg_search import (
    DEFAULT_AGGREGATED_BUDGETS,
    DEFAULT_DECODE_BUDGETS,
    DEFAULT_PREFILL_BUDGETS,
    kv_bytes_per_token_of,
    run_disagg_experiment,
    search_plan,
    sides_behaviour,
)
from stallfree.sim.studies.experiment import study_header

__all__ = [
    "Arrivals",
    "CONTEXT_LENGTH",
    "ClosedLoop",
    "ClusterError",
    "DEFAULT_AGGREGATED_BUDGETS",
    "DEFAULT_DECODE_BUDGETS",
    "DEFAULT_INTERCONNECT",
    "DEFAULT_PREFILL_BUDGETS",
    "DEFAULT_TOKEN_BUDGET",
    "DisaggResult",
    "Entry",
    "EventLoop",
    "INTERCONNECTS",
    "Interconnect",
    "KV_CAPACITY",
    "LeastOutstandingRouter",
    "RECORD_FIELDS",
    "Replica",
    "ReplicaConfig",
    "RequestState",
    "Router",
    "SchedulerLike",
    "SetupError",
    "SimResult",
    "StepCostModel",
    "Workload",
    "build_cost_model",
    "context_overflows",
    "disagg_records",
    "disagg_summary",
    "kv_bytes_per_token_of",
    "make_router",
    "make_scheduler",
    "new_result",
    "parse_disaggregate",
    "route_to",
    "run_cluster_experiment",
    "run_disagg_experiment",
    "search_plan",
    "sides_behaviour",
    "simulate_disaggregated",
    "study_header",
    "summarize_result",
    "verify_tokens",
    "wrap_checker",
]
