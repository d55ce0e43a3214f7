"""Former path of `stallfree.sim.studies.sweep`, kept for one release: import from the new path.

Sweeps: one simulation per (batching mode, rate scale, token budget), run in worker processes, as rows
(stallfree.sim.writers writes them as CSV, JSON and plots. Every public name this module had is re-exported from
where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.setup import Setup
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import latency_arrays, summarize_result
from stallfree.sim.run.config import BATCHING_MODES, ReplicaConfig
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.simulator import simulate
from stallfree.sim.studies.executors import Executor
from stallfree.sim.studies.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, error_model, run_range
from stallfree.sim.studies.sweep import ROW_KEYS, SweepPoint, SweepResult, run_points, sweep

__all__ = [
    "BATCHING_MODES",
    "Executor",
    "ROW_KEYS",
    "ReplicaConfig",
    "STEP_TIME_HIGH",
    "STEP_TIME_LOW",
    "ScaledCost",
    "Setup",
    "StepCostModel",
    "SweepPoint",
    "SweepResult",
    "Workload",
    "error_model",
    "latency_arrays",
    "run_points",
    "run_range",
    "simulate",
    "summarize_result",
    "sweep",
]
