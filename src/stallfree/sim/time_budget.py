"""Former path of `stallfree.sim.run.time_budget`, kept for one release: import from the new path.

Time budget mode: each step's token budget is the most tokens whose predicted step time stays under a target, worked
out by the cost model from the running decodes before every schedule(). Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_MAX_SEQS
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.time_budget import PlanPricer, TimeBudgetConfig, TimeBudgetModel, TimeBudgetScheduler, time_model

__all__ = [
    "DEFAULT_MAX_SEQS",
    "PlanPricer",
    "StepCostModel",
    "TimeBudgetConfig",
    "TimeBudgetModel",
    "TimeBudgetScheduler",
    "time_model",
]
