"""A Hypothesis state machine that interleaves add / schedule / complete / abort, invalid calls included."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stallfree import Request, Scheduler, SchedulerStateError
from stallfree.core.invariants import InvariantChecker
from strategies import bad_counts, max_news, max_seqs, prompt_lens, token_budgets


class SchedulerMachine(RuleBasedStateMachine):
    """Random call sequences against a checked Scheduler; every bad call must raise and change nothing."""

    @initialize(budget=token_budgets, seqs=max_seqs, kv=st.integers(min_value=100, max_value=400))
    def setup(self, budget, seqs, kv):
        self.chk = InvariantChecker(Scheduler(token_budget=budget, max_seqs=seqs, kv_tokens=kv))
        self.plan = None
        self.next_rid = 0
        self.live: list[int] = []

    def state(self):
        s = self.chk.scheduler
        return (s.kv_free, s.num_waiting, s.num_running, s.step, s.has_unfinished())

    @rule(prompt=prompt_lens, max_new=max_news)
    def add(self, prompt, max_new):
        rid = self.next_rid
        self.next_rid += 1
        if prompt + max_new > self.chk.scheduler.stats().kv_total:
            before = self.state()
            with pytest.raises(ValueError, match="never fit"):
                self.chk.add(Request(rid, prompt, max_new))
            assert self.state() == before
            return
        self.chk.add(Request(rid, prompt, max_new))
        self.live.append(rid)

    @rule(value=bad_counts, field=st.sampled_from(["prompt_len", "max_new"]))
    def add_bad(self, value, field):
        before = self.state()
        bad = Request(-1, 3, 3)
        object.__setattr__(bad, field, value)  # around the constructor, so that add() itself must refuse it
        with pytest.raises(ValueError, match=field):
            self.chk.add(bad)
        assert self.state() == before

    @rule()
    def add_duplicate(self):
        if not self.live:
            return
        before = self.state()
        with pytest.raises(ValueError, match="already live"):
            self.chk.add(Request(self.live[0], 1, 1))
        assert self.state() == before

    @precondition(lambda self: self.plan is None)
    @rule()
    def schedule(self):
        self.plan = self.chk.schedule()

    @precondition(lambda self: self.plan is not None)
    @rule()
    def schedule_twice(self):
        before = self.state()
        with pytest.raises(SchedulerStateError):
            self.chk.schedule()
        assert self.state() == before

    @precondition(lambda self: self.plan is not None)
    @rule(data=st.data(), bad=st.booleans())
    def complete(self, data, bad):
        sampled = list(self.plan.sampled_rids)
        stopped = data.draw(st.lists(st.sampled_from(sampled), unique=True)) if sampled else []
        if bad:
            not_sampled = [r for r in self.live if r not in sampled] + [10**9]
            before = self.state()
            with pytest.raises(SchedulerStateError):
                self.chk.complete(self.plan, stopped + [data.draw(st.sampled_from(not_sampled))])
            assert self.state() == before
        self.chk.complete(self.plan, stopped)
        done = self.chk.scheduler.last_finished
        self.live = [r for r in self.live if r not in done]
        self.plan = None

    @rule(data=st.data())
    def abort(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(self.live))
        self.chk.abort(rid)
        try:
            self.chk.scheduler.request_state(rid)  # still live when the abort waits for complete()
        except KeyError:
            self.live.remove(rid)

    @rule()
    def abort_unknown(self):
        before = self.state()
        with pytest.raises(KeyError):
            self.chk.abort("never-added")
        assert self.state() == before

    @invariant()
    def kv_in_range(self):
        s = self.chk.scheduler
        assert 0 <= s.kv_free <= s.stats().kv_total
        assert s.num_running <= s.config.max_seqs

    def teardown(self):
        if self.plan is not None:
            self.chk.complete(self.plan)
        for _ in range(100_000):
            if not self.chk.scheduler.has_unfinished():
                break
            self.chk.complete(self.chk.schedule())
        self.chk.check_final()


class TestSchedulerMachine(SchedulerMachine.TestCase):
    """150 examples of up to 60 steps."""

    settings = settings(max_examples=150, stateful_step_count=60)
    pytestmark = pytest.mark.slow


class TestSchedulerMachineQuick(SchedulerMachine.TestCase):
    """The same state machine, 10 examples of up to 30 steps (the quick set's share)."""

    settings = settings(max_examples=10, stateful_step_count=30)
