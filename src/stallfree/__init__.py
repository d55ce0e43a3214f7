"""stallfree: a continuous batching scheduler for LLM inference with a token budget and chunked prefill.

The public names of the core are re-exported here; the cost model, simulator, engine and server live in
their own subpackages (stallfree.costmodel, stallfree.sim, stallfree.engine, stallfree.server).
"""

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
