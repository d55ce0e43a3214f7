"""Former path of `stallfree.sim.studies.tune_bound`, kept for one release: import from the new path.

The cost model's bound of SLO-driven tuning: the token budget whose full step stays within a TPOT target at a
workload's expected load, and the ladder of candidate budgets around it. Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.time_budget import TimeBudgetModel, time_model
from stallfree.sim.studies.tune_bound import (
    LADDER_EXPONENTS,
    MAX_CANDIDATE_BUDGET,
    BudgetBound,
    TargetBelowFloor,
    budget_bound,
    candidate_budgets,
    expected_load,
    nice_budget,
)

__all__ = [
    "BudgetBound",
    "LADDER_EXPONENTS",
    "MAX_CANDIDATE_BUDGET",
    "StepCostModel",
    "TargetBelowFloor",
    "TimeBudgetModel",
    "Workload",
    "budget_bound",
    "candidate_budgets",
    "expected_load",
    "nice_budget",
    "time_model",
]
