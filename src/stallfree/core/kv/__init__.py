"""The KV side of the scheduler, by job: block pools (pool.py), the seam the scheduler asks through
(protocol.py), the two KV policies (reservation.py, paged.py) with their shared figures (pooled.py), the
CPU tier (tier.py), the option checks (options.py) and the one function that builds a manager from a
SchedulerConfig (factory.py). Every name is importable from stallfree.core.kv.

Imports allowed: the standard library and stallfree.core only.

Who calls whom (docs/DESIGN.md, architecture): Scheduler -> KVManager (ReservationKV, PagedKV, TieredKV)
-> BlockPool, as vLLM's scheduler asks its KVCacheManager, which asks its BlockPool.
"""

from stallfree.core.kv.factory import KVOptions, build_kv_manager, kv_manager_for
from stallfree.core.kv.options import KV_POLICIES, check_kv_options, check_watermark
from stallfree.core.kv.paged import PagedKV
from stallfree.core.kv.pool import BlockPool, CachingBlockPool, PrefixCacheView, blocks_for_tokens
from stallfree.core.kv.pooled import PooledKV
from stallfree.core.kv.protocol import NO_HIT, NO_TRANSFERS, KVFigures, KVManager, PrefixCacheStats, Transfers
from stallfree.core.kv.reservation import ReservationKV

__all__ = [
    "KV_POLICIES", "NO_HIT", "NO_TRANSFERS", "BlockPool", "CachingBlockPool", "KVFigures", "KVManager",
    "KVOptions", "PagedKV", "PooledKV", "PrefixCacheStats", "PrefixCacheView", "ReservationKV", "Transfers",
    "blocks_for_tokens", "build_kv_manager", "check_kv_options", "check_watermark", "kv_manager_for",
]
