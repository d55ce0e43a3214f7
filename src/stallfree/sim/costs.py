"""Former path of `stallfree.sim.run.costs`, kept for one release: import from the new path.

The seam between the simulator and a cost model: anything that prices a StepPlan in seconds. Every public name this
module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.run.costs import LinearCostModel, StepCostModel

__all__ = [
    "LinearCostModel",
    "StepCostModel",
]
