"""Former path of `stallfree.sim.studies.ranges`, kept for one release: import from the new path.

How sure a latency figure is: the range of each latency of a run, from a stated error model of the step time
replayed through the same scheduler. Every public name this module had is re-exported from where it lives now; the
module goes in the next release.
"""

from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.studies.ranges import RANGE_KEYS, STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, error_model, run_range

__all__ = [
    "RANGE_KEYS",
    "STEP_TIME_HIGH",
    "STEP_TIME_LOW",
    "ScaledCost",
    "StepCostModel",
    "error_model",
    "run_range",
]
