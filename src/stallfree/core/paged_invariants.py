"""An independent checker of the paged scheduler's contract, step by step.

Imports allowed: the standard library and stallfree.core only.

PagedInvariantChecker wraps a PagedScheduler, forwards add / schedule / complete / abort to it and,
after each call, compares what it did with a shadow model of its own: plain lists scanned in full,
block counts instead of block ids, no step arithmetic shared with the scheduler. Before each plan is
checked the shadow works out on its own which decodes need a block, who is preempted and who is
admitted, so a fault in the scheduler's bookkeeping cannot hide itself. For tests and the
simulator's --check mode; it costs O(running) per step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from stallfree.core.paged import PagedScheduler
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request, RequestStatus

__all__ = ["PagedInvariantChecker", "PagedInvariantViolation"]


class PagedInvariantViolation(AssertionError):
    """The paged scheduler broke a contract invariant; the message names the step, rule and values."""


@dataclass(slots=True)
class _Shadow:
    req: Request
    prefilled: int = 0  # in the current episode
    target: int = 0  # tokens the current episode prefills: prompt_len + gen0
    generated: int = 0  # tokens emitted so far, over all episodes
    blocks: int = 0
    running: bool = False
    preemptions: int = 0
    episode_decodes: int = 0
    prefill_tokens: int = 0  # over all episodes
    emitted: int = 0  # times the rid appeared in complete()'s return value
    order: int = 0  # position in add() order

    @property
    def computed(self) -> int:
        """Tokens whose KV is in the cache."""
        if self.prefilled < self.target:
            return self.prefilled
        return self.req.prompt_len + self.generated - 1


@dataclass(slots=True)
class PagedInvariantChecker:
    """Wrap `scheduler` and assert every paged invariant after each call and at the end.

    Rules checked: the plan equals the shadow's (decodes with their starts, chunks, admissions,
    preemptions); tokens <= budget; running <= max_seqs; victims are the newest running and the queue
    stays in add() order; free + used blocks == num_blocks, no block in two tables, each running
    request holds ceil(tokens in KV / block_size) blocks; each request emits each token once and
    exactly max_new unless stopped or aborted; each episode prefills exactly prompt_len + the tokens
    generated before it; recomputed tokens and preemptions add up; all blocks free at the end.

    Block counts are checked after every call; block ids (which materializes every table, see
    PagedScheduler) after every `table_every`-th call, so that the scheduler's lazy path, a table
    lagging several promised blocks behind, is exercised too.

    Attributes:
        scheduler: the PagedScheduler under test.
        table_every: check block ids after every n-th call (1: always).
        num_steps, num_requests, num_preemptions, max_preemptions_of_one, num_recomputed_tokens:
            what the run covered, as the shadow counted it.

    Raises:
        PagedInvariantViolation: from any call, when the scheduler broke a rule; the message names it.
    """

    scheduler: PagedScheduler
    table_every: int = 1
    num_steps: int = 0
    num_requests: int = 0
    num_preemptions: int = 0
    max_preemptions_of_one: int = 0
    num_recomputed_tokens: int = 0
    _reqs: dict[Hashable, _Shadow] = field(default_factory=dict)
    _waiting: list[Hashable] = field(default_factory=list)
    _running: list[Hashable] = field(default_factory=list)  # admission order
    _plan: StepPlan | None = None
    _aborted_in_flight: set[Hashable] = field(default_factory=set)
    _calls: int = 0

    def _fail(self, rule: str, detail: str) -> None:
        raise PagedInvariantViolation(f"step {self.scheduler.step}: {rule}: {detail}")

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
        return self.scheduler.kv_total

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

    def add(self, req: Request) -> None:
        """Forward add(); on success, append the request to the shadow queue."""
        self.scheduler.add(req)
        self._reqs[req.rid] = _Shadow(req, target=req.prompt_len, order=self.num_requests)
        self._waiting.append(req.rid)
        self.num_requests += 1

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

    def schedule(self) -> StepPlan:
        """Forward schedule() and compare the plan with the shadow's own."""
        plan = self.scheduler.schedule()
        self._plan = plan
        self._check_plan(plan)
        self._check_state(scheduled=plan)
        return plan

    def complete(self, plan: StepPlan, stopped: Iterable[Hashable] = ()) -> tuple[Hashable, ...]:
        """Forward complete() and check what was emitted and finished."""
        stopped = tuple(stopped)
        emitted = self.scheduler.complete(plan, stopped)
        self._plan = None
        self._apply(plan, set(stopped), emitted)
        self.num_steps += 1
        self._check_state()
        return emitted

    def check_final(self) -> None:
        """Assert that nothing is left and every block is free."""
        s = self.scheduler
        if s.has_unfinished() or s.num_running or s.num_waiting or self._reqs:
            self._fail("final", f"{s.num_running} running, {s.num_waiting} waiting, {len(self._reqs)} in shadow")
        if s.num_free_blocks != s.num_blocks or s.kv_free != s.kv_total:
            self._fail("final blocks returned", f"{s.num_free_blocks} of {s.num_blocks} free")

    # ------------------------------------------------------------------ the shadow's plan

    def _in_plan(self, rid: Hashable, plan: StepPlan) -> bool:
        return rid in plan.decode_rids or any(c.rid == rid for c in plan.prefills)

    def _blocks(self, tokens: int) -> int:
        bs = self.scheduler.block_size
        return (tokens + bs - 1) // bs

    def _preempt(self, rid: Hashable, victims: list[Hashable]) -> None:
        sh = self._reqs[rid]
        victims.append(rid)
        self._running.remove(rid)
        sh.running = False
        sh.blocks = 0
        sh.prefilled = 0
        sh.target = sh.req.prompt_len + sh.generated
        sh.preemptions += 1
        sh.episode_decodes = 0
        self.num_preemptions += 1
        self.max_preemptions_of_one = max(self.max_preemptions_of_one, sh.preemptions)

    def _check_plan(self, plan: StepPlan) -> None:
        """Work out the step from the rules, compare, and move the shadow to the scheduled state."""
        s = self.scheduler
        reqs = self._reqs
        free = s.num_blocks - sum(reqs[r].blocks for r in self._running)
        oldest = self._running[0] if self._running else None
        victims: list[Hashable] = []
        ready = [r for r in self._running if reqs[r].prefilled == reqs[r].target]
        if len(ready) > s.token_budget:
            self._fail("ready decodes fit the budget", f"{len(ready)} > {s.token_budget}")
        # Step 1: decodes, oldest first; one whose token starts a block takes one, preempting the
        # newest running (never an older one, itself when it is the newest) until one is free.
        for rid in ready:
            sh = reqs[rid]
            if not sh.running or sh.computed % s.block_size:
                continue
            while free == 0:
                victim = self._running[-1]
                free += reqs[victim].blocks
                self._preempt(victim, victims)
                if victim == rid:
                    break
            else:
                free -= 1
                sh.blocks += 1
        decodes = tuple(r for r in ready if reqs[r].running)
        left = s.token_budget - len(decodes)
        chunks: list[tuple[Hashable, int, int, bool]] = []
        partial = [r for r in self._running if reqs[r].prefilled < reqs[r].target]
        if len(partial) > 1:
            self._fail("one partial prefill", f"{partial}")
        if partial and left > 0:
            sh = reqs[partial[0]]
            if partial[0] != self._running[-1]:
                self._fail("partial prefill is the newest running", f"{partial[0]!r} in {self._running}")
            n = min(sh.target - sh.prefilled, left)
            need = self._blocks(sh.prefilled + n) - sh.blocks
            if need > free:
                self._preempt(partial[0], victims)
            else:
                free -= need
                sh.blocks += need
                chunks.append((partial[0], n, sh.prefilled, n == sh.target - sh.prefilled))
                left -= n
        admitted: list[Hashable] = []
        if victims:
            self._waiting[:0] = list(reversed(victims))
        else:
            while left > 0 and self._waiting and len(self._running) < s.max_seqs:
                rid = self._waiting[0]
                sh = reqs[rid]
                n = min(sh.target, left)
                need = self._blocks(n)
                want = self._blocks(sh.target) if sh.preemptions else need
                if want > free or (self._running and free - want < s.watermark_blocks):
                    break
                self._waiting.pop(0)
                self._running.append(rid)
                sh.running = True
                sh.blocks = need
                free -= need
                chunks.append((rid, n, 0, n == sh.target))
                admitted.append(rid)
                left -= n
        got = [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills]
        if plan.decode_rids != decodes:
            self._fail("decodes", f"got {plan.decode_rids}, expected {decodes}")
        if got != chunks:
            self._fail("prefill chunks (rid, tokens, start, is_last)", f"got {got}, expected {chunks}")
        if plan.admitted != tuple(admitted) or plan.preempted != tuple(reversed(victims)):
            self._fail("admitted / preempted", f"got {plan.admitted} / {plan.preempted}, expected "
                       f"{tuple(admitted)} / {tuple(reversed(victims))}")
        entries = list(plan)
        for c in plan.decodes:
            sh = reqs[c.rid]
            if c.start != sh.req.prompt_len + sh.generated - 1 or c.num_tokens != 1 or c.is_prefill:
                self._fail("decode entry", f"{c} for prompt {sh.req.prompt_len}, generated {sh.generated}")
        if sum(c.start for c in plan.decodes) != plan.decode_context_sum:
            self._fail("decode context sum", f"{plan.decode_context_sum}")
        total = sum(c.num_tokens for c in entries)
        if total != plan.num_tokens or total > s.token_budget or any(c.num_tokens < 1 for c in entries):
            self._fail("budget", f"{entries} sum {total}, plan {plan.num_tokens}, budget {s.token_budget}")
        if oldest is not None and not self._in_plan(oldest, plan):
            self._fail("the oldest running request progresses", f"{oldest!r} not in {entries}")

    # ------------------------------------------------------------------ state checks

    def _check_state(self, scheduled: StepPlan | None = None) -> None:
        """Blocks, counts and per-request state; `scheduled`: blocks also cover that plan's tokens."""
        s = self.scheduler
        reqs = self._reqs
        self._calls += 1
        if len(self._running) != s.num_running or len(self._waiting) != s.num_waiting:
            self._fail("counts", f"scheduler {s.num_running} running / {s.num_waiting} waiting, shadow "
                       f"{len(self._running)} / {len(self._waiting)}")
        if len(self._running) > s.max_seqs:
            self._fail("slots", f"{len(self._running)} running > max_seqs {s.max_seqs}")
        used = sum(reqs[r].blocks for r in self._running)
        if used + s.num_free_blocks != s.num_blocks or s.num_used_blocks != used:
            self._fail("free + used == num_blocks", f"{s.num_free_blocks} + {used} != {s.num_blocks}")
        if s.kv_free != s.num_free_blocks * s.block_size or s.kv_total != s.num_blocks * s.block_size:
            self._fail("kv_free in tokens", f"{s.kv_free} for {s.num_free_blocks} blocks of {s.block_size}")
        for rid in self._running:
            sh = reqs[rid]
            if scheduled is None and sh.blocks != self._blocks(sh.computed):
                self._fail("blocks cover the computed tokens", f"rid {rid!r}: {sh.blocks} for {sh.computed}")
            st = s.request_state(rid)
            decoding = sh.prefilled == sh.target
            if st.num_preemptions != sh.preemptions or st.num_generated != sh.generated or (
                    st.status is not (RequestStatus.DECODING if decoding else RequestStatus.PREFILLING)):
                self._fail("running state", f"{st}, shadow {sh}")
        if self._calls % self.table_every == 0:
            self._check_block_ids()
        orders = [reqs[r].order for r in self._waiting]
        if orders != sorted(orders):
            self._fail("queue in add() order", f"{self._waiting}")
        if s.num_preemptions != self.num_preemptions:
            self._fail("preemption count", f"scheduler {s.num_preemptions}, shadow {self.num_preemptions}")
        if s.num_recomputed_tokens != self.num_recomputed_tokens + self._recompute_in(scheduled):
            self._fail("recomputed tokens", f"scheduler {s.num_recomputed_tokens}, shadow {self.num_recomputed_tokens}")
        # The head of the queue and every preempted request (few); checking all waiting would be O(queue).
        for rid in self._waiting:
            sh = reqs[rid]
            if sh.preemptions or rid == self._waiting[0]:
                st = s.request_state(rid)
                want = RequestStatus.PREEMPTED if sh.preemptions else RequestStatus.WAITING
                if (st.status is not want or st.num_preemptions != sh.preemptions or st.num_prefilled
                        or st.num_generated != sh.generated or s.block_table(rid)):
                    self._fail("waiting state", f"{st}, table {s.block_table(rid)}")

    def _check_block_ids(self) -> None:
        """Materialize every block table and check the ids: each block in exactly one place."""
        s = self.scheduler
        free = s.free_block_ids()
        seen = set(free)
        if len(seen) != len(free) or len(free) != s.num_free_blocks:
            self._fail("free list", f"{s.num_free_blocks} free blocks, ids {free}")
        for rid in self._running:
            table = s.block_table(rid)
            if len(table) != self._reqs[rid].blocks:
                self._fail("block table", f"rid {rid!r}: {table}, expected {self._reqs[rid].blocks} blocks")
            if seen.intersection(table) or len(set(table)) != len(table):
                self._fail("block in two places", f"rid {rid!r}: {table}")
            if table and (min(table) < 0 or max(table) >= s.num_blocks):
                self._fail("block id range", f"rid {rid!r}: {table}")
            seen.update(table)
        if len(seen) != s.num_blocks:
            self._fail("every block accounted for", f"{len(seen)} of {s.num_blocks}")

    def _recompute_in(self, plan: StepPlan | None) -> int:
        if plan is None:
            return 0
        return sum(c.num_tokens for c in plan.prefills if self._reqs[c.rid].preemptions)

    def _apply(self, plan: StepPlan, stopped: set[Hashable], emitted: tuple[Hashable, ...]) -> None:
        reqs = self._reqs
        aborted = self._aborted_in_flight
        sampled: list[Hashable] = list(plan.decode_rids)
        for rid in plan.decode_rids:
            reqs[rid].generated += 1
            reqs[rid].episode_decodes += 1
        for c in plan.prefills:
            sh = reqs[c.rid]
            sh.prefilled += c.num_tokens
            sh.prefill_tokens += c.num_tokens
            if sh.preemptions:
                self.num_recomputed_tokens += c.num_tokens
            if c.is_last:
                if sh.generated != sh.target - sh.req.prompt_len:
                    self._fail("recompute covers prompt + generated", f"rid {c.rid!r}: {sh}")
                sh.generated += 1
                sampled.append(c.rid)
        expected = tuple(r for r in sampled if r not in aborted)
        if emitted != expected:
            self._fail("emitted", f"got {emitted}, expected {expected}")
        for rid in emitted:
            reqs[rid].emitted += 1
        finished = self.scheduler.last_finished
        for rid in sampled:
            sh = reqs[rid]
            if sh.emitted != sh.generated - (rid in aborted):
                self._fail("each token emitted once", f"rid {rid!r}: {sh.emitted} emitted, {sh.generated} generated")
            done = rid in aborted or rid in stopped or sh.generated == sh.req.max_new
            if sh.generated == sh.req.max_new and not (rid in aborted or rid in stopped):
                gen0 = sh.target - sh.req.prompt_len
                if sh.prefilled != sh.target or gen0 + 1 + sh.episode_decodes != sh.req.max_new:
                    self._fail("exact tokens", f"rid {rid!r}: {sh}")
            if done != (rid in finished):
                self._fail("finish", f"rid {rid!r} done={done}, scheduler {finished.get(rid)}")
            if done:
                self._end(rid)
        for rid in aborted:
            if rid in reqs:
                self._end(rid)
        self._aborted_in_flight = set()

    def _end(self, rid: Hashable) -> None:
        sh = self._reqs.pop(rid)
        if sh.running:
            self._running.remove(rid)
        else:
            self._waiting.remove(rid)
