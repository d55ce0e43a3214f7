"""Former path of `stallfree.sim.studies.experiment`, kept for one release: import from the new path.

One simulation study, as `stallfree simulate` runs it: one batching mode (or all of them side by side) on a Setup,
each run summarized with its capacity and load (stallfree.sim.writers writes its files). Every public name this
module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.options import SetupError
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.setup import TIME_BUDGET_CAP, Setup
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.config import BATCHING_MODES
from stallfree.sim.run.result import SchedulerLike, SimResult
from stallfree.sim.run.simulator import saturated_throughput, simulate
from stallfree.sim.run.time_budget import TimeBudgetConfig
from stallfree.sim.studies.experiment import (
    Experiment,
    check_options,
    offered_rate,
    record_capacity,
    run_experiment,
    run_tag,
    scheduler_for,
    study_header,
)
from stallfree.sim.studies.ranges import ScaledCost

__all__ = [
    "BATCHING_MODES",
    "DEFAULT_TOKEN_BUDGET",
    "Experiment",
    "ScaledCost",
    "SchedulerLike",
    "SessionWorkload",
    "Setup",
    "SetupError",
    "SimResult",
    "TIME_BUDGET_CAP",
    "TimeBudgetConfig",
    "check_options",
    "offered_rate",
    "record_capacity",
    "run_experiment",
    "run_tag",
    "saturated_throughput",
    "scheduler_for",
    "simulate",
    "study_header",
    "summarize_result",
]
