"""The invariant checker's KV rules: the reservation policy's (reservations add up, tables hold the
computed tokens) and the paged policy's (blocks cover the tokens, no block in two tables, victims by the
written rule, block accounting), read through the scheduler's public views.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from stallfree.core.invariants_cache import CacheRules, peek_table
from stallfree.core.plan import StepPlan
from stallfree.core.queries import peek_free_block_ids

if TYPE_CHECKING:
    from stallfree.core.invariants_state import CheckerState

__all__ = ["PagedRules", "ReserveRules"]


class ReserveRules:
    """The reservation policy's part of the checker."""

    @staticmethod
    def check(chk: CheckerState, scheduled: StepPlan | None) -> None:
        s = chk.scheduler
        reserved = sum(s.kv_manager.kv_needed_for(chk._reqs[r].req) for r in chk._running)
        if s.kv_free < 0 or s.kv_free != s.stats().kv_total - reserved:
            chk._fail("KV accounting", f"kv_free {s.kv_free}, expected {s.stats().kv_total} - {reserved}")
        if scheduled is None and s.config.block_size is not None and chk._calls % chk.table_every == 0:
            ReserveRules.check_block_ids(chk)

    @staticmethod
    def check_block_ids(chk: CheckerState) -> None:
        """Between steps, each running request's table holds exactly the blocks of its computed tokens,
        no more than its reservation's; no block is in two tables or both in a table and free. Pure reads:
        no table is made exact (the blocks a table lacks, or holds past its tokens, are counted, not moved)."""
        s = chk.scheduler
        bs = s.config.block_size or 1
        free = peek_free_block_ids(s)
        seen = set(free)
        if len(seen) != len(free):
            chk._fail("free list", f"ids {free}")
        for rid in chk._running:
            sh = chk._reqs[rid]
            table, owed = peek_table(s, rid)
            want = -(-sh.computed // bs)
            if len(table) + owed != want or max(len(table), want) * bs > s.kv_manager.kv_needed_for(sh.req):
                chk._fail("reserve: blocks cover the computed tokens", f"rid {rid!r}: {table} for {sh.computed} "
                          f"tokens, reservation {s.kv_manager.kv_needed_for(sh.req)}")
            if seen.intersection(table) or len(set(table)) != len(table):
                chk._fail("block in two places", f"rid {rid!r}: {table}")
            if table and (min(table) < 0 or max(table) * bs >= s.stats().kv_total):
                chk._fail("block id range", f"rid {rid!r}: {table}")
            seen.update(table)
        if len(seen) * bs != s.stats().kv_total:
            chk._fail("every block accounted for", f"{len(seen)} of {s.stats().kv_total // bs}")


class PagedRules:
    """The paged policy's part of the checker: blocks of decodes and victims, block accounting and ids."""

    @staticmethod
    def grow_decodes(
        chk: CheckerState, chosen: list[Hashable], costs: dict[Hashable, int], free: int, victims: list[Hashable],
        takes: bool = False,
    ) -> int:
        """Each chosen decode, oldest first, takes the blocks of its tokens, preempting by the victim
        rule (itself when none may be preempted for it) while none are free; returns the free blocks."""
        for rid in chosen:
            sh = chk._reqs[rid]
            if not sh.running:
                continue  # a victim of an older decode
            need = chk._blocks(sh.computed + costs[rid]) - sh.blocks
            while need > free:
                victim = chk._victim_for(rid)
                free += CacheRules.freed_by(chk, victim) if chk._caching else chk._reqs[victim].blocks
                chk._preempt(victim, victims)
                if victim == rid:
                    break
            else:
                free -= max(need, 0)
                sh.blocks += max(need, 0)
                if takes:
                    CacheRules.take(chk, need)
        return free

    @staticmethod
    def check(chk: CheckerState, scheduled: StepPlan | None) -> None:
        s = chk.scheduler
        reqs = chk._reqs
        used = sum(reqs[r].blocks for r in chk._running)
        if chk._caching:
            used = CacheRules.check(chk)  # distinct held blocks
        if used + s.stats().num_free_blocks != s.stats().num_blocks or s.stats().num_used_blocks != used:
            chk._fail("free + used == num_blocks", f"{s.stats().num_free_blocks} + {used} != {s.stats().num_blocks}")
        bs = s.config.block_size or 1
        st = s.stats()
        if s.kv_free != st.num_free_blocks * bs or st.kv_total != st.num_blocks * bs:
            chk._fail("kv_free in tokens", f"{s.kv_free} for {st.num_free_blocks} blocks of {s.config.block_size}")
        if scheduled is None:
            for rid in chk._running:
                sh = reqs[rid]
                if sh.blocks != chk._blocks(sh.computed):
                    chk._fail("blocks cover the computed tokens", f"rid {rid!r}: {sh.blocks} for {sh.computed}")
        if chk._calls % chk.table_every == 0 and not chk._caching:
            PagedRules.check_block_ids(chk)

    @staticmethod
    def check_block_ids(chk: CheckerState) -> None:
        """Check the block ids, each block in exactly one place, through pure reads: a table's promised
        blocks without ids are counted (they are among the free ids), not handed out."""
        s = chk.scheduler
        free = peek_free_block_ids(s)
        seen = set(free)
        owed_total = 0
        for rid in chk._running:
            table, owed = peek_table(s, rid)
            owed_total += owed
            if owed < 0 or len(table) + owed != chk._reqs[rid].blocks:
                chk._fail("block table",
                          f"rid {rid!r}: {table} and {owed} owed, expected {chk._reqs[rid].blocks} blocks")
            if seen.intersection(table) or len(set(table)) != len(table):
                chk._fail("block in two places", f"rid {rid!r}: {table}")
            if table and (min(table) < 0 or max(table) >= s.stats().num_blocks):
                chk._fail("block id range", f"rid {rid!r}: {table}")
            seen.update(table)
        if len(set(free)) != len(free) or len(free) - owed_total != s.stats().num_free_blocks:
            chk._fail("free list", f"{s.stats().num_free_blocks} free blocks, {owed_total} owed, ids {free}")
        if len(seen) != s.stats().num_blocks:
            chk._fail("every block accounted for", f"{len(seen)} of {s.stats().num_blocks}")
