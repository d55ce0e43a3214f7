"""Former path of `stallfree.sim.run.session_run`, kept for one release: import from the new path.

The session run: the event loop (stallfree.sim.loop) over a SessionWorkload, each turn sent its think or tool time
after its predecessor's last token, and the session figures of the report. Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.run.load import Arrivals
from stallfree.sim.run.loop import Entry, EventLoop, Router, route_to
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import SimResult
from stallfree.sim.run.session_run import (
    SESSION_ENDED,
    SessionArrivals,
    SessionEntry,
    SessionGate,
    close_sessions,
    run_sessions,
    session_summary,
)

__all__ = [
    "Arrivals",
    "Entry",
    "EventLoop",
    "Replica",
    "Router",
    "SESSION_ENDED",
    "SessionArrivals",
    "SessionEntry",
    "SessionGate",
    "SessionWorkload",
    "SimResult",
    "close_sessions",
    "route_to",
    "run_sessions",
    "session_summary",
]
