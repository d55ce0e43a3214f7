"""The invariant checker's partial-prefill rules (max_num_partial_prefills > 1): the shadow works out
the K/L/T step on its own (partial prefills in order, admissions with the long-prompt limit, the top-up)
and checks the counts of partial and long prompts.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from stallfree.core.invariants_cache import CacheRules
from stallfree.core.plan import StepPlan

if TYPE_CHECKING:
    from stallfree.core.invariants_state import CheckerState

__all__ = ["MultiRules"]


class MultiRules:
    """The partial-prefill options' part of the checker (max_num_partial_prefills = K > 1): the step's
    prefill chunks and admissions worked out from the rule in docs/scheduling.md, and the counts."""

    @staticmethod
    def prefills(
        chk: CheckerState, left: int, free: int, victims: list[Hashable], decoding: bool
    ) -> tuple[list[tuple[Hashable, int, int, bool]], list[Hashable]]:
        """The chunks (rid, tokens, start, is_last) and admissions of a step with `left` tokens after
        decodes; `decoding`: the step has decodes, so the budget left tops up short prompts only."""
        s = chk.scheduler
        reqs = chk._reqs
        thr = s.config.partial_prefill_limits[2]
        assert thr is not None
        running = chk._running
        partials = [r for r in running if reqs[r].prefilled < reqs[r].target]
        if s.config.policy == "priority":
            partials.sort(key=chk._key)
        rows: list[list[Any]] = []
        num_partial = num_long = 0
        for rid in partials:
            sh = reqs[rid]
            if not sh.running:
                continue
            rest = sh.target - sh.prefilled
            n = chk._chunk(rest, min(left, thr) if rest > thr else left) if left > 0 else 0
            if n:
                n = chk._capped(rid, sh.prefilled, n)
            if n and chk._paged:
                need = chk._blocks(sh.prefilled + n) - sh.blocks
                while need > free:
                    later = [r for r in partials if reqs[r].running and running.index(r) > running.index(rid)]
                    if not later:
                        n = 0
                        break
                    if s.config.policy == "priority":
                        victim = max(later, key=lambda r: (chk._key(r)[0], running.index(r)))
                    else:
                        victim = max(later, key=running.index)
                    free += CacheRules.freed_by(chk, victim) if chk._caching else reqs[victim].blocks
                    chk._preempt(victim, victims)
                if n:
                    free -= max(need, 0)
                    sh.blocks += max(need, 0)
                    CacheRules.take(chk, need)
            if n:
                rows.append([rid, n, sh.prefilled, n == rest])
                left -= n
            if n != rest:
                num_partial += 1
                num_long += rest > thr
        if victims:
            return [tuple(r) for r in rows if reqs[r[0]].running], []
        admitted: list[Hashable] = []
        if chk._admitting:
            admitted, left, free = MultiRules.admissions(chk, left, free, rows, num_partial, num_long)
        for row in rows:  # the budget left goes back to the unfinished chunks, in order
            if left <= 0:
                break
            if row[3]:
                continue
            sh = reqs[row[0]]
            if decoding and sh.target - row[2] > thr:
                continue  # with decodes in the step, a long prompt's chunk stays <= T
            end = row[2] + row[1]
            rest = sh.target - end
            n = chk._chunk(rest, left)
            if n and chk._caps is not None:
                n = max(chk._capped(row[0], row[2], row[1] + n) - row[1], 0)
            if n == 0:
                break
            if chk._paged:
                need = chk._blocks(end + n) - sh.blocks
                if need > free:
                    break
                free -= max(need, 0)
                sh.blocks += max(need, 0)
                CacheRules.take(chk, need)
            row[1] += n
            row[3] = n == rest
            left -= n
            if n != rest:
                break
        return [tuple(r) for r in rows], admitted

    @staticmethod
    def admissions(
        chk: CheckerState, left: int, free: int, rows: list[list[Any]], num_partial: int, num_long: int
    ) -> tuple[list[Hashable], int, int]:
        """Admission in queue order; a long head is passed only while L long prompts are partial."""
        s = chk.scheduler
        thr = s.config.partial_prefill_limits[2]
        assert thr is not None
        admitted: list[Hashable] = []
        reserved = sum(s.kv_manager.kv_needed_for(chk._reqs[r].req) for r in chk._running) if not chk._paged else 0
        bs = s.config.block_size or 1
        pinned = chk._pinned
        for rid in MultiRules.queue_order(chk):
            sh = chk._reqs[rid]
            if left <= 0 or len(chk._running) >= s.config.max_seqs:
                break
            hits = CacheRules.hits(chk, sh) if chk._caching else []
            h = len(hits)
            start = h * bs
            rest = sh.target - start
            is_long = rest > thr
            if is_long and num_long >= s.config.partial_prefill_limits[1]:
                continue
            n = chk._chunk(rest, min(left, thr) if is_long else left)
            if n:
                n = chk._capped(rid, start, n)
            last = n == rest
            if n == 0 or (not last and num_partial >= s.config.max_num_partial_prefills):
                break
            fits, free, reserved = chk._admit_shadow(rid, sh, hits, start, n, free, reserved, pinned)
            if not fits:
                break
            rows.append([rid, n, start, last])
            admitted.append(rid)
            if not last:
                num_partial += 1
                num_long += is_long
            left = left - n if last or is_long else 0
        return admitted, left, free

    @staticmethod
    def queue_order(chk: CheckerState) -> list[Hashable]:
        """Priority: by key; FCFS: preempted requests and those queued with add(front=True) first (they go to
        the front), then add order."""
        if chk.scheduler.config.policy == "priority":
            return chk._queue_order()
        reqs = chk._reqs
        refused = chk._refused
        return sorted((r for r in chk._waiting if r not in refused),
                      key=lambda r: (not (reqs[r].preemptions or reqs[r].order < 0), reqs[r].order))

    @staticmethod
    def check_counts(chk: CheckerState, plan: StepPlan) -> None:
        """After the step: at most K prompts partially prefilled; a long chunk in the partial phase <= T."""
        s = chk.scheduler
        reqs = chk._reqs
        partial = [r for r in chk._running if reqs[r].prefilled < reqs[r].target]
        done = {c.rid for c in plan.prefills if c.is_last}
        still = [r for r in partial if r not in done]
        if len(still) > s.config.max_num_partial_prefills:
            chk._fail("at most K partial prefills", f"{still} > {s.config.max_num_partial_prefills}")
