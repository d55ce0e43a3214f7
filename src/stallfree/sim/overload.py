"""Former path of `stallfree.sim.outputs.overload`, kept for one release: import from the new path.

Overload and bursts said out loud: whether a run was offered more than its replicas sustain (or its queue grew
through the run), the rate they sustain and the fix. Every public name this module had is re-exported from where it
lives now; the module goes in the next release.
"""

from stallfree.sim.outputs.overload import (
    BURST_MIN_STEPS,
    QUEUE_GROWTH_MIN_S,
    SATURATION_LOAD,
    Burst,
    annotate,
    burst_line,
    fluid_bursts,
    overload,
    overload_line,
    queue_grows,
    saturation,
    saturation_line,
    tail_burst,
)
from stallfree.sim.outputs.report import latency_arrays
from stallfree.sim.studies.ranges import STEP_TIME_HIGH

__all__ = [
    "BURST_MIN_STEPS",
    "Burst",
    "QUEUE_GROWTH_MIN_S",
    "SATURATION_LOAD",
    "STEP_TIME_HIGH",
    "annotate",
    "burst_line",
    "fluid_bursts",
    "latency_arrays",
    "overload",
    "overload_line",
    "queue_grows",
    "saturation",
    "saturation_line",
    "tail_burst",
]
