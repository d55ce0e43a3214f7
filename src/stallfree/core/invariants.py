"""An independent checker of the scheduler contract (docs/DESIGN.md section 1), step by step, under
either KV policy and every option.

Imports allowed: the standard library and stallfree.core only.

InvariantChecker wraps a Scheduler, forwards add / schedule / complete / abort to it and, after each
call, compares what it did with a shadow model of its own: plain lists scanned in full, token and block
counts, no step arithmetic shared with the scheduler. Before each plan is checked the shadow works out
on its own which decodes run (and, under paged KV, which need a block, who is preempted), the chunks and
the admissions, so a fault in the scheduler's bookkeeping cannot hide itself. It reads only the
scheduler's public, read-only views (request_state, prefix_cache, now, the counters, and the block
tables through core/queries.py's pure peek_block_table and peek_free_block_ids, which hand out no
promised ids: a run schedules the same with the checker as without it). This module holds the shadow and
the plan rules (budget, decodes, chunks, admission order, token counts, request states); the other rule
families are modules of their own, working on the same shadow: core/invariants_kv.py (`ReserveRules`:
reservations add up, tables hold the computed tokens; `PagedRules`: blocks cover the tokens, no block in
two tables, victims by the written rule), core/invariants_cache.py (`CacheRules`, prefix caching: each
block free-and-empty, evictable-cached, or held with a reference count equal to the tables holding it;
hits are the longest cached prefix and leave the last token to compute; no held block is evicted) and
core/invariants_multi.py (`MultiRules`, several partial prefills); the shadow state they share,
CheckerState, and InvariantViolation live in core/invariants_state.py, below all of them. It is meant
for tests and the simulator's --check mode; it costs O(running) per step.

Longer than the ~400-line guide: the shadow must work out every plan on its own (decodes and overflow,
blocks and victims, chunks, admissions), and these steps share its state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from stallfree.core.invariants_cache import CacheRules, block_table
from stallfree.core.invariants_fair import FairRules
from stallfree.core.invariants_kv import PagedRules, ReserveRules
from stallfree.core.invariants_lora import LoraRules
from stallfree.core.invariants_multi import MultiRules
from stallfree.core.invariants_state import CheckerState, InvariantViolation, _Shadow
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request, RequestStatus

__all__ = ["InvariantChecker", "InvariantViolation", "PagedInvariantChecker", "PagedInvariantViolation"]


@dataclass(slots=True)
class InvariantChecker(CheckerState):
    """Wrap `scheduler` and assert every invariant of the contract after each call and at the end.

    Rules: the plan equals the shadow's (decodes with their starts and tokens, chunks, admissions,
    preemptions); tokens <= the step's budget; running <= max_seqs; one partial prefill, block-aligned
    chunks when on; admission in queue order, stopping only at a head that does not fit; each request
    emits each token once and exactly max_new unless stopped or aborted; each episode prefills prompt_len
    + the tokens generated before it. Reserve: free KV == total - the reservations of the running;
    with a block_size, between steps each running request's table holds exactly the blocks of its
    computed tokens (never more than its reservation) and no block is in two tables.
    Paged: free + used blocks == num_blocks, each running request holds ceil(tokens in KV /
    block_size) blocks, no block in two tables, victims by the rule of Scheduler's docstring,
    recomputed tokens and preemptions add up. LoRA (max_loras): every plan and the running requests
    hold at most max_loras adapters, and admission passes over a request whose adapter cannot join
    at most max_lora_passes times (core/lora.py), as the shadow works out. At the end: nothing left,
    all KV returned.

    Block ids (read without materializing any table: a table's promised blocks are counted, not handed
    out) are checked after every `table_every`-th call.

    Attributes:
        scheduler: the Scheduler under test (either KV policy).
        table_every: check block ids (paged, and reserve with a block_size) after every n-th call
            (1: always).
        num_steps, num_requests, num_preemptions, max_preemptions_of_one, num_recomputed_tokens:
            what the run covered, as the shadow counted it.
        max_lora_passes_of_one: with max_loras, the most steps any request was passed over because
            its LoRA adapter could not join (never above max_lora_passes, a checked rule).

    Raises:
        InvariantViolation: from any call, when the scheduler broke a rule; the message names it.
    """

    # ------------------------------------------------------------------ read-only views (drop-in use)

    @property
    def last_finished(self) -> dict[Hashable, FinishReason]:
        """The scheduler's last_finished."""
        return self.scheduler.last_finished

    @property
    def kv_free(self) -> int:
        """The scheduler's free KV, tokens."""
        return self.scheduler.kv_free

    @property
    def kv_total(self) -> int:
        """The scheduler's KV capacity, tokens."""
        return self.scheduler.stats().kv_total

    @property
    def num_waiting(self) -> int:
        """The scheduler's waiting requests."""
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """The scheduler's running requests."""
        return self.scheduler.num_running

    def has_unfinished(self) -> bool:
        """The scheduler's has_unfinished()."""
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ forwarded calls

    def add(self, req: Request, *, front: bool = False) -> None:
        """Forward add(); on success, queue the request in the shadow (front=True: at the head, with an add
        order counting down from -1, so that it sorts before every request queued so far)."""
        if front is False:
            self.scheduler.add(req)
            order = self.num_requests
        else:
            self.scheduler.add(req, front=front)
            order = self._front_order
            self._front_order -= 1
        self._reqs[req.rid] = _Shadow(req, order, self.scheduler.step, target=req.prompt_len, limit=req.max_new)
        if FairRules.on(self):
            FairRules.lift(self, req.rid)
        if front:
            self._waiting.insert(0, req.rid)
        else:
            self._waiting.append(req.rid)
        self.num_requests += 1

    def stop_after(self, rid: Hashable, num_tokens: int) -> None:
        """Forward stop_after(); on success, the request must end with reason "stop" at that token."""
        self.scheduler.stop_after(rid, num_tokens)
        self._reqs[rid].limit = num_tokens

    def set_draft_tokens(self, rid: Hashable, num_drafts: int) -> None:
        """Forward set_draft_tokens(); a decode's drafts are remembered for the next plan."""
        self.scheduler.set_draft_tokens(rid, num_drafts)
        sh = self._reqs.get(rid)
        if sh is not None and rid in self._ready:
            if num_drafts:
                self._drafts[rid] = num_drafts
            else:
                self._drafts.pop(rid, None)

    def take_back(self, rid: Hashable, num_rejected: int) -> FinishReason | None:
        """Forward take_back(); the shadow settles the request's oldest provisional step: no more than
        that step's drafts are taken back, and a held decode whose last verdict takes nothing back ends."""
        sh = self._reqs.get(rid)
        reason = self.scheduler.take_back(rid, num_rejected)
        if sh is None:
            return reason
        if not sh.unsettled or not 0 <= num_rejected <= sh.unsettled[0]:
            self._fail("take back no more than scheduled", f"rid {rid!r}: {num_rejected} of {sh.unsettled}")
        held = sh.held
        sh.unsettled.pop(0)
        sh.generated -= num_rejected
        sh.drafted -= num_rejected
        sh.episode_drafted -= num_rejected
        if self._paged:
            sh.blocks = min(sh.blocks, self._blocks(sh.computed))
        ends = held and not num_rejected and not sh.unsettled
        why = FinishReason.LENGTH if sh.limit == sh.req.max_new else FinishReason.STOP
        if ends != (reason is not None) or (ends and (reason is not why or self.last_finished.get(rid) is not why)):
            self._fail("take_back finish", f"rid {rid!r}: returned {reason}, expected {why if ends else None}")
        if ends:
            self._end(rid)
        self._check_state()
        return reason

    def unsettled_drafts(self, rid: Hashable) -> tuple[int, ...]:
        """The scheduler's unsettled_drafts(), compared with the shadow's."""
        got = self.scheduler.unsettled_drafts(rid)
        if list(got) != self._reqs[rid].unsettled:
            self._fail("unsettled drafts", f"rid {rid!r}: {got}, shadow {self._reqs[rid].unsettled}")
        return got

    def abort(self, rid: Hashable) -> None:
        """Forward abort(); mirror it (deferred when the rid is in the plan in flight)."""
        self.scheduler.abort(rid)
        if rid not in self._reqs:
            return
        if self._plan is not None and self._in_plan(rid, self._plan):
            self._aborted_in_flight.add(rid)
            return
        self._end(rid)
        self._check_state(scheduled=self._plan)

    def schedule(
        self, token_budget: int | None = None, *, admit: bool | Callable[[Hashable], bool] = True,
        chunk_cap: Callable[[Hashable, int, int], int] | None = None,
    ) -> StepPlan:
        """Forward schedule() and compare the plan with the shadow's own; the chunk cap's answers are
        recorded on the way, and every chunk must have been offered to it and stay within its answer.
        An admission filter's answers are recorded too: the shadow admits in queue order passing over
        the rids it refused, and every waiting request must have been asked once."""
        s = self.scheduler
        if self._caching:
            CacheRules.snapshot(self)
        caps: dict[tuple[Hashable, int, int], int] | None = None
        self._refused = frozenset()
        if admit is True and chunk_cap is None:
            plan = s.schedule() if token_budget is None else s.schedule(token_budget)
        else:
            cap = chunk_cap
            if callable(chunk_cap):
                caps = {}
                user = chunk_cap

                def cap(rid: Hashable, start: int, n: int) -> int:
                    m = user(rid, start, n)
                    caps[(rid, start, n)] = m
                    return m

            flt: bool | Callable[[Hashable], bool] = admit
            answers: dict[Hashable, object] = {}
            if callable(admit):
                pred = admit

                def flt(rid: Hashable) -> bool:
                    ok = pred(rid)
                    answers[rid] = ok
                    return ok

            plan = s.schedule(token_budget, admit=flt, chunk_cap=cap)
            if callable(admit) and set(answers) != set(self._waiting):
                self._fail("admission filter asked once per waiting request",
                           f"asked {sorted(map(repr, answers))}, waiting {sorted(map(repr, self._waiting))}")
            self._refused = frozenset(r for r, ok in answers.items() if ok is False)
        self._admitting, self._caps = admit is not False, caps
        self._plan = plan
        self._check_plan(plan)
        self._check_state(scheduled=plan)
        return plan

    def complete(
        self,
        plan: StepPlan,
        stopped: Iterable[Hashable] = (),
        num_accepted: Mapping[Hashable, int] | None = None,
    ) -> tuple[Hashable, ...]:
        """Forward complete() and check what was emitted and finished."""
        stopped = tuple(stopped)
        emitted = self.scheduler.complete(plan, stopped, num_accepted)
        shed = {r for r, why in self.scheduler.last_finished.items() if why is FinishReason.TIMEOUT}
        if shed != set(plan.timed_out):
            self._fail("timed-out requests finish with reason timeout", f"{shed} != {set(plan.timed_out)}")
        self._plan = None
        self._apply(plan, set(stopped), emitted, num_accepted or {})
        self.num_steps += 1
        self._check_state()
        return emitted

    def check_final(self) -> None:
        """Assert that nothing is left and all KV is returned."""
        s = self.scheduler
        if s.has_unfinished() or s.num_running or s.num_waiting or self._reqs:
            self._fail("final", f"{s.num_running} running, {s.num_waiting} waiting, {len(self._reqs)} in shadow")
        if s.kv_free != s.stats().kv_total:
            self._fail("final KV returned", f"kv_free {s.kv_free} != kv_total {s.stats().kv_total}")
        if self._paged and s.stats().num_free_blocks != s.stats().num_blocks:
            self._fail("final blocks returned", f"{s.stats().num_free_blocks} of {s.stats().num_blocks} free")

    # ------------------------------------------------------------------ the shadow's plan

    def _in_plan(self, rid: Hashable, plan: StepPlan) -> bool:
        return rid in plan.decode_rids or any(c.rid == rid for c in plan.prefills)

    def _decode_cost(self, rid: Hashable, budget: int) -> int:
        sh = self._reqs[rid]
        return 1 + min(self.scheduler.config.num_spec_tokens, budget - 1, sh.limit - sh.generated - 1)

    def _check_plan(self, plan: StepPlan) -> None:
        """Work out the step from the rules, compare, and move the shadow to the scheduled state."""
        s = self.scheduler
        entries = list(plan)
        total = sum(c.num_tokens for c in entries)
        if total != plan.num_tokens or any(c.num_tokens < 1 for c in entries):
            self._fail("plan total", f"entries {entries} sum to {total}, plan says {plan.num_tokens}")
        if total > plan.token_budget or plan.token_budget > s.config.token_budget:
            self._fail("budget", f"{total} tokens, step budget {plan.token_budget}, {s.config.token_budget} configured")
        FairRules.timeouts(self, plan)
        self._partial_waits = False
        oldest = self._running[0] if self._running else None
        budget = plan.token_budget
        reqs = self._reqs
        held = [r for r in self._ready if reqs[r].held]
        ready = [r for r in self._ready if not reqs[r].held] if held else self._ready
        drafts, self._drafts = self._drafts, {}  # consumed by this schedule()
        costs = {rid: self._decode_cost(rid, budget) for rid in ready}
        chosen = self._chosen_decodes(plan, costs, ready)
        victims: list[Hashable] = []
        free = s.stats().num_blocks - sum(self._reqs[r].blocks for r in self._running) if self._paged else 0
        if self._caching:
            free = self._pre_free  # shared blocks: counted from the tables, checked after each call
        if self._paged:
            # Decodes take their blocks during schedule(): allocated with speculative tokens or when they
            # overflow the budget, else promised (ids handed out when a table is read); either way a block
            # that is not free-and-empty is evicted then.
            free = PagedRules.grow_decodes(self, chosen, costs, free, victims, self._caching)
        decodes = tuple(r for r in chosen if self._reqs[r].running)
        if plan.decode_rids != decodes:
            self._fail("decodes", f"got {plan.decode_rids}, expected {decodes}")
        if drafts:
            free = self._grant_drafts(decodes, drafts, costs, budget, free)
        for c in plan.decodes:
            sh = self._reqs[c.rid]
            if not 1 <= c.num_tokens <= 1 + max(drafts.get(c.rid, 0), s.config.num_spec_tokens) or (
                    sh.generated + c.num_tokens > sh.limit):
                self._fail("a decode's tokens: 1 + drafts <= 1 + k, never past its last token",
                           f"{c}: k = {drafts.get(c.rid, 0)}, generated {sh.generated} of {sh.limit}")
            if c.start != sh.req.prompt_len + sh.generated - 1 or c.num_tokens != costs[c.rid] or c.is_prefill:
                self._fail("decode entry", f"{c} for prompt {sh.req.prompt_len}, generated {sh.generated}")
        if sum(c.start for c in plan.decodes) != plan.decode_context_sum:
            self._fail("decode context sum", f"{plan.decode_context_sum}")
        left = budget - sum(costs[r] for r in decodes)
        self._prefill_start = (budget - left, left)  # the step's decode tokens, its budget for prompt chunks
        fair = FairRules.on(self)
        if fair:
            FairRules.charge_plan(self, plan, after_admission=False)
        if s.config.max_num_partial_prefills > 1:
            chunks, admitted = MultiRules.prefills(self, left, free, victims, bool(decodes))
        else:
            head = FairRules.set_aside(self, left) if fair and not victims else None
            if head is None:
                chunks, left, free = self._partial_chunk(left, free, victims)
                admitted = self._admissions(left, free, chunks) if not victims and self._admitting else []
            else:
                chunks, admitted, free = self._beside_partial(head, left, free, victims)
        if victims:
            self._waiting.extend(victims)
        if fair:
            FairRules.charge_plan(self, plan, after_admission=True)
        got = [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills]
        if got != chunks:
            self._fail("prefill chunks (rid, tokens, start, is_last)", f"got {got}, expected {chunks}")
        if self._caching and not victims:
            CacheRules.check_evictions(self)
        expected_victims = tuple(sorted(victims, key=lambda r: self._reqs[r].order))
        if plan.admitted != tuple(admitted) or plan.preempted != expected_victims:
            self._fail("admitted / preempted", f"got {plan.admitted} / {plan.preempted}, expected "
                       f"{tuple(admitted)} / {expected_victims}")
        caps = self._caps
        if caps is not None:
            for c in plan.prefills:
                allowed = [m for (rid, start, _n), m in caps.items() if rid == c.rid and start == c.start]
                if not allowed or c.num_tokens > max(allowed):
                    self._fail("chunk within its cap", f"{c}, chunk_cap answered {allowed}")
        LoraRules.check_plan(self, entries)
        b = s.config.block_size if s.config.chunks_aligned else None
        for c in plan.prefills:
            if b and not c.is_last and (c.start + c.num_tokens) % b:
                self._fail("block-aligned chunk", f"{c} does not end on a multiple of {b}")
        partials = [c for c in plan.prefills if not c.is_last]
        if s.config.max_num_partial_prefills > 1:
            MultiRules.check_counts(self, plan)
        elif len(partials) > 1 or (partials and partials[-1] is not plan.prefills[-1]):
            self._fail("one partial prefill", f"{plan.prefills}")
        # A set-aside head alone in its step (tenant_chunk_tokens) leaves the partial prefill for one step.
        if oldest is not None and self._reqs[oldest].running and not self._in_plan(oldest, plan) and (
                not self._partial_waits) and (
                s.config.max_num_partial_prefills == 1 and self._paged and len(self._ready) <= budget
                and not s.config.num_spec_tokens and not s.config.chunks_aligned and not self._reqs[oldest].held):
            self._fail("the oldest running request progresses", f"{oldest!r} not in {entries}")

    def _grant_drafts(
        self, decodes: tuple[Hashable, ...], drafts: dict[Hashable, int], costs: dict[Hashable, int], budget: int,
        free: int,
    ) -> int:
        """The draft rule in the shadow: after every decode's one token, each decode in batch order gets
        min(its drafts, the budget left, limit - generated - 1) drafts, fewer while their blocks are not
        free (drafts never preempt); returns the free blocks left."""
        left = budget - sum(costs[r] for r in decodes)
        for rid in decodes:
            k = drafts.get(rid, 0)
            if not k or left <= 0:
                continue
            sh = self._reqs[rid]
            d = min(k, left, sh.limit - sh.generated - 1)
            if self._paged:
                while d > 0 and self._blocks(sh.computed + 1 + d) - sh.blocks > free:
                    d -= 1
                need = max(self._blocks(sh.computed + 1 + d) - sh.blocks, 0) if d > 0 else 0
                free -= need
                sh.blocks += need
                CacheRules.take(self, need)
            if d > 0:
                costs[rid] += d
                left -= d
        return free

    def _chosen_decodes(
        self, plan: StepPlan, costs: dict[Hashable, int], ready: list[Hashable] | None = None
    ) -> list[Hashable]:
        """The decodes that run: every ready one (not held) when they fit, else the overflow rule's choice."""
        s = self.scheduler
        budget = plan.token_budget
        if ready is None:
            ready = self._ready
        if sum(costs.values()) <= budget:
            return list(ready)
        if s.config.policy == "priority":
            order = sorted(ready, key=self._key)
        elif s.config.decode_overflow == "rotate":
            chosen = plan.decode_rids
            if not chosen:
                self._fail("rotate serves someone", "no decode chosen")
            # The served ones are a cyclic run of the ready list (in admission order): it starts at the
            # chosen decode whose predecessor in the cycle was not chosen.
            picked = set(chosen)
            starts = [r for r in chosen if r in costs and ready[ready.index(r) - 1] not in picked]
            i = ready.index(starts[0] if starts else chosen[0]) if chosen[0] in costs else 0
            order = ready[i:] + ready[:i]
        else:
            order = list(ready)
        expected: list[Hashable] = []
        used = 0
        for rid in order:
            if used + costs[rid] > budget:
                break
            expected.append(rid)
            used += costs[rid]
        if s.config.policy == "priority":
            return expected  # in priority order, as the selection hands them out
        picked = set(expected)
        return [r for r in ready if r in picked]

    def _preempt(self, rid: Hashable, victims: list[Hashable]) -> None:
        sh = self._reqs[rid]
        victims.append(rid)
        self._running.remove(rid)
        if rid in self._ready:
            self._ready.remove(rid)
        if self._partial == rid:
            self._partial = None
        sh.running = False
        sh.blocks = 0
        sh.hit = 0
        sh.prefilled = 0
        sh.target = sh.req.prompt_len + sh.generated
        sh.preemptions += 1
        sh.episode_decodes = 0
        sh.episode_drafted = 0
        sh.unsettled = []
        self.num_preemptions += 1
        self.max_preemptions_of_one = max(self.max_preemptions_of_one, sh.preemptions)

    def _partial_chunk(
        self, left: int, free: int, victims: list[Hashable]
    ) -> tuple[list[tuple[Hashable, int, int, bool]], int, int]:
        """Contract step 2 in the shadow: the partial prefill's chunk (paged: with its blocks)."""
        chunks: list[tuple[Hashable, int, int, bool]] = []
        rid = self._partial
        if rid is None or left <= 0:
            return chunks, left, free
        sh = self._reqs[rid]
        rest = sh.target - sh.prefilled
        n = self._chunk(rest, FairRules.limit(self, rid, left))
        if n:
            n = self._capped(rid, sh.prefilled, n)
        if n and self._paged:
            need = self._blocks(sh.prefilled + n) - sh.blocks
            if need > free:
                if self._victim_for(rid) != rid and not FairRules.on(self):  # vtc: beside-admitted ones stay
                    self._fail("the partial prefill is the newest running", f"{rid!r} in {self._running}")
                self._preempt(rid, victims)
                return chunks, left, free
            free -= need
            sh.blocks += need
            CacheRules.take(self, need)
        if n:
            chunks.append((rid, n, sh.prefilled, n == rest))
        return chunks, (left - n if n == rest else 0), free

    def _queue_order(self) -> list[Hashable]:
        """CheckerState's queue order; under fairness="vtc" the order at the current counters."""
        if FairRules.on(self):
            return FairRules.static_order(self)
        return CheckerState._queue_order(self)  # slots dataclass: no zero-argument super()

    def _admission_order(self) -> Iterator[Hashable]:
        """The waiting rids admission tries, one at a time: under fairness="vtc" each pick worked out from the
        counters when asked (the caller charges each admission with FairRules.charge before the next)."""
        if FairRules.on(self):
            return FairRules.picks(self)
        return CheckerState._admission_order(self)

    def _beside_partial(
        self, head: Hashable, left: int, free: int, victims: list[Hashable]
    ) -> tuple[list[tuple[Hashable, int, int, bool]], list[Hashable], int]:
        """fairness="vtc": a less-served tenant's head set aside beside the partial prefill
        (stallfree.core.fairness.FairOnePartialPrefill): the partial prefill's chunk from the budget left
        without the head's prompt, then the head if the KV admits it, then (if the partial prefill finished)
        admission as usual."""
        s = self.scheduler
        sh = self._reqs[head]
        whole = sh.target
        if s.config.tenant_chunk_tokens is not None:
            return self._head_alone(head, left, free, victims)
        chunks, rest, free = self._partial_chunk(left - whole, free, victims)
        if victims:
            return chunks, [], free
        done = bool(chunks) and chunks[-1][3]
        hits = CacheRules.hits(self, sh) if self._caching else []
        start = len(hits) * (s.config.block_size or 1)
        n = whole - start
        reserved = sum(s.kv_manager.kv_needed_for(self._reqs[r].req) for r in self._running) if not self._paged else 0
        fits, free, _ = self._admit_shadow(head, sh, hits, start, n, free, reserved, self._pinned)
        if not fits:
            return chunks, (self._admissions(rest + whole, free, chunks) if done else []), free
        chunks.insert(0, (head, n, start, True))
        FairRules.charge(self, head, n)
        return chunks, [head, *(self._admissions(rest + start, free, chunks) if done else [])], free

    def _head_alone(
        self, head: Hashable, left: int, free: int, victims: list[Hashable]
    ) -> tuple[list[tuple[Hashable, int, int, bool]], list[Hashable], int]:
        """With tenant_chunk_tokens: the set-aside head's whole prompt is the step's only chunk (the partial
        prefill takes none); if the KV does not admit it, the step as without the set-aside."""
        s = self.scheduler
        sh = self._reqs[head]
        hits = CacheRules.hits(self, sh) if self._caching else []
        start = len(hits) * (s.config.block_size or 1)
        n = sh.target - start
        reserved = sum(s.kv_manager.kv_needed_for(self._reqs[r].req) for r in self._running) if not self._paged else 0
        fits, free, _ = self._admit_shadow(head, sh, hits, start, n, free, reserved, self._pinned)
        if not fits:
            chunks, left, free = self._partial_chunk(left, free, victims)
            return chunks, (self._admissions(left, free, chunks) if not victims else []), free
        FairRules.charge(self, head, n)
        self._partial_waits = True
        return [(head, n, start, True)], [head], free

    def _admissions(self, left: int, free: int, chunks: list[tuple[Hashable, int, int, bool]]) -> list[Hashable]:
        """Contract step 3 in the shadow: the queue's head while it fits."""
        s = self.scheduler
        admitted: list[Hashable] = []
        reserved = sum(s.kv_manager.kv_needed_for(self._reqs[r].req) for r in self._running) if not self._paged else 0
        pinned = self._pinned
        passed: list[Hashable] = []
        fair = FairRules.on(self)
        for rid in self._admission_order():
            sh = self._reqs[rid]
            if left <= 0 or len(self._running) >= s.config.max_seqs:
                break
            rule = self._lora_rule(rid)
            if rule == "stop":
                break
            if rule == "pass":
                passed.append(rid)
                continue
            hits = CacheRules.hits(self, sh) if self._caching else []
            h = len(hits)
            start = h * (s.config.block_size or 1)
            n = self._chunk(sh.target - start, FairRules.limit(self, rid, left))
            if n == 0:
                break
            n = self._capped(rid, start, n)
            if n == 0:
                break
            fits, free, reserved = self._admit_shadow(rid, sh, hits, start, n, free, reserved, pinned)
            if not fits:
                break
            passed = self._lora_passed(passed)
            chunks.append((rid, n, start, n == sh.target - start))
            admitted.append(rid)
            if fair:
                FairRules.charge(self, rid, n)
            left = left - n if n == sh.target - start else 0
        return admitted

    # ------------------------------------------------------------------ state checks

    def _admit_shadow(
        self, rid: Hashable, sh: _Shadow, hits: list[int], start: int, n: int, free: int, reserved: int,
        pinned: set[int],
    ) -> tuple[bool, int, int]:
        """Admit `rid` into the shadow with a first chunk of `n` tokens from token `start` (after its `hits`)
        if the KV allows; returns (admitted, free blocks left, reserved tokens). Paged: the hit blocks are
        not allocated, but pinning one that was evictable takes it from the free count, and the watermark
        holds while anything runs. Reserve: the whole prompt + max_new must fit."""
        s = self.scheduler
        h = len(hits)
        if self._paged:
            pin = sum(1 for b in hits if b in self._pre_evictable and b not in pinned)
            want = (self._blocks(sh.target) if sh.preemptions else self._blocks(start + n)) - h + pin
            if want > free or (self._running and free - want < s.stats().watermark_blocks):
                return False, free, reserved
            free -= self._blocks(start + n) - h + pin
            sh.blocks = self._blocks(start + n)
            sh.hit = h
            sh.prefilled = start
            pinned.update(hits)  # pinned first, then the blocks after the hit are taken
            CacheRules.take(self, sh.blocks - h)
        else:
            if reserved + s.kv_manager.kv_needed_for(sh.req) > s.stats().kv_total:
                return False, free, reserved
            reserved += s.kv_manager.kv_needed_for(sh.req)
        self._waiting.remove(rid)
        self._running.append(rid)
        sh.running = True
        return True, free, reserved

    def _check_state(self, scheduled: StepPlan | None = None) -> None:
        """Counts, KV and per-request state; `scheduled`: the KV also covers that plan's tokens."""
        s = self.scheduler
        reqs = self._reqs
        self._calls += 1
        if len(self._running) != s.num_running or len(self._waiting) != s.num_waiting:
            self._fail("counts", f"scheduler {s.num_running} running / {s.num_waiting} waiting, shadow "
                       f"{len(self._running)} / {len(self._waiting)}")
        if len(self._running) > s.config.max_seqs:
            self._fail("slots", f"{len(self._running)} running > max_seqs {s.config.max_seqs}")
        if self._paged:
            PagedRules.check(self, scheduled)
        else:
            ReserveRules.check(self, scheduled)
        LoraRules.check_running(self)
        for rid in self._running:
            sh = reqs[rid]
            st = s.request_state(rid)
            decoding = sh.prefilled == sh.target
            if st.num_preemptions != sh.preemptions or st.num_generated != sh.generated or (
                    st.status is not (RequestStatus.DECODING if decoding else RequestStatus.PREFILLING)):
                self._fail("running state", f"{st}, shadow {sh}")
        if FairRules.on(self):
            FairRules.check_counters(self)
        if s.stats().num_preemptions != self.num_preemptions:
            self._fail("preemption count", f"scheduler {s.stats().num_preemptions}, shadow {self.num_preemptions}")
        in_flight = sum(c.num_tokens for c in scheduled.prefills if reqs[c.rid].preemptions) if scheduled else 0
        recomputed = s.stats().num_recomputed_tokens
        if recomputed != self.num_recomputed_tokens + in_flight:
            self._fail("recomputed tokens", f"scheduler {recomputed}, shadow {self.num_recomputed_tokens}")
        # The head of the queue and every preempted request (few); checking all waiting would be O(queue).
        queue = self._waiting
        for rid in queue:
            sh = reqs[rid]
            if sh.preemptions or rid == queue[0]:
                st = s.request_state(rid)
                want = RequestStatus.PREEMPTED if sh.preemptions else RequestStatus.WAITING
                if (st.status is not want or st.num_preemptions != sh.preemptions or st.num_prefilled
                        or st.num_generated != sh.generated or (self._paged and block_table(s, rid))):
                    self._fail("waiting state", f"{st}")

    def _apply(
        self, plan: StepPlan, stopped: set[Hashable], emitted: tuple[Hashable, ...], accepted: Mapping[Hashable, int]
    ) -> None:
        reqs = self._reqs
        aborted = self._aborted_in_flight
        sampled: list[Hashable] = list(plan.decode_rids)
        spec = self.scheduler.config.num_spec_tokens
        tokens = plan.decode_tokens or (1,) * plan.num_decodes
        for rid, cost in zip(plan.decode_rids, tokens, strict=True):
            sh = reqs[rid]
            if rid in accepted:
                n = accepted[rid]
            elif cost > 1 and not spec:  # drafts without a verdict: provisional until take_back()
                n = cost
                sh.unsettled.append(cost - 1)
            else:
                n = 1
            sh.generated += n
            if not spec:
                sh.drafted += n - 1
                sh.episode_drafted += n - 1
            sh.episode_decodes += 1
            if self._paged:
                sh.blocks = min(sh.blocks, self._blocks(sh.computed))  # rejected speculative tokens
        for c in plan.prefills:
            sh = reqs[c.rid]
            sh.prefilled += c.num_tokens
            if sh.preemptions:
                self.num_recomputed_tokens += c.num_tokens
            if c.is_last:
                if sh.generated != sh.target - sh.req.prompt_len:
                    self._fail("recompute covers prompt + generated", f"rid {c.rid!r}: {sh}")
                sh.generated += 1
                sampled.append(c.rid)
                self._ready.append(c.rid)
                if self._partial == c.rid:
                    self._partial = None
            else:
                self._partial = c.rid
        expected = tuple(r for r in sampled if r not in aborted)
        if emitted != expected:
            self._fail("emitted", f"got {emitted}, expected {expected}")
        for rid in emitted:
            reqs[rid].emitted += 1
        finished = self.scheduler.last_finished
        for rid in sampled:
            sh = reqs[rid]
            if not spec and sh.emitted + sh.drafted != sh.generated - (rid in aborted):
                self._fail("each token emitted once", f"rid {rid!r}: {sh.emitted} emitted + {sh.drafted} drafts, "
                           f"{sh.generated} generated")
            early = rid in aborted or rid in stopped
            if sh.held and not early:
                if rid in finished:
                    self._fail("a decode with unsettled drafts waits for them", f"rid {rid!r} finished: {sh}")
                continue
            if sh.generated >= sh.limit and not early:
                gen0 = sh.target - sh.req.prompt_len
                if sh.generated != sh.limit or sh.prefilled != sh.target or (
                        not spec and gen0 + 1 + sh.episode_decodes + sh.episode_drafted != sh.limit):
                    self._fail("exact tokens", f"rid {rid!r}: {sh}")
                why = FinishReason.LENGTH if sh.limit == sh.req.max_new else FinishReason.STOP
                if rid not in aborted and finished.get(rid) is not why:
                    self._fail("finish reason", f"rid {rid!r}: {finished.get(rid)}, expected {why}")
            done = early or sh.generated >= sh.limit
            if done != (rid in finished):
                self._fail("finish", f"rid {rid!r} done={done}, scheduler {finished.get(rid)}")
            if done:
                self._end(rid)
        for rid in aborted:
            if rid in reqs:
                self._end(rid)
        self._aborted_in_flight = set()

    def _end(self, rid: Hashable) -> None:
        self._drafts.pop(rid, None)
        sh = self._reqs.pop(rid)
        if sh.running:
            self._running.remove(rid)
        else:
            self._waiting.remove(rid)
        if rid in self._ready:
            self._ready.remove(rid)
        if self._partial == rid:
            self._partial = None


#: The paged checker's former names: the one checker checks both KV policies.
PagedInvariantChecker = InvariantChecker
PagedInvariantViolation = InvariantViolation
