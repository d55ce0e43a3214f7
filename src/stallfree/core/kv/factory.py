"""Which KV manager a SchedulerConfig names: the one place that builds one (Scheduler calls it unless given
a manager). It sits above the managers it chooses between.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from typing import Protocol

from stallfree.core.kv.paged import PagedKV
from stallfree.core.kv.reservation import ReservationKV
from stallfree.core.kv.tier import TieredKV

__all__ = ["KVOptions", "build_kv_manager", "kv_manager_for"]


def build_kv_manager(
    kv_policy: str, kv_tokens: int, block_size: int | None, watermark: float, enable_prefix_caching: bool
) -> ReservationKV | PagedKV:
    """Build the KV manager that Scheduler(kv_policy=...) uses (its arguments already validated).

    Args:
        kv_policy: "reserve" or "paged".
        kv_tokens: KV capacity in tokens; "paged" gets kv_tokens // block_size blocks.
        block_size: tokens per block (required under "paged"), or None.
        watermark: "paged": the fraction of blocks kept free at admission.
        enable_prefix_caching: "paged": keep computed prompt blocks for reuse.
    """
    if kv_policy == "paged":
        assert block_size is not None
        return PagedKV(kv_tokens // block_size, block_size, watermark, enable_prefix_caching)
    return ReservationKV(kv_tokens, block_size)


class KVOptions(Protocol):
    """The KV fields of a SchedulerConfig (core/config.py), as kv_manager_for reads them."""

    @property
    def kv_policy(self) -> str: ...
    @property
    def kv_tokens(self) -> int: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def watermark(self) -> float: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def cpu_blocks(self) -> int: ...


def kv_manager_for(config: KVOptions) -> ReservationKV | PagedKV:
    """The KV manager a SchedulerConfig names (Scheduler builds it unless given one): ReservationKV for
    kv_policy="reserve", PagedKV (with prefix caching when enabled) for "paged", and a TieredKV
    (stallfree.core.kv_tier) of config.cpu_blocks CPU blocks when the config has a CPU KV tier.

    Args:
        config: a validated SchedulerConfig (kv_policy, kv_tokens, block_size, watermark,
            enable_prefix_caching and cpu_blocks are read).
    """
    if config.cpu_blocks:
        assert config.block_size is not None
        return TieredKV(config.kv_tokens // config.block_size, config.block_size, config.watermark, config.cpu_blocks)
    return build_kv_manager(
        config.kv_policy, config.kv_tokens, config.block_size, config.watermark, config.enable_prefix_caching)
