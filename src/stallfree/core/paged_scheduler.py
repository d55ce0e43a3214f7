"""PagedScheduler: Scheduler(kv_policy="paged") built from a block count.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from typing import Any

from stallfree.core.errors import check_positive_int
from stallfree.core.scheduler import Scheduler

__all__ = ["PagedScheduler"]


class PagedScheduler(Scheduler):
    """Scheduler(kv_policy="paged") built from a block count: the constructor kept from before the
    KV policy became an option of Scheduler; same class, same behaviour.

    Args:
        token_budget: the most tokens in one step, >= 1.
        max_seqs: the most running requests, >= 1.
        num_blocks: KV blocks in the cache, >= 1 (kv_tokens = num_blocks x block_size).
        block_size: tokens per KV block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.
        **options: any other SchedulerConfig field (policy=, num_spec_tokens=, align_chunks=, ...), or
            kv_manager=.

    Raises:
        InvalidConfig: an argument is out of range or of the wrong type; the message names it.
    """

    def __init__(
        self,
        token_budget: int,
        max_seqs: int,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        **options: Any,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        super().__init__(
            token_budget, max_seqs, num_blocks * block_size, kv_policy="paged", block_size=block_size,
            watermark=watermark, **options,
        )
