"""The invariant checker's prefix-cache rules (paged KV with enable_prefix_caching=True): each block
free-and-empty, evictable-cached, or held with a reference count equal to the tables holding it; hits
are the longest cached prefix and leave the last token to compute; no held block is evicted; eviction
is least recently released first, tail first. Read through Scheduler.prefix_cache, a read-only view.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING

from stallfree.core.queries import peek_block_table, peek_free_block_ids
from stallfree.core.scheduler import Scheduler

if TYPE_CHECKING:
    from stallfree.core.invariants_state import CheckerState, _Shadow

__all__ = ["CacheRules", "block_table", "peek_table"]


def peek_table(s: Scheduler, rid: Hashable) -> tuple[tuple[int, ...], int]:
    """The ids in live `rid`'s block table and the blocks it is owed, through the scheduler's pure
    peek_block_table: the checker hands out no promised ids, which with prefix caching would evict
    cached blocks the unchecked run keeps (and so change its hits)."""
    return peek_block_table(s, rid)


def block_table(s: Scheduler, rid: Hashable) -> tuple[int, ...]:
    """The ids in live `rid`'s block table now (a pure read: promised blocks without ids are left out)."""
    return peek_block_table(s, rid)[0]


class CacheRules:
    """Prefix caching's part of the checker (paged KV with enable_prefix_caching=True)."""

    @staticmethod
    def snapshot(chk: CheckerState) -> None:
        """Before a schedule(): free blocks, evictable ids and every running table."""
        s = chk.scheduler
        cache = s.prefix_cache
        assert cache is not None
        chk._pre_tables = {rid: block_table(s, rid) for rid in chk._running}
        chk._pre_free = s.stats().num_free_blocks
        evq = list(cache.evictable_ids())
        chk._pre_evictable = set(evq)
        # The hashes of the blocks the step may evict, in eviction order (nothing is cached during a
        # step, so the cache during it is the cache after it plus what the step evicted).
        chk._evq_hashes = list(map(cache.hash_of.__getitem__, evq))  # read only
        chk._view = None
        chk._evq, chk._evq_pos = evq, 0
        # Free-and-empty blocks not kept for earlier promises (a promise takes its blocks at once).
        chk._raw = s.stats().num_free_blocks - len(evq)
        chk._evicted = set()
        chk._pinned = set()

    @staticmethod
    def take(chk: CheckerState, n: int) -> None:
        """An allocation of `n` blocks in the step, in the checker's view: free-and-empty blocks
        first, then evictable ones not pinned in this step, least recently released first (evicted)."""
        if n <= 0 or not chk._caching:
            return
        got = min(n, chk._raw)
        chk._raw -= got
        n -= got
        q = chk._evq
        while n > 0 and chk._evq_pos < len(q):
            b = q[chk._evq_pos]
            chk._evq_pos += 1
            if b not in chk._pinned:
                chk._evicted.add(b)
                n -= 1

    @staticmethod
    def lost(chk: CheckerState) -> list[int]:
        """Positions in the snapshot's evictable list of the blocks that no longer hold their hash."""
        cache = chk.scheduler.prefix_cache
        assert cache is not None
        changed = map(operator.ne, map(cache.hash_of.get, chk._evq), chk._evq_hashes)
        return list(itertools.compress(range(len(chk._evq)), changed))

    @staticmethod
    def check_evictions(chk: CheckerState) -> None:
        """After schedule() (before any table is read): exactly the blocks the view evicted lost their
        hash. Skipped in a step that preempted (victims' blocks return mid-step; nothing is admitted)."""
        cache = chk.scheduler.prefix_cache
        assert cache is not None
        # Only evictable blocks can be evicted; held ones are checked by check() (hits keep their hash).
        lost = {chk._evq[i] for i in CacheRules.lost(chk)}
        if lost != chk._evicted:
            chk._fail("LRU eviction, tail first, never a held block",
                      f"evicted {sorted(lost)}; the checker's own model evicted {sorted(chk._evicted)}")

    @staticmethod
    def hits(chk: CheckerState, sh: _Shadow) -> list[int]:
        """The longest cached prefix of a waiting request's prompt blocks at its place in the step,
        leaving its last token to compute, from the checker's own view, not from the pool's lookup:
        the blocks cached when the step was planned are those cached after it and the evictable ones
        that lost their hash in it; of these, the ones the checker's own eviction model (`take`) had
        evicted by this point in the step are gone."""
        cache = chk.scheduler.prefix_cache
        assert cache is not None
        if chk._view is None:  # hash -> block of the evictable blocks that lost their hash in the step
            lost = CacheRules.lost(chk)
            chk._view = dict(zip(map(chk._evq_hashes.__getitem__, lost), map(chk._evq.__getitem__, lost),
                                 strict=True))
        evicted_in_step = chk._view
        evicted = chk._evicted
        hashes = sh.req.block_hashes or ()
        bs = chk.scheduler.config.block_size or 1
        out: list[int] = []
        for i in range(min(len(hashes), (sh.req.prompt_len - 1) // bs)):
            b = cache.cached_block(hashes[i])
            if b is None:
                b = evicted_in_step.get(hashes[i])
            if b is None or b in evicted:
                break
            out.append(b)
        return out

    @staticmethod
    def freed_by(chk: CheckerState, victim: Hashable) -> int:
        """Blocks a victim's release makes free: those no other running request holds (its
        blocks taken in this step are its own)."""
        table = chk._pre_tables.get(victim, ())
        others: set[int] = set()
        for rid in chk._running:
            if rid != victim:
                others.update(chk._pre_tables.get(rid, ()))
        grown = chk._reqs[victim].blocks - len(table)
        return sum(1 for b in table if b not in others) + max(grown, 0)

    @staticmethod
    def check(chk: CheckerState) -> int:
        """Every block in one state; reference counts; hits still cached. Returns the held blocks (with
        those promised to tables and not handed out yet). Pure reads only: no table is materialized."""
        s = chk.scheduler
        cache = s.prefix_cache
        assert cache is not None
        free = peek_free_block_ids(s)  # promised blocks not handed out are among them
        owed_total = 0
        evictable = set(cache.evictable_ids())
        # The pool's per-block state, read only; whole-set operations keep this O(blocks) check cheap
        # enough to run after every call.
        hash_of = cache.hash_of
        refs = cache.ref_counts
        held: Counter[int] = Counter()
        bs = s.config.block_size or 1
        for rid in chk._running:
            sh = chk._reqs[rid]
            table, owed = peek_table(s, rid)
            if owed < 0 or len(table) + owed != sh.blocks:
                chk._fail("block table", f"rid {rid!r}: {table} and {owed} owed, expected {sh.blocks} blocks")
            owed_total += owed
            if len(set(table)) != len(table):
                chk._fail("block twice in one table", f"rid {rid!r}: {table}")
            hashes = sh.req.block_hashes or ()
            if sh.hit * bs > sh.req.prompt_len - 1:
                chk._fail("hit tokens <= prompt - 1",
                          f"rid {rid!r}: {sh.hit} blocks of {bs}, prompt {sh.req.prompt_len}")
            if sh.hit and list(map(hash_of.get, table[: sh.hit])) != list(hashes[: sh.hit]):
                lost = [i for i in range(sh.hit) if hash_of.get(table[i]) != hashes[i]]
                chk._fail("no held block evicted", f"rid {rid!r}: blocks {[table[i] for i in lost]} lost hashes {lost}")
            held.update(table)
        free_set = set(free)
        promised = cache.num_promised
        if owed_total != promised:
            chk._fail("every promised block is owed to a table", f"{promised} promised, tables owed {owed_total}")
        if (len(free_set) != len(free) or len(free) - promised != s.stats().num_free_blocks
                or not free_set.isdisjoint(held)):
            chk._fail("free list", f"{s.stats().num_free_blocks} free blocks, ids {free}, held {sorted(held)}")
        if len(free) + len(held) != s.stats().num_blocks:
            chk._fail("every block accounted for", f"{len(free)} free + {len(held)} held != {s.stats().num_blocks}")
        cached_free = free_set.intersection(hash_of)
        if cached_free != evictable:
            chk._fail("a free block is empty unless evictable, and an evictable one is cached",
                      f"free blocks with a hash {sorted(cached_free)}, evictable {sorted(evictable)}")
        if list(map(refs.get, evictable)).count(0) != len(evictable):
            chk._fail("evictable is cached with no holder",
                      f"refs {[(b, refs.get(b)) for b in evictable if refs.get(b) != 0]}")
        if list(map(refs.get, held.keys(), itertools.repeat(1))) != list(held.values()):
            wrong = [(b, refs.get(b), n) for b, n in held.items() if refs.get(b, 1) != n]
            chk._fail("reference count == tables holding the block (1 for an uncached block)",
                      f"(block, refs, tables): {wrong}")
        if held and (min(held) < 0 or max(held) >= s.stats().num_blocks):
            chk._fail("block id range", f"held {sorted(held)}")
        cached = cache.block_of
        if refs.keys() != hash_of.keys() or len(cached) != len(hash_of) or list(
                map(hash_of.get, cached.values())) != list(cached.keys()):
            chk._fail("cache map", f"{len(cache.block_of)} hashes, {len(hash_of)} cached blocks, {len(refs)} counted")
        if cache.num_cached != len(cache.block_of) or s.stats().num_evictable_blocks != len(evictable):
            chk._fail("cache counts", f"{cache.num_cached} cached, {len(cache.block_of)} hashes")
        return len(held) + promised
