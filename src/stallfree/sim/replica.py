"""Former path of `stallfree.sim.run.replica`, kept for one release: import from the new path.

One simulated replica: a scheduler, the SimResult rows it writes, and the per-request bookkeeping that turns its
steps into token times. Every public name this module had is re-exported from where it lives now; the module goes in
the next release.
"""

from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.replica import Replica, SimClock
from stallfree.sim.run.result import KV_CAPACITY, RequestState, SchedulerLike, SimResult, SimulationError

__all__ = [
    "KV_CAPACITY",
    "Replica",
    "RequestState",
    "SchedulerLike",
    "SimClock",
    "SimResult",
    "SimulationError",
    "StepCostModel",
]
