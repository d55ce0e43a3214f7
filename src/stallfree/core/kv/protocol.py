"""The KV seam: what the scheduler asks of its KV manager (the verbs) apart from what it reads (the
figures), and the small values that cross it.

Imports allowed: the standard library and stallfree.core only.

Who calls whom (docs/DESIGN.md, architecture): Scheduler -> KVManager (ReservationKV, PagedKV, TieredKV,
or a manager over another engine's allocator) -> BlockPool. The scheduler decides *who* runs and who
is preempted; the manager only says whether the KV is there. A method that returns False means "a
preemption is needed"; preemption itself is one method of the scheduler.

Source: the split of vLLM v1's scheduler from its KVCacheManager (allocate_slots returning None means
"preempt"); the seam's names are this project's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.request import Request

if TYPE_CHECKING:
    from stallfree.core.kv.pool import PrefixCacheView
    from stallfree.core.live import LiveRequest

__all__ = ["NO_HIT", "NO_TRANSFERS", "KVFigures", "KVManager", "PrefixCacheStats", "Transfers"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
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


class KVFigures(Protocol):
    """The read-only figures of a KV manager: capacity, free and used counts, what a request needs, the
    prefix cache's view and counters. Reading one changes nothing; the scheduler reports them through
    Scheduler.stats() and checkers read them to verify the manager (core/invariants_kv.py).
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
    def kv_needed_for(self, req: Request) -> int:
        """The most KV `req` ever holds, tokens (whole blocks where the manager counts blocks)."""
    def blocks_needed(self, req: Request) -> int:
        """The most blocks (or units) `req` ever holds."""
    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of `req`'s prompt cached now, capped as `lookup` caps them; a pure query."""
    def free_block_ids(self) -> tuple[int, ...]:
        """The ids in no table (after every table was read through block_table)."""
    def cache_view(self) -> PrefixCacheView | None:
        """A read-only view of the prefix cache; None without caching."""


class KVManager(KVFigures, Protocol):
    """Everything the scheduler asks of its KV policy, and nothing more (docs/DESIGN.md, "The KV seam"):
    the read-only KVFigures, and the verbs below, which the scheduler calls as it plans and completes
    steps (of them only `lookup` never changes anything).

    The scheduler decides who runs and who is preempted; a manager only answers whether the KV is
    there and keeps the block tables. Every method takes the scheduler's own records
    (stallfree.core.live.LiveRequest; a manager reads `rid`, `req`, `target`, `offset`,
    `num_prompt_tokens`, `num_preemptions`, `admitted_step`, and owns `block_table`, `kv`, `bucket`,
    `num_cached_tokens`). Counts are tokens unless they say blocks; `step` is the scheduler's step
    number. A method that returns False changes nothing: for `grow` that means "preempt someone".

    Optional: `step_transfers()` (a second tier's copies) and `holds_every_token` (bool, False when
    absent): True promises that admission already holds the KV of every token a request computes, so
    `grow` always answers True and `trim` changes nothing; the scheduler then skips those calls for
    each decode of a speculative step (ReservationKV sets it).

    Implementations: ReservationKV (the contract), PagedKV (blocks on demand, optional prefix caching);
    a manager delegating to another engine's block allocator implements the same (tests/core/
    test_kv_seam.py has one).
    """

    def check_fits(self, req: Request) -> int:
        """Raise RequestRejected if `req` can never be admitted (or carries block hashes the manager
        cannot use); else return what the record keeps as `kv` (tokens reserved, or 0)."""
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
    def step_transfers(self) -> Transfers:
        """End of schedule(): the step's KV copies between tiers, (offloads as (gpu_block, cpu_block),
        loads as (cpu_block, gpu_block)), handed over once; NO_TRANSFERS for a manager with one tier."""
