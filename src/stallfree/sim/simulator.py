"""Former path of `stallfree.sim.run.simulator`, kept for one release: import from the new path.

The simulator's single-replica entry point: replays a Workload through a scheduler, pricing each StepPlan with a
cost model, and records when every request arrived, was admitted, and emitted each token. Every public name this
module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.baselines import NoChunkScheduler, PrefillFirstScheduler
from stallfree.sim.run.config import (
    BATCHING_MODES,
    ReplicaConfig,
    async_of,
    legacy_scheduler_config,
    make_scheduler,
    warn_deprecated,
    wrap_checker,
)
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, PassGate, Router
from stallfree.sim.run.replica import Replica, SimClock
from stallfree.sim.run.result import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    SchedulerLike,
    SimResult,
    SimulationError,
    verify_tokens,
)
from stallfree.sim.run.session_run import SessionArrivals, SessionEntry, close_sessions, run_sessions
from stallfree.sim.run.simulator import (
    context_overflows,
    new_result,
    plan_run,
    request_maker,
    run_group,
    saturated_throughput,
    simulate,
    tier_figures,
)

__all__ = [
    "Arrivals",
    "BATCHING_MODES",
    "CONTEXT_LENGTH",
    "ClosedLoop",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_SEQS",
    "DEFAULT_TOKEN_BUDGET",
    "Entry",
    "EventLoop",
    "KV_CAPACITY",
    "NoChunkScheduler",
    "PassGate",
    "PrefillFirstScheduler",
    "Replica",
    "ReplicaConfig",
    "Router",
    "SchedulerLike",
    "SessionArrivals",
    "SessionEntry",
    "SessionWorkload",
    "SimClock",
    "SimResult",
    "SimulationError",
    "StepCostModel",
    "Workload",
    "async_of",
    "close_sessions",
    "context_overflows",
    "legacy_scheduler_config",
    "make_scheduler",
    "new_result",
    "plan_run",
    "request_maker",
    "run_group",
    "run_sessions",
    "saturated_throughput",
    "simulate",
    "tier_figures",
    "verify_tokens",
    "warn_deprecated",
    "wrap_checker",
]
