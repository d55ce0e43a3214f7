"""Former path of `stallfree.sim.inputs.sessions`, kept for one release: import from the new path.

Sessions: multi-turn conversations and agents, each turn sent its think or tool time after the previous turn's last
token, its prompt the whole conversation so far plus its own new input. Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.session_traces import is_session_trace, load_sessions, looks_like_sessions
from stallfree.sim.inputs.sessions import (
    MAX_THINK_S,
    MAX_TURNS,
    SessionWorkload,
    ThinkSpec,
    dump_turn,
    parse_system_prompt,
    parse_think_spec,
    synthetic_sessions,
)
from stallfree.sim.inputs.synthetic import MAX_LENGTH, LengthSpec
from stallfree.sim.inputs.workload import MAX_ARRIVAL_S, MAX_ARRIVAL_SPAN_S, TraceError, TraceFileError, Workload

__all__ = [
    "LengthSpec",
    "MAX_ARRIVAL_S",
    "MAX_ARRIVAL_SPAN_S",
    "MAX_LENGTH",
    "MAX_THINK_S",
    "MAX_TURNS",
    "SessionWorkload",
    "ThinkSpec",
    "TraceError",
    "TraceFileError",
    "Workload",
    "dump_turn",
    "is_session_trace",
    "load_sessions",
    "looks_like_sessions",
    "parse_system_prompt",
    "parse_think_spec",
    "synthetic_sessions",
]
