"""What the core's own KV managers share: their figures read off one BlockPool, written once.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import RequestRejected
from stallfree.core.kv.pool import BlockPool, CachingBlockPool, PrefixCacheView
from stallfree.core.kv.protocol import NO_TRANSFERS, PrefixCacheStats, Transfers
from stallfree.core.request import Request

__all__ = ["PooledKV", "reject_hashes"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PooledKV:
    """The figures of a KV manager over one BlockPool (ReservationKV, PagedKV, TieredKV): counts in the
    pool's units (blocks of block_size tokens, or single tokens), the prefix cache's when `cache` is set.

    A subclass sets `pool`, `kv_total`, `has_block_ids` and `prefix_stats` in its constructor, and
    `cache` (the same pool) when it caches prefixes.
    """

    pool: BlockPool
    #: The pool again when it caches prefixes (a CachingBlockPool), else None.
    cache: CachingBlockPool | None = None
    #: KV capacity in tokens.
    kv_total: int
    #: Whether block ids are kept.
    has_block_ids: bool
    #: Prefix caching's counters (zeros without caching).
    prefix_stats: PrefixCacheStats

    @property
    def kv_free(self) -> int:
        """Free KV in tokens: free blocks (or reservation units) x tokens each."""
        return self.pool.num_free * self.pool.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks free (evictable cached blocks included), or free reservation units."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held or promised (evictable cached blocks are not held), or reserved units."""
        return self.pool.num_used

    @property
    def num_evictable_blocks(self) -> int:
        """Prefix caching: cached blocks held by no request (counted in num_free_blocks); else 0."""
        return self.cache.num_evictable if self.cache is not None else 0

    @property
    def num_evictions(self) -> int:
        """Prefix caching: cached blocks evicted (handed out again) so far; else 0."""
        return self.cache.num_evictions if self.cache is not None else 0

    def free_block_ids(self) -> tuple[int, ...]:
        """The ids in no table (the unclaimed parts of reservations, and evictable cached blocks last)."""
        return self.pool.free_ids()

    def cache_view(self) -> PrefixCacheView | None:
        """A read-only view of the prefix cache; None without caching."""
        return PrefixCacheView(self.cache) if self.cache is not None else None

    def step_transfers(self) -> Transfers:
        """NO_TRANSFERS: one tier, nothing is copied (TieredKV hands over its copies)."""
        return NO_TRANSFERS


def reject_hashes(req: Request, policy: str) -> None:
    """Raise RequestRejected for a request with block_hashes at a manager without prefix caching."""
    raise RequestRejected(
        f"request {req.rid!r} has block_hashes, which only a scheduler with "
        f"enable_prefix_caching=True (and kv_policy='paged') uses; this one has "
        f"kv_policy={policy!r}, enable_prefix_caching=False"
    )
