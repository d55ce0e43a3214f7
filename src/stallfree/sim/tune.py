"""Former path of `stallfree.sim.studies.tune`, kept for one release: import from the new path.

SLO-driven tuning: the token budget and max_seqs that maximise goodput on a workload under a TTFT and a TPOT
objective, bounded by the cost model (stallfree.sim.tune_bound) and then searched by simulation. Every public name
this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_MAX_SEQS
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.studies.executors import Executor
from stallfree.sim.studies.sweep import SweepPoint, run_points
from stallfree.sim.studies.tune import (
    DEFAULT_TIE_TOLERANCE,
    ROW_KEYS,
    TuneResult,
    attainment_over_all,
    check_partial_prefill_flags,
    chosen_range,
    partial_prefill_candidates,
    partial_prefill_options,
    rank,
    tune,
)
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
from stallfree.sim.studies.tune_report import best_by_kind, serve_command, tune_report

__all__ = [
    "BudgetBound",
    "DEFAULT_MAX_SEQS",
    "DEFAULT_TIE_TOLERANCE",
    "Executor",
    "LADDER_EXPONENTS",
    "MAX_CANDIDATE_BUDGET",
    "ROW_KEYS",
    "ReplicaConfig",
    "StepCostModel",
    "SweepPoint",
    "TargetBelowFloor",
    "TuneResult",
    "Workload",
    "attainment_over_all",
    "best_by_kind",
    "budget_bound",
    "candidate_budgets",
    "check_partial_prefill_flags",
    "chosen_range",
    "expected_load",
    "nice_budget",
    "partial_prefill_candidates",
    "partial_prefill_options",
    "rank",
    "run_points",
    "serve_command",
    "tune",
    "tune_report",
]
