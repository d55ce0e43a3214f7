"""Former path of `stallfree.sim.studies.split_bound`, kept for one release: import from the new path.

The capacity bound of disaggregated P:D splits: each side's saturated throughput, the fewest replicas each side
needs at the mean rate, and the splits of a replica count in the order plan tries them (stallfree.sim.capacity, step
4). Every public name this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.run.simulator import saturated_throughput
from stallfree.sim.studies.split_bound import SplitBound, split_bound, split_order

__all__ = [
    "SplitBound",
    "saturated_throughput",
    "split_bound",
    "split_order",
]
