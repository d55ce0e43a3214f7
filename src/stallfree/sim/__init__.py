"""The trace-driven simulator: workloads, the event loop, baselines, reports and sweeps.

Imports allowed: the standard library, stallfree.core and stallfree.costmodel; numpy, matplotlib
and rich only lazily, inside report and plot functions.
"""

from stallfree.sim.baselines import NoChunkScheduler, PrefillFirstScheduler
from stallfree.sim.costs import LinearCostModel, StepCostModel
from stallfree.sim.simulator import (
    BATCHING_MODES,
    ReplicaConfig,
    SchedulerLike,
    SimResult,
    SimulationError,
    simulate,
)
from stallfree.sim.workload import (
    LengthSpec,
    TraceError,
    Workload,
    load_bundled,
    load_trace,
    parse_length_spec,
    synthetic,
)

__all__ = [
    "BATCHING_MODES",
    "LengthSpec",
    "LinearCostModel",
    "NoChunkScheduler",
    "PrefillFirstScheduler",
    "ReplicaConfig",
    "SchedulerLike",
    "SimResult",
    "SimulationError",
    "StepCostModel",
    "TraceError",
    "Workload",
    "load_bundled",
    "load_trace",
    "parse_length_spec",
    "simulate",
    "synthetic",
]


def __getattr__(name: str) -> object:
    """`stallfree.sim.SchedulerConfig`, the former name of the replica record: a function with its old
    arguments that returns a ReplicaConfig (legacy_scheduler_config), warning once. Removed in the next
    release; the core's configuration is stallfree.SchedulerConfig."""
    if name == "SchedulerConfig":
        from stallfree.sim.simulator import legacy_scheduler_config, warn_deprecated

        warn_deprecated("stallfree.sim.SchedulerConfig",
                        "stallfree.sim.ReplicaConfig (holding a stallfree.SchedulerConfig)")
        return legacy_scheduler_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
