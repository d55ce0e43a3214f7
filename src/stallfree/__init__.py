"""stallfree: a continuous batching scheduler for LLM inference with a token budget and chunked prefill.

The public names of the core are re-exported here; the cost model, simulator, engine and server live in
their own subpackages (stallfree.costmodel, stallfree.sim, stallfree.engine, stallfree.server).

The re-exports are resolved on first use (PEP 562), so that `import stallfree` and a command's --help do
not pay for the whole core: `from stallfree import Scheduler` and `stallfree.Scheduler` work as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.core import (
        FinishReason,
        InvalidConfig,
        PagedScheduler,
        Request,
        RequestRejected,
        RequestState,
        RequestStatus,
        ScheduledChunk,
        Scheduler,
        SchedulerConfig,
        SchedulerError,
        SchedulerStateError,
        StallfreeError,
        StepPlan,
        hash_blocks,
    )

__version__ = "0.1.0"

__all__ = [
    "FinishReason",
    "InvalidConfig",
    "PagedScheduler",
    "Request",
    "RequestRejected",
    "RequestState",
    "RequestStatus",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStateError",
    "StallfreeError",
    "StepPlan",
    "__version__",
    "hash_blocks",
]


def __getattr__(name: str) -> object:
    """A core name of __all__, imported from stallfree.core on first use and kept."""
    if name in __all__ and name != "__version__":
        import stallfree.core

        value = getattr(stallfree.core, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
