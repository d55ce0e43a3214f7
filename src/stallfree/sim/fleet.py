"""Former path of `stallfree.sim.studies.fleet`, kept for one release: import from the new path.

The buying question: the cheapest fleet meeting the SLOs across GPU types, tensor parallelism and serving shapes
(aggregated replicas or a P:D split), in dollars per hour, or in GPUs without prices. Every public name this module
had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.run.simulator import saturated_throughput
from stallfree.sim.studies.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_ROUTERS,
    PlanResult,
    SplitBound,
    plan,
    split_bound,
    walk_mixed_split,
)
from stallfree.sim.studies.executors import Executor
from stallfree.sim.studies.experiment import scheduler_for
from stallfree.sim.studies.fleet import (
    BURST_WINDOW_S,
    FleetResult,
    Shape,
    ShapeOutcome,
    answer_record,
    busiest_window,
    explain_load,
    plan_fleet,
    row_cost,
    shape_records,
    shape_text,
)

__all__ = [
    "BURST_WINDOW_S",
    "DEFAULT_ATTAINMENT",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_ROUTERS",
    "DEFAULT_TOKEN_BUDGET",
    "Executor",
    "FleetResult",
    "PlanResult",
    "Shape",
    "ShapeOutcome",
    "SplitBound",
    "answer_record",
    "busiest_window",
    "explain_load",
    "plan",
    "plan_fleet",
    "row_cost",
    "saturated_throughput",
    "scheduler_for",
    "shape_records",
    "shape_text",
    "split_bound",
    "walk_mixed_split",
]
