"""Former path of `stallfree.sim.run.loop`, kept for one release: import from the new path.

The simulator's one event loop: replicas on one simulated clock, driven by a heap of events keyed by (time, kind,
sequence), with pluggable parts for what differs between a single replica, a cluster and disaggregated prefill and
decode. Every public name this module had is re-exported from where it lives now; the module goes in the next
release.
"""

from stallfree.sim.run.load import Arrivals
from stallfree.sim.run.loop import (
    CALLBACK,
    STEP_END,
    AdmissionGate,
    Entry,
    EventLoop,
    FinishHook,
    PassGate,
    Router,
    admit_async,
    route_to,
)
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import ClusterError, SimulationError

__all__ = [
    "AdmissionGate",
    "Arrivals",
    "CALLBACK",
    "ClusterError",
    "Entry",
    "EventLoop",
    "FinishHook",
    "PassGate",
    "Replica",
    "Router",
    "STEP_END",
    "SimulationError",
    "admit_async",
    "route_to",
]
