"""The trace-driven simulator: workloads, the event loop, baselines, reports and sweeps.

Imports allowed: the standard library, stallfree.core and stallfree.costmodel; numpy, matplotlib
and rich only lazily, inside report and plot functions.
"""

from stallfree.sim.baselines import NoChunkScheduler, PrefillFirstScheduler
from stallfree.sim.costs import LinearCostModel, StepCostModel
from stallfree.sim.simulator import (
    BATCHING_MODES,
    SchedulerConfig,
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
    "SchedulerConfig",
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
