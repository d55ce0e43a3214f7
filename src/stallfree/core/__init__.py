"""The scheduler core: requests in, step plans out. Standard library only.

Imports allowed: the standard library only; nothing else from stallfree.

The names below are resolved on first use (PEP 562): importing one core module (stallfree.core.config for
a --help's defaults) does not import every other; `from stallfree.core import Scheduler` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.core.config import SchedulerConfig
    from stallfree.core.errors import (
        InvalidConfig,
        RequestRejected,
        SchedulerError,
        SchedulerStateError,
        StallfreeError,
    )
    from stallfree.core.paged_scheduler import PagedScheduler
    from stallfree.core.plan import ScheduledChunk, StepPlan
    from stallfree.core.prefix_cache import hash_blocks
    from stallfree.core.queries import SchedulerHeadroom, SchedulerStats
    from stallfree.core.request import FinishReason, Request, RequestState, RequestStatus
    from stallfree.core.scheduler import Scheduler

# Each public name and the module it lives in.
_HOME = {
    "SchedulerConfig": "config",
    "InvalidConfig": "errors",
    "RequestRejected": "errors",
    "SchedulerError": "errors",
    "SchedulerStateError": "errors",
    "StallfreeError": "errors",
    "PagedScheduler": "paged_scheduler",
    "ScheduledChunk": "plan",
    "StepPlan": "plan",
    "hash_blocks": "prefix_cache",
    "SchedulerHeadroom": "queries",
    "SchedulerStats": "queries",
    "FinishReason": "request",
    "Request": "request",
    "RequestState": "request",
    "RequestStatus": "request",
    "Scheduler": "scheduler",
}

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
    "SchedulerHeadroom",
    "SchedulerStateError",
    "SchedulerStats",
    "StallfreeError",
    "StepPlan",
    "hash_blocks",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use and kept."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
