"""An independent checker of the scheduler contract (docs/DESIGN.md section 1), step by step.

Imports allowed: the standard library and stallfree.core only.

InvariantChecker wraps a Scheduler, forwards add / schedule / complete / abort to it and, after each
call, compares what the scheduler did with a shadow model of its own (plain dicts and lists, no
shortcuts shared with the scheduler), so that a fault in the scheduler's bookkeeping cannot hide
itself. It is meant for tests and for the simulator's --check mode; it costs O(running) per step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from stallfree.core.plan import StepPlan
from stallfree.core.request import Request
from stallfree.core.scheduler import Scheduler

__all__ = ["InvariantChecker", "InvariantViolation"]


class InvariantViolation(AssertionError):
    """The scheduler broke a contract invariant; the message names the step, rule and values."""


@dataclass(slots=True)
class _Shadow:
    req: Request
    add_step: int = 0
    admitted: bool = False
    prefilled: int = 0
    generated: int = 0
    decodes: int = 0
    finished: bool = False
    ended_early: bool = False


@dataclass(slots=True)
class InvariantChecker:
    """Wrap `scheduler` and assert every invariant of the contract after each step and at the end.

    Use it exactly like the scheduler (add, schedule, complete, abort); call `check_final()` once
    nothing is unfinished. Counters `num_steps` and `num_requests` say what was covered.

    Raises:
        InvariantViolation: from any call, when the scheduler broke a rule; the message names it.
    """

    scheduler: Scheduler
    num_steps: int = 0
    num_requests: int = 0
    _reqs: dict[Hashable, _Shadow] = field(default_factory=dict)
    _waiting: list[Hashable] = field(default_factory=list)
    _ready: list[Hashable] = field(default_factory=list)
    _partial: Hashable | None = None
    _order: dict[Hashable, int] = field(default_factory=dict)
    _plan: StepPlan | None = None
    _aborted_in_flight: set[Hashable] = field(default_factory=set)

    def _fail(self, rule: str, detail: str) -> None:
        raise InvariantViolation(f"step {self.scheduler.step}: {rule}: {detail}")

    # ------------------------------------------------------------------ forwarded calls

    def add(self, req: Request) -> None:
        """Forward add(); on success, append the request to the shadow queue."""
        self.scheduler.add(req)
        self._reqs[req.rid] = _Shadow(req, add_step=self.scheduler.step)
        self._waiting.append(req.rid)
        self._order[req.rid] = self.num_requests
        self.num_requests += 1

    def abort(self, rid: Hashable) -> None:
        """Forward abort(); mirror its effect (deferred if the rid is in the plan in flight)."""
        self.scheduler.abort(rid)
        sh = self._reqs.get(rid)
        if sh is None or sh.finished:
            return
        if self._plan is not None and self._in_plan(rid, self._plan):
            self._aborted_in_flight.add(rid)
            return
        self._end(rid, early=True)
        self._check_kv()

    def schedule(self, token_budget: int | None = None) -> StepPlan:
        """Forward schedule() and check the plan against the contract."""
        plan = self.scheduler.schedule() if token_budget is None else self.scheduler.schedule(token_budget)
        self._plan = plan
        self._check_plan(plan)
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
        self._plan = None
        self._apply(plan, set(stopped), emitted, num_accepted or {})
        self.num_steps += 1
        return emitted

    def check_final(self) -> None:
        """Assert that nothing is left and every request got exactly its tokens."""
        s = self.scheduler
        if s.has_unfinished() or s.num_running or s.num_waiting:
            self._fail("final", f"{s.num_running} running, {s.num_waiting} waiting left")
        if s.kv_free != s.kv_total:
            self._fail("final KV returned", f"kv_free {s.kv_free} != kv_total {s.kv_total}")
        for rid, sh in self._reqs.items():
            if not sh.finished:
                self._fail("final", f"rid {rid!r} never finished")

    # ------------------------------------------------------------------ checks

    def _in_plan(self, rid: Hashable, plan: StepPlan) -> bool:
        return rid in plan.decode_rids or any(c.rid == rid for c in plan.prefills)

    def _check_plan(self, plan: StepPlan) -> None:
        s = self.scheduler
        entries = list(plan)
        total = sum(c.num_tokens for c in entries)
        if total != plan.num_tokens:
            self._fail("plan total", f"entries sum to {total}, plan says {plan.num_tokens}")
        if total > plan.token_budget or plan.token_budget > s.token_budget:
            self._fail("budget", f"{total} tokens, step budget {plan.token_budget}, {s.token_budget} configured")
        if any(c.num_tokens < 1 for c in entries):
            self._fail("no empty entry", f"{entries}")
        budget = plan.token_budget
        self._check_decodes(plan)
        left = budget - plan.num_decode_tokens
        chunks = list(plan.prefills)
        # The partial prefill comes before any admission and takes what the chunk rule allows.
        if self._partial is not None:
            sh = self._reqs[self._partial]
            want = self._chunk(sh.req.prompt_len - sh.prefilled, left)
            got = chunks[0].num_tokens if chunks and chunks[0].rid == self._partial else 0
            if got != want:
                self._fail("partial prefill first", f"{self._partial!r} got {got} tokens, expected {want}")
            # An unfinished prompt keeps the rest of the budget: nothing is admitted behind it.
            left = left - got if got == sh.req.prompt_len - sh.prefilled else 0
        admitted = [c.rid for c in chunks if c.rid != self._partial]
        if tuple(admitted) != plan.admitted:
            self._fail("admitted view", f"{plan.admitted} vs chunks {admitted}")
        queue = self._queue_order()
        if admitted != queue[: len(admitted)]:
            self._fail("admission order", f"admitted {admitted}, queue order {queue[: len(admitted)]}")
        for c in chunks:
            sh = self._reqs[c.rid]
            rest = sh.req.prompt_len - sh.prefilled
            if c.start != sh.prefilled or c.num_tokens > rest or c.is_last != (c.num_tokens == rest):
                self._fail("prefill chunk", f"{c} with {sh.prefilled}/{sh.req.prompt_len} prefilled")
            if c.rid != self._partial:
                if c.num_tokens != self._chunk(rest, left):
                    self._fail("first chunk size", f"{c} with {left} budget left")
                left = left - c.num_tokens if c.is_last else 0
            b = s.block_size
            if b and not c.is_last and (c.start + c.num_tokens) % b:
                self._fail("block-aligned chunk", f"{c} does not end on a multiple of {b}")
        partials = [c for c in chunks if not c.is_last]
        if len(partials) > 1 or (partials and partials[-1] is not chunks[-1]):
            self._fail("one partial prefill", f"{chunks}")
        for rid in admitted:
            self._reqs[rid].admitted = True
            self._waiting.remove(rid)
        # Admission stops only at a spent budget or a blocked head.
        queue = self._queue_order()
        if queue and left > 0:
            head = self._reqs[queue[0]].req
            blocked = (
                s.num_running >= s.max_seqs
                or s.kv_needed(head) > s.kv_free
                or self._chunk(head.prompt_len, left) == 0
            )
            if not blocked:
                self._fail("admission stopped early", f"head {head.rid!r} fits with {left} budget left")
        if s.num_running > s.max_seqs:
            self._fail("slots", f"{s.num_running} running > max_seqs {s.max_seqs}")
        self._check_kv()

    def _chunk(self, rest: int, left: int) -> int:
        if rest <= left:
            return rest
        b = self.scheduler.block_size
        return max(left - left % b, 0) if b else max(left, 0)

    def _key(self, rid: Hashable) -> tuple[float, int]:
        s = self.scheduler
        sh = self._reqs[rid]
        seq = self._order[rid]
        if s.policy != "priority" or s.aging_interval is None:
            return (sh.req.priority if s.policy == "priority" else 0, seq)
        waited = s._now - sh.req.arrival if s.clock is not None else s.step - sh.add_step  # the step's reading
        return (sh.req.priority - math.floor(waited / s.aging_interval), seq)

    def _queue_order(self) -> list[Hashable]:
        return sorted(self._waiting, key=self._key)

    def _decode_cost(self, rid: Hashable, budget: int) -> int:
        k = self.scheduler.num_spec_tokens
        sh = self._reqs[rid]
        return 1 + min(k, budget - 1, sh.req.max_new - sh.generated - 1)

    def _check_decodes(self, plan: StepPlan) -> None:
        """The decodes of a step: every ready one when they fit, else the overflow rule's choice."""
        s = self.scheduler
        budget = plan.token_budget
        ready = self._ready
        costs = {rid: self._decode_cost(rid, budget) for rid in ready}
        chosen = plan.decode_rids
        entries = plan.decodes
        for c in entries:
            sh = self._reqs[c.rid]
            if c.start != sh.req.prompt_len + sh.generated - 1 or c.num_tokens != costs.get(c.rid) or c.is_prefill:
                self._fail("decode entry", f"{c} for prompt {sh.req.prompt_len}, generated {sh.generated}")
        if sum(c.start for c in entries) != plan.decode_context_sum:
            self._fail("decode context sum", f"{plan.decode_context_sum}")
        if sum(costs.values()) <= budget:
            if chosen != tuple(ready):
                self._fail("every ready decode, oldest first", f"got {chosen}, expected {tuple(ready)}")
            return
        if s.policy == "priority":
            order = sorted(ready, key=self._key)
        elif s.decode_overflow == "rotate":
            if not chosen:
                self._fail("rotate serves someone", "no decode chosen")
            # The served ones are a cyclic run of the ready list (listed in admission order): it starts
            # at the chosen decode whose predecessor in the cycle was not chosen.
            picked = set(chosen)
            starts = [r for r in chosen if r in costs and ready[ready.index(r) - 1] not in picked]
            i = ready.index(starts[0] if starts else chosen[0]) if chosen[0] in costs else 0
            order = ready[i:] + ready[:i]
            chosen = tuple(sorted(chosen, key=order.index)) if picked <= set(order) else chosen
        else:
            order = list(ready)
        expected: list[Hashable] = []
        used = 0
        for rid in order:
            if used + costs[rid] > budget:
                break
            expected.append(rid)
            used += costs[rid]
        if list(chosen) != expected:
            self._fail("decode overflow choice", f"got {plan.decode_rids}, expected {tuple(expected)}")

    def _check_kv(self) -> None:
        s = self.scheduler
        reserved = sum(
            s.kv_needed(sh.req) for sh in self._reqs.values() if sh.admitted and not sh.finished
        )
        if s.kv_free < 0 or s.kv_free != s.kv_total - reserved:
            self._fail("KV accounting", f"kv_free {s.kv_free}, expected {s.kv_total} - {reserved}")
        running = sum(1 for sh in self._reqs.values() if sh.admitted and not sh.finished)
        if running != s.num_running:
            self._fail("running count", f"scheduler says {s.num_running}, shadow {running}")

    def _apply(
        self, plan: StepPlan, stopped: set[Hashable], emitted: tuple[Hashable, ...], accepted: Mapping[Hashable, int]
    ) -> None:
        aborted = self._aborted_in_flight
        sampled: list[Hashable] = list(plan.decode_rids)
        for rid in plan.decode_rids:
            sh = self._reqs[rid]
            sh.generated += accepted.get(rid, 1)
            sh.decodes += 1
        for c in plan.prefills:
            sh = self._reqs[c.rid]
            sh.prefilled += c.num_tokens
            if c.is_last:
                sh.generated = 1
                sampled.append(c.rid)
                self._ready.append(c.rid)
                if self._partial == c.rid:
                    self._partial = None
            else:
                self._partial = c.rid
        expected = tuple(r for r in sampled if r not in aborted)
        if emitted != expected:
            self._fail("emitted", f"got {emitted}, expected {expected}")
        finished = self.scheduler.last_finished
        for rid in sampled:
            sh = self._reqs[rid]
            if rid in aborted or rid in stopped:
                self._end(rid, early=True)
            elif sh.generated >= sh.req.max_new:
                spec = self.scheduler.num_spec_tokens
                if (
                    sh.generated != sh.req.max_new
                    or sh.prefilled != sh.req.prompt_len
                    or (not spec and sh.decodes != sh.req.max_new - 1)
                ):
                    self._fail("exact tokens", f"rid {rid!r}: {sh.prefilled} prefilled, {sh.decodes} decodes")
                self._end(rid, early=False)
            if sh.finished != (rid in finished):
                self._fail("finish", f"rid {rid!r} finished={sh.finished}, scheduler {finished.get(rid)}")
        for rid in aborted:
            if rid in self._reqs:
                self._end(rid, early=True)
        self._aborted_in_flight = set()
        self._check_kv()

    def _end(self, rid: Hashable, early: bool) -> None:
        sh = self._reqs[rid]
        sh.finished = True
        sh.ended_early = early
        if rid in self._ready:
            self._ready.remove(rid)
        if rid in self._waiting:
            self._waiting.remove(rid)
        self._order.pop(rid, None)
        if self._partial == rid:
            self._partial = None
        # The rid may be reused once finished; the shadow keeps one record per live rid.
        del self._reqs[rid]
