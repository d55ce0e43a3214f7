"""Former path of `stallfree.sim.run.result`, kept for one release: import from the new path.

What one simulation records and what it needs of a scheduler: SimResult, the SchedulerLike protocol, the request
states of the event loop, the kinds of rejection and SimulationError. Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.run.result import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    ClusterError,
    RequestState,
    SchedulerLike,
    SimResult,
    SimulationError,
    verify_tokens,
)

__all__ = [
    "CONTEXT_LENGTH",
    "ClusterError",
    "KV_CAPACITY",
    "RequestState",
    "SchedulerLike",
    "SimResult",
    "SimulationError",
    "verify_tokens",
]
