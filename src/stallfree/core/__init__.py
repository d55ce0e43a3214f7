"""The scheduler core: requests in, step plans out. Standard library only.

Imports allowed: the standard library only; nothing else from stallfree.
"""

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
