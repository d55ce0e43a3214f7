"""Former path of `stallfree.sim.run.load`, kept for one release: import from the new path.

The load a simulation offers: open-loop arrivals read from the workload, or closed-loop clients that keep a fixed
number of requests in flight. Every public name this module had is re-exported from where it lives now; the module
goes in the next release.
"""

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.load import Arrivals, ClosedLoop

__all__ = [
    "Arrivals",
    "ClosedLoop",
    "Workload",
]
