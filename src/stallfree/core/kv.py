"""The KV side of the scheduler: one block pool, and the two KV policies that answer the scheduler's
questions about it (can this request be admitted, give this request the KV for these tokens, free it).

Imports allowed: the standard library and stallfree.core only.

A KV block holds the keys and values of `block_size` consecutive tokens of one request; a request's
block table is the list of its block ids in token order (token t lives in table[t // block_size]).
Everything here deals in integers: the tensors live in the engine, which writes token t of a request
to slot table[t // block_size] * block_size + t % block_size.

Who calls whom (docs/DESIGN.md, architecture): Scheduler -> KVManager (ReservationKV or PagedKV) ->
BlockPool. The scheduler decides *who* runs and who is preempted; the manager only says whether the
KV is there. A manager method that returns False means "a preemption is needed"; preemption itself is
one method of the scheduler.

Source: paged KV cache with a per-request block table and preemption by recompute (PagedAttention /
vLLM, Kwon et al., SOSP'23); the free-block watermark at admission (vLLM's and Sarathi-Serve's block
managers); reservation of prompt_len + max_new at admission (the contract, docs/DESIGN.md section 1).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from stallfree.core.errors import InvalidConfig, RequestRejected, SchedulerStateError, check_positive_int
from stallfree.core.request import Request

if TYPE_CHECKING:
    from stallfree.core.live import LiveRequest

__all__ = [
    "NO_HIT", "NO_TRANSFERS", "BlockPool", "CachingBlockPool", "KVManager", "PagedKV", "PrefixCacheStats",
    "PrefixCacheView", "ReservationKV", "Transfers",
    "KV_POLICIES", "blocks_for_tokens", "build_kv_manager", "check_kv_options", "check_watermark",
]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Return the KV blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size).

    Args:
        num_tokens: tokens, >= 0.
        block_size: tokens per block, >= 1.
    """
    return -(-num_tokens // block_size)


def check_watermark(value: object) -> float:
    """Return `value` as a float if it is a real number with 0 <= value < 1 (bools excluded).

    Raises:
        InvalidConfig: otherwise; the message names `watermark` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfig(f"watermark must be a number in [0, 1), got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and 0 <= value < 1):
        raise InvalidConfig(f"watermark must be a number in [0, 1), got {value!r}")
    return float(value)


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

    def __init__(self, num_blocks: int, block_size: int) -> None:
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

    def __init__(self, num_blocks: int, block_size: int) -> None:
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
    def num_evictable(self) -> int:
        """Cached blocks held by no table (counted in num_free)."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with a hash, held or evictable."""
        return len(self._hash_of)

    def try_promise(self, n: int) -> bool:
        """Promise `n` blocks if that many are free (evictable ones included) and return True; else
        change nothing and return False. A promised block that is claimed when no free-and-empty one
        is left evicts one."""
        if n > len(self._free) + self.num_blocks - self._fresh - self._promised + len(self._evictable):
            return False
        self._promised += n
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

    def _take(self, table: list[int], n: int) -> None:
        raw = len(self._free) + self.num_blocks - self._fresh
        if n <= raw:
            BlockPool._take(self, table, n)
            return
        BlockPool._take(self, table, raw)
        ev = self._evictable
        cached = self._cached
        hash_of = self._hash_of
        refs = self._refs
        for _ in range(n - raw):
            b, _unused = ev.popitem(last=False)
            del cached[hash_of.pop(b)]
            del refs[b]
            table.append(b)
        self.num_evictions += n - raw


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


class PrefixCacheStats:
    """Prefix caching's counters, kept by the KV manager that caches (all 0 for one that does not).

    Attributes (tokens):
        queries: tokens looked up at admissions (each episode's prefill), as vLLM counts its prefix
            cache queries.
        hits: of those, tokens found cached.
        first_queries, first_hits: the same for first admissions only (no recompute after a preemption).
    """

    __slots__ = ("queries", "hits", "first_queries", "first_hits")

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.first_queries = 0
        self.first_hits = 0

    def count(self, rec: LiveRequest, hit_tokens: int) -> None:
        """Count an admission of `rec` (its episode's `target` tokens looked up, `hit_tokens` found)."""
        self.queries += rec.target
        self.hits += hit_tokens
        if rec.admitted_step is None:
            rec.num_cached_tokens = hit_tokens
            self.first_queries += rec.target
            self.first_hits += hit_tokens


#: The answer of `KVManager.lookup` when nothing is cached: 0 tokens, no blocks.
NO_HIT: tuple[int, tuple[int, ...]] = (0, ())


#: A step's KV copies between tiers: (offloads as (gpu_block, cpu_block), loads as (cpu_block, gpu_block)).
Transfers = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]

#: The copies of a step without any (every manager with one KV tier).
NO_TRANSFERS: Transfers = ((), ())


class KVManager(Protocol):
    """Everything the scheduler asks of its KV policy, and nothing more (docs/DESIGN.md, "The KV seam").

    The scheduler decides who runs and who is preempted; a manager only answers whether the KV is
    there and keeps the block tables. Every method takes the scheduler's own records
    (stallfree.core.live.LiveRequest; a manager reads `rid`, `req`, `target`, `offset`,
    `num_prompt_tokens`, `num_preemptions`, `admitted_step`, and owns `block_table`, `kv`, `bucket`,
    `num_cached_tokens`). Counts are tokens unless they say blocks; `step` is the scheduler's step
    number. A method that returns False changes nothing: for `grow` that means "preempt someone".

    Implementations: ReservationKV (the contract), PagedKV (blocks on demand, optional prefix caching);
    a manager delegating to another engine's block allocator implements the same (tests/core/
    test_kv_seam.py has one).
    """

    #: KV capacity in tokens.
    kv_total: int
    #: Whether block ids are kept (Scheduler.block_table is then a function, else None).
    has_block_ids: bool
    #: Prefix caching's counters (zeros without caching).
    prefix_stats: PrefixCacheStats

    @property
    def kv_free(self) -> int:
        """Free KV, tokens."""
    @property
    def num_free_blocks(self) -> int:
        """Free blocks (or reservation units), evictable cached blocks included."""
    @property
    def num_used_blocks(self) -> int:
        """Blocks (or units) held or promised."""
    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks held by no request (0 without caching)."""
    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far (0 without caching)."""
    def check_fits(self, req: Request) -> int:
        """Raise RequestRejected if `req` can never be admitted (or carries block hashes the manager
        cannot use); else return what the record keeps as `kv` (tokens reserved, or 0)."""
    def kv_needed_for(self, req: Request) -> int:
        """The most KV `req` ever holds, tokens (whole blocks where the manager counts blocks)."""
    def blocks_needed(self, req: Request) -> int:
        """The most blocks (or units) `req` ever holds."""
    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of `req`'s prompt cached now, capped as `lookup` caps them; a pure query."""
    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """The cached prefix `rec` would reuse: (tokens, an opaque handle for can_admit/admit);
        NO_HIT without caching. Changes nothing."""
    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int]) -> bool:
        """Whether `rec` can be admitted now with a first chunk of `first_chunk` tokens after its
        cached prefix `hits` (from lookup), `num_running` requests running. Changes nothing."""
    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int]) -> None:
        """Give `rec` its KV (can_admit said yes just now), counting the prefix cache lookup."""
    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        """Before a step in which every ready decode gets one token: secure the blocks of the
        decodes whose token starts a block and return (); if that is not possible at once, secure
        nothing and return those decodes (the scheduler then grows each, preempting)."""
    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        """Give running `rec` the KV to hold `tokens` tokens in step `step`; False (nothing changes)
        when too few blocks are free."""
    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        """After a step: a chunk of `rec` computed its tokens [start, end) (cache the full blocks)."""
    def moved(self, rec: LiveRequest, step: int) -> None:
        """After a step: a decode's progress was not one token (skipped, or speculative tokens)."""
    def start_decode(self, rec: LiveRequest) -> None:
        """`rec` finished its prefill and joins the decodes (its `offset` is set)."""
    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """After a step: keep only the KV of `rec`'s first `tokens` tokens (rejected speculative tokens)."""
    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Return all of `rec`'s KV (finish, abort or preemption); `in_flight`: its step is in flight."""
    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        """The block ids of `rec` in token order, covering `tokens` tokens (its KV plus the plan in flight)."""
    def free_block_ids(self) -> tuple[int, ...]:
        """The ids in no table (after every table was read through block_table)."""
    def cache_view(self) -> PrefixCacheView | None:
        """A read-only view of the prefix cache; None without caching."""
    def step_transfers(self) -> Transfers:
        """End of schedule(): the step's KV copies between tiers, (offloads as (gpu_block, cpu_block),
        loads as (cpu_block, gpu_block)), handed over once; NO_TRANSFERS for a manager with one tier."""


def _reject_hashes(req: Request, policy: str) -> None:
    """Raise RequestRejected for a request with block_hashes at a manager without prefix caching."""
    raise RequestRejected(
        f"request {req.rid!r} has block_hashes, which only a scheduler with "
        f"enable_prefix_caching=True (and kv_policy='paged') uses; this one has "
        f"kv_policy={policy!r}, enable_prefix_caching=False"
    )


class ReservationKV:
    """The contract's KV policy: prompt_len + max_new tokens reserved at admission, returned at the end.

    The reservation is counted in units of the pool's blocks (1 token, or block_size tokens when a
    block size is given: ceil((prompt_len + max_new) / B) blocks out of floor(kv_tokens / B)) and
    promised at admission, so kv_free and admission only count. The ids come later from that
    promise: `materialize` gives a request's block table exactly the blocks that cover the tokens
    it asks for (claimed from its own promise, so it never fails: a request never computes more
    than prompt_len + max_new - 1 tokens), and `free` returns the table and the unclaimed rest.
    Tables are filled only when read (the engine reads them; the simulator never does), so the
    reservation costs no work per step.

    Args:
        kv_tokens: KV capacity in tokens, >= 1.
        block_size: None (count tokens) or tokens per block, >= 1 and <= kv_tokens.
    """

    def __init__(self, kv_tokens: int, block_size: int | None) -> None:
        self.unit = block_size or 1
        self.pool = BlockPool(kv_tokens // self.unit, self.unit)
        self.kv_total = self.pool.num_blocks * self.unit
        self.has_block_ids = block_size is not None
        self.prefix_stats = PrefixCacheStats()

    @property
    def kv_free(self) -> int:
        """Unreserved KV, in tokens."""
        return self.pool.num_free * self.unit

    @property
    def num_free_blocks(self) -> int:
        """Free reservation units (tokens, or blocks of block_size)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Reserved units."""
        return self.pool.num_used

    @property
    def num_evictable_blocks(self) -> int:
        """Always 0: nothing is cached."""
        return 0

    @property
    def num_evictions(self) -> int:
        """Always 0: nothing is cached."""
        return 0

    def kv_needed(self, prompt_len: int, max_new: int) -> int:
        """Tokens reserved at admission: prompt_len + max_new, in whole blocks when a block size is set."""
        u = self.unit
        return -(-(prompt_len + max_new) // u) * u

    def kv_needed_for(self, req: Request) -> int:
        """Tokens `req` reserves at admission (kv_needed of its lengths)."""
        return self.kv_needed(req.prompt_len, req.max_new)

    def blocks_needed(self, req: Request) -> int:
        """Units (tokens, or blocks of block_size) `req` reserves at admission."""
        return self.kv_needed(req.prompt_len, req.max_new) // self.unit

    def cached_prefix_len(self, req: Request) -> int:
        """Always 0: nothing is cached."""
        return 0

    def check_fits(self, req: Request) -> int:
        """Return the tokens `req` reserves at admission.

        Raises:
            RequestRejected: more than kv_total, or `req` has block_hashes (no prefix caching here);
                the message gives the numbers.
        """
        if req.block_hashes is not None:
            _reject_hashes(req, "reserve")
        need = self.kv_needed(req.prompt_len, req.max_new)
        if need > self.kv_total:
            blocks = f" in whole blocks of {self.unit}" if self.unit > 1 else ""
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {req.prompt_len} + "
                f"{req.max_new} = {req.prompt_len + req.max_new}, {need} tokens of KV{blocks} "
                f"> kv_tokens = {self.kv_total}"
            )
        return need

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """NO_HIT: nothing is cached."""
        return NO_HIT

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int] = ()) -> bool:
        """True when the whole reservation of `rec` is free."""
        return rec.kv <= self.pool.num_free * self.unit

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int] = ()) -> None:
        """Reserve `rec`'s KV (can_admit must have said yes)."""
        self.pool.promise(rec.kv // self.unit)

    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        """(): the reservations already hold every decode's KV."""
        return ()

    def step_transfers(self) -> Transfers:
        """NO_TRANSFERS: one tier, nothing is copied."""
        return NO_TRANSFERS

    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        """True: the reservation covers every token a request computes."""
        return True

    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        """Nothing to do: nothing is cached."""

    def moved(self, rec: LiveRequest, step: int) -> None:
        """Nothing to do: a table is made exact when it is read."""

    def start_decode(self, rec: LiveRequest) -> None:
        """Nothing to do: the reservation holds the decode's KV."""

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """Nothing to do: a table is made exact when it is read (`block_table`)."""

    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        """`rec`'s table made exactly the blocks of `tokens` tokens (materialize), as a tuple."""
        self.materialize(rec, tokens)
        return tuple(rec.block_table)

    def free_block_ids(self) -> tuple[int, ...]:
        """The ids in no table (the unclaimed parts of reservations included)."""
        return self.pool.free_ids()

    def cache_view(self) -> PrefixCacheView | None:
        """None: nothing is cached."""
        return None

    def materialize(self, rec: LiveRequest, tokens: int) -> None:
        """Make `rec`'s block table exactly the blocks that hold `tokens` tokens, within its reservation.

        Missing blocks are claimed from its promise; blocks past `tokens` (rejected speculative
        tokens) go back to the promise, so kv_free does not change.

        Raises:
            SchedulerStateError: `tokens` exceeds the reservation (a caller's bookkeeping fault);
                nothing changes.
        """
        table = rec.block_table
        want = -(-tokens // self.unit)
        have = len(table)
        if want > rec.kv // self.unit:
            raise SchedulerStateError(
                f"request {rec.rid!r}: {tokens} tokens of KV exceed its reservation of {rec.kv}"
            )
        if want > have:
            self.pool.claim(table, want - have)
        elif want < have:
            self.pool.release_tail(table, want)
            self.pool.promise(have - want)

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Return `rec`'s reservation: the blocks of its table and the promised rest."""
        self.pool.release(rec.block_table, rec.kv // self.unit - len(rec.block_table))


class PagedKV:
    """The paged KV policy: blocks taken as tokens are scheduled, admission by a free-block watermark.

    A running request holds ceil(tokens in its KV / block_size) blocks (plus, while its step is in
    flight, those of the tokens scheduled in it). Decodes are filed by the step residue at which their
    next token starts a block: at step k the decodes of bucket k % block_size each need one, and are
    served by one promise of that many blocks; each table gets its ids when it is read
    (`materialize`). A decode whose progress is not one token a step (a skipped decode, speculative
    tokens) is re-filed by the scheduler through `refile`.

    Args:
        num_blocks: KV blocks, >= 1.
        block_size: tokens per block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.
        enable_prefix_caching: keep computed prompt blocks for reuse (a CachingBlockPool); a
            request's longest cached prefix is then pinned at admission (`lookup`, `admit`).

    Raises:
        InvalidConfig: an argument is out of range; the message names it.
    """

    pool: BlockPool

    def __init__(self, num_blocks: int, block_size: int, watermark: float, enable_prefix_caching: bool = False) -> None:
        self.cache: CachingBlockPool | None = None
        if enable_prefix_caching:
            self.pool = self.cache = CachingBlockPool(num_blocks, block_size)
        else:
            self.pool = BlockPool(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark = check_watermark(watermark)
        self.watermark_blocks = math.floor(self.watermark * num_blocks)
        self.kv_total = num_blocks * block_size
        self.buckets: dict[int, dict[Hashable, LiveRequest]] = {}
        self.has_block_ids = True
        self.prefix_stats = PrefixCacheStats()

    @property
    def kv_free(self) -> int:
        """Free KV in tokens: free blocks x block_size."""
        return self.pool.num_free * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks free (evictable cached blocks included)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held or promised (evictable cached blocks are not held)."""
        return self.pool.num_used

    @property
    def num_evictable_blocks(self) -> int:
        """Prefix caching: cached blocks held by no request (counted in num_free_blocks); else 0."""
        return self.cache.num_evictable if self.cache is not None else 0

    @property
    def num_evictions(self) -> int:
        """Prefix caching: cached blocks evicted (handed out again) so far; else 0."""
        return self.cache.num_evictions if self.cache is not None else 0

    def kv_needed_for(self, req: Request) -> int:
        """The most KV `req` ever holds, tokens: blocks_needed(req) x block_size."""
        return self.blocks_needed(req) * self.block_size

    def cached_prefix_len(self, req: Request) -> int:
        """Prefix caching: tokens of `req`'s prompt whose blocks are cached now, capped as `lookup`
        caps a hit (at most prompt_len - 1 tokens, in whole blocks); 0 without caching or
        block_hashes. O(blocks of the prompt); nothing is pinned and no block's recency changes."""
        hashes = req.block_hashes
        if self.cache is None or not hashes:
            return 0
        bs = self.block_size
        return len(self.cache.lookup(hashes, (req.prompt_len - 1) // bs)) * bs

    def blocks_needed(self, req: Request) -> int:
        """The most blocks `req` ever holds: ceil((prompt_len + max_new - 1) / block_size).

        The last sampled token is never fed back, so its KV is never computed.
        """
        return blocks_for_tokens(req.prompt_len + req.max_new - 1, self.block_size)

    def check_fits(self, req: Request) -> int:
        """Return 0 (nothing is reserved) if `req` fits.

        Raises:
            RequestRejected: blocks_needed(req) is more than num_blocks; or `req` has block_hashes
                without prefix caching, or not one per full block of its prompt; the message gives
                the numbers.
        """
        hashes = req.block_hashes
        if hashes is not None:
            if self.cache is None:
                _reject_hashes(req, "paged")
            want = req.prompt_len // self.block_size
            most = (req.prompt_len + req.max_new - 1) // self.block_size
            if not want <= len(hashes) <= most:
                raise RequestRejected(
                    f"request {req.rid!r}: block_hashes has {len(hashes)} hashes, expected one per full "
                    f"block of the prompt: prompt_len // block_size = {req.prompt_len} // "
                    f"{self.block_size} = {want} (up to (prompt_len + max_new - 1) // block_size = {most} "
                    "with the output's blocks)"
                )
        need = self.blocks_needed(req)
        if need > self.num_blocks:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: ceil((prompt_len + max_new - 1) / block_size) = "
                f"ceil(({req.prompt_len} + {req.max_new} - 1) / {self.block_size}) = {need} blocks "
                f"> num_blocks = {self.num_blocks}"
            )
        return 0

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int] = ()) -> bool:
        """The blocks of the first chunk are free and the watermark stays free (waived when nothing
        runs). A preempted request needs the blocks of its whole recompute (prompt + generated), so
        that it is not readmitted only to be preempted again (B21's thrashing).

        With prefix caching, `hits` are the cached blocks of its prefix (from `lookup`); the first
        chunk then starts after them, only the blocks to allocate count, plus the hit blocks that
        are evictable now (pinning them takes them out of the free count)."""
        bs = self.block_size
        h = len(hits)
        want = -(-rec.target // bs) if rec.num_preemptions else -(-(h * bs + first_chunk) // bs)
        want -= h
        if h:
            assert self.cache is not None
            want += self.cache.num_evictable_among(hits)
        free = self.pool.num_free
        return want <= free and not (num_running and free - want < self.watermark_blocks)

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int] = ()) -> None:
        """Give `rec` its hit blocks (pinned) and the blocks of its first chunk after them; with
        prefix caching, count the lookup in prefix_stats."""
        h = len(hits)
        if h:
            assert self.cache is not None
            self.cache.pin(rec.block_table, hits)
        self.pool.allocate(rec.block_table, -(-(h * self.block_size + first_chunk) // self.block_size) - h)
        if self.cache is not None:
            self.prefix_stats.count(rec, h * self.block_size)

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """Prefix caching: (tokens, blocks) of `rec`'s longest cached prompt prefix, capped at
        prompt_len - 1 tokens, so that at least the prompt's last token (and so the episode's last
        token, which samples) is computed; NO_HIT without caching or block_hashes."""
        hashes = rec.req.block_hashes
        if not hashes or self.cache is None:
            return NO_HIT
        hits = self.cache.lookup(hashes, (rec.num_prompt_tokens - 1) // self.block_size)
        return len(hits) * self.block_size, hits

    def step_transfers(self) -> Transfers:
        """NO_TRANSFERS: one tier, nothing is copied (TieredKV hands over its copies)."""
        return NO_TRANSFERS

    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        """Promise, in one count, a block to each decode whose token of step `step` starts one (the
        bucket of step % block_size) and return (); when too few are free, promise nothing and
        return those decodes."""
        bucket = self.buckets.get(step % self.block_size)
        if bucket and not self.pool.try_promise(len(bucket)):
            return list(bucket.values())
        return ()

    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        """Prefix caching: cache the full prompt blocks that tokens [start, end) completed (register)."""
        if self.cache is not None:
            self.register(rec, start, end)

    def moved(self, rec: LiveRequest, step: int) -> None:
        """A decode skipped a step or took speculative tokens: claim the ids promised to it for the
        tokens now in its KV (offset + step), and file it under its new residue."""
        self.materialize(rec, step, False)
        self.refile(rec)

    def start_decode(self, rec: LiveRequest) -> None:
        """File a new decode by the residue at which its next token starts a block (file_decode)."""
        self.file_decode(rec)

    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        """`rec`'s table, a decode's promised blocks claimed so that it covers `tokens` tokens."""
        if rec.bucket >= 0:
            missing = -(-tokens // self.block_size) - len(rec.block_table)
            if missing > 0:
                self.pool.claim(rec.block_table, missing)
        return tuple(rec.block_table)

    def free_block_ids(self) -> tuple[int, ...]:
        """The ids in no table (evictable cached blocks last)."""
        return self.pool.free_ids()

    def cache_view(self) -> PrefixCacheView | None:
        """A read-only view of the prefix cache; None without caching."""
        return PrefixCacheView(self.cache) if self.cache is not None else None

    def register(self, rec: LiveRequest, start: int, end: int) -> None:
        """Prefix caching: a chunk of `rec` computed its tokens [start, end); cache the full prompt
        blocks it completed."""
        hashes = rec.req.block_hashes
        if hashes and self.cache is not None:
            bs = self.block_size
            last = min(len(hashes), end // bs)
            first = start // bs
            if last > first:
                self.cache.register(rec.block_table, hashes, first, last)

    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        """Give `rec` the blocks to hold `tokens` tokens in step `step` (a decode first claims the
        blocks promised to it for the tokens already in its KV); False (nothing more changes) when
        too few are free."""
        if rec.bucket >= 0:
            self.materialize(rec, step, False)
        need = -(-tokens // self.block_size) - len(rec.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        self.pool.allocate(rec.block_table, need)
        return True

    def _register_output(self, rec: LiveRequest, step: int, in_flight: bool, unclaimed: int) -> int:
        """Cache the full blocks of `rec`'s generated tokens that its block hashes name (hashes past the
        prompt's full blocks: a conversation's next turn resends this output as its history), as vLLM
        caches a request's decode blocks; return the promised blocks still unclaimed (0: claimed here).

        Only blocks whose every token's KV is computed are cached: the decode's tokens in KV are
        offset + step (the last sampled token is never fed back), less the token of a plan in flight.
        """
        hashes = rec.req.block_hashes
        assert hashes is not None and self.cache is not None
        if unclaimed:
            self.pool.claim(rec.block_table, unclaimed)
        bs = self.block_size
        computed = rec.offset + step
        last = min(len(hashes), computed // bs, len(rec.block_table))
        first = rec.num_prompt_tokens // bs
        if last > first:
            self.cache.register(rec.block_table, hashes, first, last)
        return 0

    def file_decode(self, rec: LiveRequest) -> None:
        """File a new decode under the residue at which its next token starts a block."""
        rec.bucket = -rec.offset % self.block_size
        self.buckets.setdefault(rec.bucket, {})[rec.rid] = rec

    def refile(self, rec: LiveRequest) -> None:
        """Re-file a decode whose offset moved (its table must hold the ids it was promised)."""
        del self.buckets[rec.bucket][rec.rid]
        self.file_decode(rec)

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """Return the blocks of `rec` beyond those that hold `tokens` tokens (rejected speculative tokens)."""
        keep = -(-tokens // self.block_size)
        if self.cache is not None:
            self.cache.release_tail(rec.block_table, keep, len(rec.req.block_hashes or ()))
        else:
            self.pool.release_tail(rec.block_table, keep)

    def unclaimed(self, rec: LiveRequest, step: int, in_flight: bool) -> int:
        """Blocks promised to a decode and not yet in its table: its table must cover the tokens in
        its KV (offset + step), plus the token of the plan in flight."""
        tokens = rec.offset + step + in_flight
        return max(0, -(-tokens // self.block_size) - len(rec.block_table))

    def materialize(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Give a decode's table the ids of the blocks promised to it."""
        if rec.bucket >= 0:
            missing = self.unclaimed(rec, step, in_flight)
            if missing:
                self.pool.claim(rec.block_table, missing)

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Return every block of `rec` (and its unclaimed promises); drop it from its bucket."""
        unclaimed = 0
        if rec.bucket >= 0:
            table = rec.block_table
            unclaimed = -(-(rec.offset + step + in_flight) // self.block_size) - len(table)
            if unclaimed < 0:
                unclaimed = 0
            del self.buckets[rec.bucket][rec.rid]
            rec.bucket = -1
        if self.cache is not None:
            hashes = rec.req.block_hashes
            if hashes and len(hashes) > rec.num_prompt_tokens // self.block_size and rec.finish_step >= 0:
                unclaimed = self._register_output(rec, step, in_flight, unclaimed)
            # Only the hashed blocks may be cached: the rest is freed without a look at each.
            self.cache.release(rec.block_table, unclaimed, len(hashes or ()))
        else:
            self.pool.release(rec.block_table, unclaimed)


#: The KV policies of Scheduler(kv_policy=...).
KV_POLICIES = ("reserve", "paged")


def check_kv_options(
    kv_policy: object, block_size: int | None, align_chunks: object, watermark: object, enable_prefix_caching: object
) -> tuple[bool, float]:
    """Validate the KV keywords of Scheduler(...) and resolve align_chunks' default.

    Args:
        kv_policy: "reserve" or "paged".
        block_size: tokens per block, an integer >= 1, or None (not allowed under "paged").
        align_chunks: None (on for "reserve" with a block_size, off for "paged"), True or False.
        watermark: 0 <= watermark < 1.
        enable_prefix_caching: True (needs "paged") or False.

    Returns:
        (align_chunks, watermark as a float).

    Raises:
        InvalidConfig: any of these out of range; the message names the keyword and the value.
    """
    if kv_policy not in KV_POLICIES:
        raise InvalidConfig(f"kv_policy must be 'reserve' or 'paged', got {kv_policy!r}")
    if kv_policy == "paged" and block_size is None:
        raise InvalidConfig("kv_policy='paged' needs a block_size (tokens per KV block), got None")
    if align_chunks not in (None, True, False):
        raise InvalidConfig(f"align_chunks must be None, True or False, got {align_chunks!r}")
    if align_chunks and block_size is None:
        raise InvalidConfig("align_chunks=True needs a block_size, got None")
    wm = check_watermark(watermark)
    if not isinstance(enable_prefix_caching, bool):
        raise InvalidConfig(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
    if enable_prefix_caching and kv_policy != "paged":
        raise InvalidConfig(
            f"enable_prefix_caching=True needs kv_policy='paged' (cached blocks are shared block-table "
            f"entries), got kv_policy={kv_policy!r}"
        )
    if block_size is not None:
        check_positive_int("block_size", block_size)
    if align_chunks is None:
        return kv_policy == "reserve" and block_size is not None, wm
    return bool(align_chunks), wm


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
