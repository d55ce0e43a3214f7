"""A second KV tier: prefix-cache blocks the GPU evicts are kept in CPU (host) memory and loaded back
on a hit, instead of being recomputed. A KV manager on the core's seam (core/kv/protocol.py, KVManager).

Imports allowed: the standard library and stallfree.core only.

The tiers are exclusive: a cached prompt block is in the GPU pool or in the CPU tier, never both.

- Offload: when the GPU hands out an evictable cached block (LRU, tail first, as CachingBlockPool
  does), its hash moves to the CPU tier, which takes a free CPU block or, when full, drops its own
  least recently stored block and reuses it. The copy GPU -> CPU is in the step's plan
  (StepPlan.kv_offloads) because the step overwrites the GPU block.
- Lookup: a request's longest cached prefix runs across both tiers, block by block (a block is
  a hit in whichever tier holds its hash).
- Load: admitting a request with CPU-tier hits takes those hashes out of the CPU tier, gives each a
  fresh GPU block (counted at admission like the blocks of its first chunk), caches it there at
  once, and lists the copy CPU -> GPU in the step's plan (StepPlan.kv_loads), so it is done before
  the request's first chunk runs. A CPU block read by a load is not reused before the next step, so
  an engine that performs the offloads, then the loads, then the forward pass, step after step, never
  reads a block that was overwritten.
- Every eviction of the step happens inside schedule(): blocks promised to decodes are free-and-empty
  ones, evicted for when promised (CachingBlockPool.try_promise; `step_transfers` settles again, a
  guard); so no offload is missed.

Source: vLLM's KV offloading connector (`--kv-offloading-size`, CPU blocks with LRU) and SGLang's
hierarchical radix cache (host-memory tier for evicted prefix blocks) describe the same design; the
exclusive-tier LRU here is this project's own, written from those descriptions, not their code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import SchedulerStateError, check_positive_int
from stallfree.core.kv.paged import PagedKV
from stallfree.core.kv.pool import CachingBlockPool
from stallfree.core.kv.protocol import NO_HIT, Transfers
from stallfree.core.request import Request

if TYPE_CHECKING:
    from stallfree.core.live import LiveRequest

__all__ = ["CpuTier", "CpuTierView", "TierStats", "TieredBlockPool", "TieredKV"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class CpuTier:
    """The CPU tier: `num_blocks` KV blocks in host memory, each holding one cached prompt block by hash.

    LRU by store order (a hit leaves the tier, so recency is the order of storing). A block read by a
    load in this step is busy until `end_step`, so a store of the same step cannot overwrite it.

    Args:
        num_blocks: CPU blocks, >= 1.

    Raises:
        InvalidConfig: num_blocks is not an integer >= 1; the message names it.
    """

    __slots__ = ("num_blocks", "_lru", "_free", "_fresh", "_busy", "num_stores", "num_loads", "num_drops")

    def __init__(self, num_blocks: object) -> None:
        self.num_blocks = check_positive_int("cpu_blocks", num_blocks)
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # hash -> CPU block, least recent first
        self._free: list[int] = []
        self._fresh = 0  # CPU ids >= _fresh were never used
        self._busy: list[int] = []  # read by a load of the step being planned
        #: Blocks stored (offloaded from the GPU), loaded back, and dropped (LRU, tier full), so far.
        self.num_stores = 0
        self.num_loads = 0
        self.num_drops = 0

    @property
    def num_cached(self) -> int:
        """CPU blocks holding a hash."""
        return len(self._lru)

    @property
    def num_free(self) -> int:
        """CPU blocks holding nothing and not busy."""
        return self.num_blocks - len(self._lru) - len(self._busy)

    def __contains__(self, block_hash: object) -> bool:
        """Whether the tier holds `block_hash`."""
        return block_hash in self._lru

    def get(self, block_hash: Hashable) -> int | None:
        """The CPU block holding `block_hash`, or None."""
        return self._lru.get(block_hash)

    def store(self, block_hash: Hashable) -> int | None:
        """Keep `block_hash` in a CPU block and return its id: a free block, else the least recently
        stored one (its hash dropped); None when every block is busy (the hash is dropped)."""
        if self._free:
            c = self._free.pop()
        elif self._fresh < self.num_blocks:
            c = self._fresh
            self._fresh += 1
        elif self._lru:
            c = self._lru.popitem(last=False)[1]
            self.num_drops += 1
        else:
            self.num_drops += 1
            return None
        self._lru[block_hash] = c
        self.num_stores += 1
        return c

    def take(self, block_hash: Hashable) -> int:
        """Take `block_hash` out of the tier for a load and return its CPU block (busy until end_step).

        Raises:
            SchedulerStateError: the hash is not in the tier; nothing changes.
        """
        c = self._lru.pop(block_hash, None)
        if c is None:
            raise SchedulerStateError(f"load of hash {block_hash!r}, which the CPU tier does not hold")
        self._busy.append(c)
        self.num_loads += 1
        return c

    def discard(self, block_hash: Hashable) -> None:
        """Drop `block_hash` if held (the GPU computed the same block again); its CPU block is free."""
        c = self._lru.pop(block_hash, None)
        if c is not None:
            self._free.append(c)

    def end_step(self) -> None:
        """The step's loads are planned: their CPU blocks may be reused from the next step on."""
        if self._busy:
            self._free.extend(self._busy)
            self._busy.clear()


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class CpuTierView:
    """A read-only view of a CpuTier, for checkers and tests; reads go to the live tier.

    Args:
        tier: the tier viewed.
    """

    __slots__ = ("_tier",)

    def __init__(self, tier: CpuTier) -> None:
        self._tier = tier

    @property
    def block_of(self) -> Mapping[Hashable, int]:
        """Hash -> the CPU block holding it, least recently stored first."""
        return MappingProxyType(self._tier._lru)

    @property
    def num_blocks(self) -> int:
        """CPU blocks in the tier."""
        return self._tier.num_blocks

    @property
    def num_cached(self) -> int:
        """CPU blocks holding a hash."""
        return self._tier.num_cached

    @property
    def num_free(self) -> int:
        """CPU blocks holding nothing and not busy."""
        return self._tier.num_free

    def free_ids(self) -> tuple[int, ...]:
        """CPU blocks holding nothing (busy ones included): O(num_blocks)."""
        t = self._tier
        return tuple(t._free) + tuple(t._busy) + tuple(range(t._fresh, t.num_blocks))


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class TierStats:
    """Hit tokens per tier, and block copies, of a TieredKV.

    Attributes:
        gpu_hits, cpu_hits: tokens found cached in each tier at admissions (they sum to the
            scheduler's prefix_cache_hits).
        first_gpu_hits, first_cpu_hits: the same at first admissions only.
    """

    __slots__ = ("gpu_hits", "cpu_hits", "first_gpu_hits", "first_cpu_hits")

    def __init__(self) -> None:
        self.gpu_hits = 0
        self.cpu_hits = 0
        self.first_gpu_hits = 0
        self.first_cpu_hits = 0

    def count(self, rec: LiveRequest, gpu_tokens: int, cpu_tokens: int) -> None:
        """Count an admission of `rec` (before its admitted_step is set) with these hits per tier."""
        self.gpu_hits += gpu_tokens
        self.cpu_hits += cpu_tokens
        if rec.admitted_step is None:
            self.first_gpu_hits += gpu_tokens
            self.first_cpu_hits += cpu_tokens


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class TieredBlockPool(CachingBlockPool):
    """A CachingBlockPool whose evicted cached blocks move to a CpuTier, recording each copy; it acts
    through the pool's public members only (its `on_evict` hook, overridden here, `settle_promised`,
    `cached_block`).

    Args:
        num_blocks: GPU KV blocks, >= 1.
        block_size: tokens per block, >= 1.
        tier: the CPU tier evicted blocks go to.

    Raises:
        InvalidConfig: num_blocks or block_size is not an integer >= 1; the message names it.
    """

    __slots__ = ("tier", "offloads")

    def __init__(self, num_blocks: object, block_size: object, tier: CpuTier) -> None:
        super().__init__(num_blocks, block_size)
        self.tier = tier
        #: (gpu_block, cpu_block) copies of the step being planned, in order.
        self.offloads: list[tuple[int, int]] = []

    def on_evict(self, block: int, block_hash: Hashable) -> None:
        """An evicted cached block moves to the CPU tier; its copy is recorded for the step's plan."""
        c = self.tier.store(block_hash)
        if c is not None:
            self.offloads.append((block, c))

    def settle(self) -> None:
        """Make the promised blocks free-and-empty ones (evicting to the CPU tier), so that claiming
        them later evicts nothing."""
        self.settle_promised()

    def register(self, table: Sequence[int], hashes: Sequence[Hashable], first: int, last: int) -> None:
        """CachingBlockPool.register; a hash the GPU now caches leaves the CPU tier (tiers are exclusive)."""
        super().register(table, hashes, first, last)
        tier = self.tier
        if tier.num_cached:
            for i in range(first, last):
                h = hashes[i]
                if h in tier and self.cached_block(h) == table[i]:
                    tier.discard(h)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class TieredKV(PagedKV):
    """Paged KV with prefix caching and a CPU tier of `cpu_blocks` blocks (module docstring).

    Use it as Scheduler(kv_manager=...) with kv_policy="paged", enable_prefix_caching=True and the
    same block_size and kv_tokens (Scheduler builds one for a config with cpu_kv_tokens). Everything
    PagedKV answers is about the GPU pool; the CPU tier adds hits (lookup, cached_prefix_len, can_admit
    and admit count a CPU hit as a GPU block to allocate) and each step's copies (step_transfers, which
    the scheduler puts in StepPlan.kv_offloads and kv_loads).

    The lookup handle lists, per hit block in token order, its GPU block id (>= 0) or ~cpu_block (< 0).

    Args:
        num_blocks: GPU KV blocks, >= 1.
        block_size: tokens per block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.
        cpu_blocks: CPU-tier blocks, >= 1 (of block_size tokens each).

    Raises:
        InvalidConfig: an argument is out of range; the message names it and the value.
    """

    def __init__(self, num_blocks: object, block_size: object, watermark: object, cpu_blocks: object) -> None:
        super().__init__(num_blocks, block_size, watermark, True)
        self.tier = CpuTier(cpu_blocks)
        self.cache = TieredBlockPool(num_blocks, block_size, self.tier)
        self.pool = self.cache
        self.tier_stats = TierStats()
        self._loads: list[tuple[int, int]] = []

    @property
    def cpu_blocks(self) -> int:
        """Blocks in the CPU tier."""
        return self.tier.num_blocks

    def tier_view(self) -> CpuTierView:
        """A read-only view of the CPU tier."""
        return CpuTierView(self.tier)

    def _hits(self, hashes: Sequence[Hashable], max_blocks: int) -> list[int]:
        assert self.cache is not None
        gpu = self.cache.cached_block
        cpu = self.tier._lru
        out: list[int] = []
        for i in range(min(max_blocks, len(hashes))):
            h = hashes[i]
            b = gpu(h)
            if b is None:
                c = cpu.get(h)
                if c is None:
                    break
                b = ~c
            out.append(b)
        return out

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of `req`'s prompt cached now in either tier, capped as `lookup` caps a hit; a pure query."""
        hashes = req.block_hashes
        if not hashes:
            return 0
        bs = self.block_size
        return len(self._hits(hashes, (req.prompt_len - 1) // bs)) * bs

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """(tokens, handle) of `rec`'s longest prefix cached across both tiers, capped at prompt_len - 1
        tokens; the handle holds a GPU block id or ~cpu_block per hit block. Changes nothing."""
        hashes = rec.req.block_hashes
        if not hashes:
            return NO_HIT
        hits = self._hits(hashes, (rec.num_prompt_tokens - 1) // self.block_size)
        return len(hits) * self.block_size, hits

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int] = ()) -> bool:
        """PagedKV.can_admit, a CPU-tier hit counting as one more GPU block to allocate (its load's)."""
        if not hits or min(hits) >= 0:
            return super().can_admit(rec, first_chunk, num_running, hits)
        assert self.cache is not None
        bs = self.block_size
        gpu = [b for b in hits if b >= 0]
        h = len(hits)
        want = -(-rec.target // bs) if rec.num_preemptions else -(-(h * bs + first_chunk) // bs)
        want += self.cache.num_evictable_among(gpu) - len(gpu)
        free = self.pool.num_free
        return want <= free and not (num_running and free - want < self.watermark_blocks)

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int] = ()) -> None:
        """Give `rec` its GPU hits (pinned), a GPU block per CPU-tier hit (cached there now, its load
        recorded for this step's plan) and the blocks of its first chunk; count the hits per tier."""
        bs = self.block_size
        h = len(hits)
        if not hits or min(hits) >= 0:
            super().admit(rec, first_chunk, hits)
            self.tier_stats.count(rec, h * bs, 0)
            return
        cache = self.cache
        assert cache is not None
        hashes = rec.req.block_hashes
        assert hashes is not None
        gpu = [b for b in hits if b >= 0]
        got: list[int] = []
        cache.pin(got, gpu)  # pinned first: allocating the loads' blocks cannot evict them
        cpu_hashes = [hashes[i] for i, b in enumerate(hits) if b < 0]
        src = [self.tier.take(x) for x in cpu_hashes]  # out of the tier before any offload can drop them
        dst: list[int] = []
        cache.allocate(dst, len(src))
        cache.register(dst, cpu_hashes, 0, len(dst))  # cached at once, held by this table (reference count 1)
        self._loads.extend(zip(src, dst, strict=True))
        table = rec.block_table
        gi = iter(got)
        di = iter(dst)
        table.extend([next(gi) if b >= 0 else next(di) for b in hits])
        cache.allocate(table, -(-(h * bs + first_chunk) // bs) - h)
        self.prefix_stats.count(rec, h * bs)
        self.tier_stats.count(rec, len(gpu) * bs, len(src) * bs)

    def step_transfers(self) -> Transfers:
        """End of schedule(): evict for the blocks promised to decodes now, then hand over the step's
        copies, (offloads as (gpu_block, cpu_block), loads as (cpu_block, gpu_block)), and clear them."""
        pool = self.cache
        assert isinstance(pool, TieredBlockPool)
        pool.settle()
        if not pool.offloads and not self._loads:
            return (), ()
        out = tuple(pool.offloads), tuple(self._loads)
        pool.offloads.clear()
        self._loads.clear()
        self.tier.end_step()
        return out
