"""KV block pools: which block ids are free, promised, held or cached. They never see tokens or requests.

Imports allowed: the standard library and stallfree.core only.

A KV block holds the keys and values of `block_size` consecutive tokens of one request; a request's
block table is the list of its block ids in token order (token t lives in table[t // block_size]).
Everything here deals in integers: the tensors live in the engine, which writes token t of a request
to slot table[t // block_size] * block_size + t % block_size. The KV managers (reservation.py,
paged.py, tier.py) own the tables and ask a pool for ids, as vLLM's KVCacheManager asks its BlockPool.

Source: paged KV cache with a per-request block table (PagedAttention / vLLM, Kwon et al., SOSP'23);
prefix caching with reference counts and an LRU of unheld cached blocks, as vLLM's block pool keeps it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import SchedulerStateError, check_positive_int

__all__ = ["BlockPool", "CachingBlockPool", "PrefixCacheView", "blocks_for_tokens"]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Return the KV blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size).

    Args:
        num_tokens: tokens, >= 0.
        block_size: tokens per block, >= 1.
    """
    return -(-num_tokens // block_size)



@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class BlockPool:
    """Owns the ids 0..num_blocks-1 of the KV blocks and which of them are free.

    It hands blocks out into block tables (plain lists of ids that the caller owns) and takes them
    back; it never sees tokens or requests. Blocks may also be *promised*: counted as used at once
    (O(1), however many) and given their ids later, when the owner materializes its table; this is
    how a step's decodes that cross a block boundary are served without touching each of them, and
    how the reservation policy counts its reservations. Freed blocks are reused first (a stack), so
    a workload that fits touches few distinct blocks; ids never handed out are not listed, so a pool
    of 10**15 blocks costs nothing until it is used.

    Args:
        num_blocks: KV blocks in the cache, >= 1.
        block_size: tokens per block, >= 1.

    Raises:
        InvalidConfig: num_blocks or block_size is not an integer >= 1; the message names it.
    """

    __slots__ = ("num_blocks", "block_size", "_free", "_fresh", "_promised")

    def __init__(self, num_blocks: object, block_size: object) -> None:
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        # Freed ids, a stack (its end is handed out first); ids >= _fresh were never handed out and
        # go out in increasing order after the stack, so block 0 goes first on a fresh pool.
        self._free: list[int] = []
        self._fresh = 0
        self._promised = 0

    @property
    def num_free(self) -> int:
        """Blocks neither in a block table nor promised."""
        return len(self._free) + self.num_blocks - self._fresh - self._promised

    @property
    def num_used(self) -> int:
        """Blocks in block tables or promised: num_blocks - num_free."""
        return self.num_blocks - self.num_free

    @property
    def num_promised(self) -> int:
        """Blocks counted as used whose ids have not been handed out yet."""
        return self._promised

    def free_ids(self) -> tuple[int, ...]:
        """The ids not in any block table (free or promised), last handed out first; O(num_blocks)."""
        return tuple(range(self.num_blocks - 1, self._fresh - 1, -1)) + tuple(self._free)

    def allocate(self, table: list[int], n: int) -> None:
        """Append `n` free blocks to `table`.

        Raises:
            SchedulerStateError: fewer than `n` blocks are free (the caller must check first);
                nothing changes.
        """
        if n > self.num_free:
            raise SchedulerStateError(f"allocate {n} KV blocks with only {self.num_free} free")
        self._take(table, n)

    def promise(self, n: int) -> None:
        """Count `n` free blocks as used now; their ids go out later through claim().

        Raises:
            SchedulerStateError: fewer than `n` blocks are free; nothing changes.
        """
        if n > self.num_free:
            raise SchedulerStateError(f"promise {n} KV blocks with only {self.num_free} free")
        self._promised += n

    def try_promise(self, n: int) -> bool:
        """Promise `n` blocks if that many are free and return True; else change nothing, return False."""
        if n > len(self._free) + self.num_blocks - self._fresh - self._promised:
            return False
        self._promised += n
        return True

    def claim(self, table: list[int], n: int) -> None:
        """Append `n` of the promised blocks to `table` (a promise is kept, so this cannot fail).

        Raises:
            SchedulerStateError: fewer than `n` blocks are promised (a caller's bookkeeping fault).
        """
        if n > self._promised:
            raise SchedulerStateError(f"claim {n} KV blocks with only {self._promised} promised")
        self._promised -= n
        self._take(table, n)

    def release(self, table: list[int], unclaimed: int = 0) -> None:
        """Return every block of `table`, and `unclaimed` promised blocks, to the pool; empty `table`."""
        self._free.extend(reversed(table))
        table.clear()
        self._promised -= unclaimed

    def unpromise(self, n: int) -> None:
        """Return `n` promised blocks that will never be claimed (a reservation that ended)."""
        self._promised -= n

    def release_tail(self, table: list[int], keep: int) -> None:
        """Return the blocks of `table` after its first `keep` to the pool."""
        if len(table) > keep:
            self._free.extend(reversed(table[keep:]))
            del table[keep:]

    def _take(self, table: list[int], n: int) -> None:
        if n <= 0:
            return
        free = self._free
        k = min(n, len(free))
        if k:
            got = free[-k:]
            del free[-k:]
            got.reverse()
            table.extend(got)
        if n > k:
            table.extend(range(self._fresh, self._fresh + n - k))
            self._fresh += n - k


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class CachingBlockPool(BlockPool):
    """A BlockPool that keeps computed prompt blocks for reuse across requests (prefix caching).

    Every block is in exactly one of three states:

    - free and empty: in the free stack or never handed out;
    - evictable: cached (it has a hash) and in no block table; it counts as free (`num_free`) and
      is handed out, evicted, only when no free-and-empty block is left: the least recently
      released first and, among blocks released together, the one farthest from the start of its
      prefix first (a table is released tail first), as vLLM's free-block queue does;
    - held: in one or more block tables. A cached held block has a reference count equal to the
      number of tables that hold it; an uncached one is in exactly one table.

    A block becomes cached by `register` (the scheduler calls it when the chunk that fills it
    completes). When a hash is already cached under another block (two requests filled the same
    prefix block in the same step, or a request computed a block that another one completed first),
    the block registered first stays the cached copy and the later one stays private to its table,
    going back to the free stack, empty, when that table is released.

    Costs: lookup is O(hit blocks + 1) dict reads, whatever the cache size; pin and register are
    O(blocks touched); a release is O(blocks that may be cached): told how many of a table's
    leading blocks can hold a hash (`hashed`: its prompt's full blocks), it frees the rest with one
    list operation, as a plain BlockPool does, so decode blocks and requests without block hashes
    cost no Python statement each. Nothing is allocated per free block, so a pool of a million
    blocks costs what an empty one does. The evictable set is an OrderedDict in eviction order:
    taking out a pinned block and evicting the oldest are O(1), with no scan.

    Args:
        num_blocks: KV blocks in the cache, >= 1.
        block_size: tokens per block, >= 1.

    Raises:
        InvalidConfig: num_blocks or block_size is not an integer >= 1; the message names it.
    """

    __slots__ = ("_cached", "_hash_of", "_refs", "_evictable", "num_evictions")

    def __init__(self, num_blocks: object, block_size: object) -> None:
        super().__init__(num_blocks, block_size)
        self._cached: dict[Hashable, int] = {}  # hash -> the cached block holding it
        self._hash_of: dict[int, Hashable] = {}  # cached block -> its hash
        self._refs: dict[int, int] = {}  # cached block -> number of tables holding it (0: evictable)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, LRU first
        #: Cached blocks handed out again (their content dropped) so far.
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks free and empty, plus evictable cached blocks, minus promised ones."""
        return len(self._free) + self.num_blocks - self._fresh - self._promised + len(self._evictable)

    @property
    def num_empty(self) -> int:
        """Blocks free and empty (in no table and not cached), promised ones included: what can be
        handed out without an eviction."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_evictable(self) -> int:
        """Cached blocks held by no table (counted in num_free)."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with a hash, held or evictable."""
        return len(self._hash_of)

    def promise(self, n: int) -> None:
        """Count `n` free blocks as used now, evicting at once the cached blocks they take (promised blocks
        are free-and-empty ones: `_take`); their ids go out later through claim().

        Raises:
            SchedulerStateError: fewer than `n` blocks are free; nothing changes.
        """
        if not self.try_promise(n):
            raise SchedulerStateError(f"promise {n} KV blocks with only {self.num_free} free")

    def try_promise(self, n: int) -> bool:
        """Promise `n` blocks if that many are free (evictable ones included) and return True; else
        change nothing and return False. The blocks promised are free-and-empty ones: when too few are
        left beside those already promised, evictable blocks are evicted now, least recently released
        first, as if their ids were handed out now. So when a table is read (and claims its ids)
        changes nothing else: no cached block outlives the step that needs its memory."""
        if n > len(self._free) + self.num_blocks - self._fresh - self._promised + len(self._evictable):
            return False
        self._promised += n
        self.settle_promised()
        return True

    def free_ids(self) -> tuple[int, ...]:
        """The ids in no block table: free-and-empty ones, then evictable ones; O(num_blocks)."""
        return super().free_ids() + tuple(self._evictable)

    def evictable_ids(self) -> tuple[int, ...]:
        """The evictable blocks, the next to be evicted first."""
        return tuple(self._evictable)

    def cached_block(self, block_hash: Hashable) -> int | None:
        """The block cached under `block_hash`, or None."""
        return self._cached.get(block_hash)

    def hash_of(self, block: int) -> Hashable | None:
        """The hash of a cached block, or None for an uncached one."""
        return self._hash_of.get(block)

    def ref_count(self, block: int) -> int:
        """Tables holding a cached block (0: evictable); -1 for an uncached block."""
        return self._refs.get(block, -1)

    def lookup(self, hashes: Sequence[Hashable], max_blocks: int) -> list[int]:
        """The cached blocks of the longest cached prefix of `hashes`, at most `max_blocks` of them;
        O(hits + 1) dict reads, however long the prompt or large the cache."""
        cached = self._cached
        out: list[int] = []
        for i in range(min(max_blocks, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (cached) are evictable: pinning them takes that many from num_free."""
        return list(map(self._refs.__getitem__, blocks)).count(0)

    def pin(self, table: list[int], blocks: Sequence[int]) -> None:
        """Append cached `blocks` to `table`, raising their reference counts (evictable ones leave the
        evictable set).

        Raises:
            SchedulerStateError: a block is not cached, or pinning would take more than num_free;
                nothing changes.
        """
        refs = self._refs
        if any(b not in refs for b in blocks):
            raise SchedulerStateError(f"pin blocks {list(blocks)}: not all are cached")
        if self.num_evictable_among(blocks) > self.num_free:
            raise SchedulerStateError(f"pin {len(blocks)} cached blocks with only {self.num_free} free")
        self._pin(table, blocks)

    def _pin(self, table: list[int], blocks: Sequence[int]) -> None:
        """pin() without its checks, for a caller that has just looked the blocks up and counted them."""
        refs = self._refs
        ev = self._evictable
        for b in blocks:
            r = refs[b]
            if not r:
                del ev[b]
            refs[b] = r + 1
        table.extend(blocks)

    def register(self, table: Sequence[int], hashes: Sequence[Hashable], first: int, last: int) -> None:
        """Cache blocks table[first:last] under hashes[first:last] (their content is now computed).

        A block already cached is left as it is; a hash already cached under another block leaves
        this block uncached (the first registered copy is the one kept).
        """
        cached = self._cached
        hash_of = self._hash_of
        refs = self._refs
        for i in range(first, last):
            b = table[i]
            h = hashes[i]
            if b in hash_of or h in cached:
                continue
            cached[h] = b
            hash_of[b] = h
            refs[b] = 1

    def release(self, table: list[int], unclaimed: int = 0, hashed: int | None = None) -> None:
        """Return `table`'s blocks, and `unclaimed` promised ones: cached blocks lose a reference
        (evictable at 0, tail first), others go back free; empty `table`.

        Args:
            table: the block table, emptied.
            unclaimed: promised blocks of this table never claimed.
            hashed: only table[:hashed] may hold cached blocks (the blocks of the prompt's block
                hashes); the rest go back free in one step. None: any block may be cached.
        """
        self._drop(table, 0, len(table) if hashed is None else hashed)
        self._promised -= unclaimed

    def release_tail(self, table: list[int], keep: int, hashed: int | None = None) -> None:
        """Return the blocks of `table` after its first `keep`, as release() does."""
        if len(table) > keep:
            self._drop(table, keep, len(table) if hashed is None else hashed)

    def _drop(self, table: list[int], keep: int, hashed: int) -> None:
        n = len(table)
        stop = min(n, max(keep, hashed))  # table[stop:] holds no cached block: freed in one step
        free = self._free
        if stop < n:
            tail = table[stop:]
            tail.reverse()
            free.extend(tail)
        refs = self._refs
        ev = self._evictable
        for i in range(stop - 1, keep - 1, -1):  # tail first: a prefix's end is evicted before its start
            b = table[i]
            r = refs.get(b)
            if r is None:
                free.append(b)
            elif r == 1:
                refs[b] = 0
                ev[b] = None
            else:
                refs[b] = r - 1
        del table[keep:]

    def settle_promised(self) -> None:
        """Make every promised block a free-and-empty one now, evicting as needed, so that claiming
        them later evicts nothing (a second KV tier learns each eviction inside schedule())."""
        extra = self._promised - self.num_empty
        if extra > 0:
            self._evict_into(self._free, extra)

    def _take(self, table: list[int], n: int) -> None:
        # Free-and-empty blocks not kept for promises (claim() counts its blocks out of _promised first).
        raw = len(self._free) + self.num_blocks - self._fresh - self._promised
        if n <= raw:
            BlockPool._take(self, table, n)
            return
        BlockPool._take(self, table, raw)
        self._evict_into(table, n - raw)

    def _evict_into(self, out: list[int], n: int) -> None:
        """Evict the `n` least recently released evictable blocks (on_evict told of each), ids appended to `out`."""
        ev = self._evictable
        cached = self._cached
        hash_of = self._hash_of
        refs = self._refs
        for _ in range(n):
            b, _unused = ev.popitem(last=False)
            h = hash_of.pop(b)
            del cached[h]
            del refs[b]
            self.on_evict(b, h)
            out.append(b)
        self.num_evictions += n

    def on_evict(self, block: int, block_hash: Hashable) -> None:
        """Called as each cached block is evicted, before its id is handed out again; nothing here. A second
        KV tier overrides it to copy the block out (kv/tier.py's TieredBlockPool). A method, not a stored
        function: a copy of the pool (Scheduler.snapshot) then calls its own."""


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PrefixCacheView:
    """A read-only view of a CachingBlockPool, for checkers and tests (Scheduler.prefix_cache).

    Reads go to the live pool: the mappings are read-only proxies of its own dicts (O(1) to make),
    so a view taken once stays current. Nothing here changes the pool.

    Args:
        pool: the pool viewed.
    """

    __slots__ = ("_pool",)

    def __init__(self, pool: CachingBlockPool) -> None:
        self._pool = pool

    @property
    def hash_of(self) -> Mapping[int, Hashable]:
        """Cached block -> its hash (held and evictable cached blocks)."""
        return MappingProxyType(self._pool._hash_of)

    @property
    def block_of(self) -> Mapping[Hashable, int]:
        """Hash -> the cached block holding it."""
        return MappingProxyType(self._pool._cached)

    @property
    def ref_counts(self) -> Mapping[int, int]:
        """Cached block -> tables holding it (0: evictable)."""
        return MappingProxyType(self._pool._refs)

    @property
    def num_cached(self) -> int:
        """Blocks with a hash, held or evictable."""
        return self._pool.num_cached

    @property
    def num_promised(self) -> int:
        """Blocks counted as used whose ids have not been handed out yet."""
        return self._pool.num_promised

    def evictable_ids(self) -> tuple[int, ...]:
        """The evictable blocks, the next to be evicted first."""
        return self._pool.evictable_ids()

    def cached_block(self, block_hash: Hashable) -> int | None:
        """The block cached under `block_hash`, or None."""
        return self._pool.cached_block(block_hash)


