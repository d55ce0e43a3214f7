"""An independent checker of the scheduler contract (DESIGN.md section 1), step by step.

Imports allowed: the standard library and stallfree.core only.

InvariantChecker wraps a Scheduler, forwards add / schedule / complete / abort to it and, after each
call, compares what the scheduler did with a shadow model of its own (plain dicts and lists, no
shortcuts shared with the scheduler), so that a fault in the scheduler's bookkeeping cannot hide
itself. It is meant for tests and for the simulator's --check mode; it costs O(running) per step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
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
    _plan: StepPlan | None = None
    _aborted_in_flight: set[Hashable] = field(default_factory=set)

    def _fail(self, rule: str, detail: str) -> None:
        raise InvariantViolation(f"step {self.scheduler.step}: {rule}: {detail}")

    # ------------------------------------------------------------------ forwarded calls

    def add(self, req: Request) -> None:
        """Forward add(); on success, append the request to the shadow queue."""
        self.scheduler.add(req)
        self._reqs[req.rid] = _Shadow(req)
        self._waiting.append(req.rid)
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

    def schedule(self) -> StepPlan:
        """Forward schedule() and check the plan against the contract."""
        plan = self.scheduler.schedule()
        self._plan = plan
        self._check_plan(plan)
        return plan

    def complete(self, plan: StepPlan, stopped: Iterable[Hashable] = ()) -> tuple[Hashable, ...]:
        """Forward complete() and check what was emitted and finished."""
        stopped = tuple(stopped)
        emitted = self.scheduler.complete(plan, stopped)
        self._plan = None
        self._apply(plan, set(stopped), emitted)
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
        # Decodes: exactly the oldest ready ones, up to the budget, each at its own position.
        expected = tuple(self._ready[: plan.token_budget])
        if plan.decode_rids != expected:
            self._fail("oldest ready decodes", f"got {plan.decode_rids}, expected {expected}")
        for c in plan.decodes:
            sh = self._reqs[c.rid]
            if c.start != sh.req.prompt_len + sh.generated - 1 or c.num_tokens != 1 or c.is_prefill:
                self._fail("decode entry", f"{c} for prompt {sh.req.prompt_len}, generated {sh.generated}")
        if sum(c.start for c in plan.decodes) != plan.decode_context_sum:
            self._fail("decode context sum", f"{plan.decode_context_sum}")
        left = plan.token_budget - plan.num_decodes
        chunks = list(plan.prefills)
        # The partial prefill comes before any admission and takes what it can.
        if self._partial is not None and left > 0:
            if not chunks or chunks[0].rid != self._partial:
                self._fail("partial prefill first", f"{self._partial!r} missing from {chunks}")
        admitted = [c.rid for c in chunks if c.rid != self._partial]
        if tuple(admitted) != plan.admitted:
            self._fail("admitted view", f"{plan.admitted} vs chunks {admitted}")
        if admitted != self._waiting[: len(admitted)]:
            self._fail("FCFS admission", f"admitted {admitted}, queue head {self._waiting[: len(admitted)]}")
        for c in chunks:
            sh = self._reqs[c.rid]
            rest = sh.req.prompt_len - sh.prefilled
            if c.start != sh.prefilled or c.num_tokens > rest or c.is_last != (c.num_tokens == rest):
                self._fail("prefill chunk", f"{c} with {sh.prefilled}/{sh.req.prompt_len} prefilled")
        partials = [c for c in chunks if not c.is_last]
        if len(partials) > 1 or (partials and partials[-1] is not chunks[-1]):
            self._fail("one partial prefill", f"{chunks}")
        if partials and plan.num_tokens != plan.token_budget:
            self._fail("partial only when the budget is spent", f"{plan.num_tokens}/{plan.token_budget}")
        for rid in admitted:
            self._reqs[rid].admitted = True
        del self._waiting[: len(admitted)]
        # Admission stops only at a spent budget or a blocked head.
        if self._waiting and plan.num_tokens < plan.token_budget:
            head = self._reqs[self._waiting[0]].req
            blocked = s.num_running >= s.max_seqs or s.kv_needed(head) > s.kv_free
            if not blocked:
                self._fail("admission stopped early", f"head {head.rid!r} fits with budget left")
        if s.num_running > s.max_seqs:
            self._fail("slots", f"{s.num_running} running > max_seqs {s.max_seqs}")
        self._check_kv()

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

    def _apply(self, plan: StepPlan, stopped: set[Hashable], emitted: tuple[Hashable, ...]) -> None:
        aborted = self._aborted_in_flight
        sampled: list[Hashable] = list(plan.decode_rids)
        for rid in plan.decode_rids:
            sh = self._reqs[rid]
            sh.generated += 1
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
            elif sh.generated == sh.req.max_new:
                if sh.prefilled != sh.req.prompt_len or sh.decodes != sh.req.max_new - 1:
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
        if self._partial == rid:
            self._partial = None
        # The rid may be reused once finished; the shadow keeps one record per live rid.
        del self._reqs[rid]
