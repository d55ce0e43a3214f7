"""Per-request draft tokens (speculative decoding): set_draft_tokens, the budget order (one token for every
decode, then the drafts in batch order, then prefills), provisional counts settled by take_back, held decodes,
and the invariant checker's rules for them. Plans are worked out by hand in each docstring."""

from __future__ import annotations

import random

import pytest

from stallfree import Request, Scheduler
from stallfree.core.errors import SchedulerStateError
from stallfree.core.invariants import InvariantChecker, InvariantViolation
from stallfree.core.request import FinishReason, RequestStatus


def _two_decodes(**kw: object) -> InvariantChecker:
    """Budget 8, 4 slots, 1,000 KV tokens: a and b (prompt 2, max_new 10) prefill in step 0 and decode from
    step 1 with 1 token generated each; c (prompt 10, max_new 2) waits."""
    chk = InvariantChecker(Scheduler(8, 4, 1000, **kw))  # type: ignore[arg-type]
    chk.add(Request("a", 2, 10))
    chk.add(Request("b", 2, 10))
    plan = chk.schedule()
    assert [(c.rid, c.num_tokens) for c in plan] == [("a", 2), ("b", 2)]
    chk.complete(plan)
    chk.add(Request("c", 10, 2))
    return chk


@pytest.mark.parametrize("kw", [{}, {"kv_policy": "paged", "block_size": 4}])
def test_drafts_after_one_token_each_in_batch_order(kw):
    """Step 1: a and b have 4 drafts each. One token each (2), then a's 4 drafts (6 left -> 2), then b's 2
    (budget spent); c gets nothing. a: verdict at once (2 of its 4 drafts rejected: 3 tokens); b: no verdict,
    all 3 counted provisionally, then 1 taken back. Step 2: a starts at 2 + 4 - 1 = 5, b at 2 + 3 - 1 = 4,
    one token each, c's first chunk of 6."""
    chk = _two_decodes(**kw)
    s = chk.scheduler
    chk.set_draft_tokens("a", 4)
    chk.set_draft_tokens("b", 4)
    plan = chk.schedule()
    assert plan.decode_rids == ("a", "b")
    assert plan.decode_tokens == (5, 3)
    assert plan.prefills == () and plan.num_tokens == 8 and plan.num_decode_tokens == 8 and plan.num_draft_tokens == 6
    assert chk.complete(plan, num_accepted={"a": 3}) == ("a", "b")
    assert s.request_state("a").num_generated == 4
    assert s.request_state("b").num_generated == 4
    assert chk.unsettled_drafts("a") == () and chk.unsettled_drafts("b") == (2,)
    assert chk.take_back("b", 1) is None
    assert s.request_state("b").num_generated == 3
    plan = chk.schedule()
    assert [(c.rid, c.num_tokens, c.start) for c in plan] == [("a", 1, 5), ("b", 1, 4), ("c", 6, 0)]
    assert plan.decode_tokens is None  # drafts are for one step
    chk.complete(plan)


def test_every_decode_gets_its_token_before_any_draft():
    """Budget 3, three decodes with 5 drafts each: 1 token each and no draft (the budget is spent)."""
    chk = InvariantChecker(Scheduler(3, 4, 1000))
    for rid in "xyz":
        chk.add(Request(rid, 1, 20))
    chk.complete(chk.schedule())
    for rid in "xyz":
        chk.set_draft_tokens(rid, 5)
    plan = chk.schedule()
    assert plan.decode_rids == ("x", "y", "z") and plan.decode_tokens is None and plan.num_tokens == 3
    chk.complete(plan)


def test_drafts_never_go_past_the_last_token():
    """max_new 3, 1 token generated: at most 3 - 1 - 1 = 1 draft, whatever is asked."""
    chk = InvariantChecker(Scheduler(16, 2, 1000))
    chk.add(Request("r", 4, 3))
    chk.complete(chk.schedule())
    chk.set_draft_tokens("r", 4)
    plan = chk.schedule()
    assert plan.decode_tokens == (2,)
    chk.complete(plan, num_accepted={"r": 2})
    assert chk.last_finished == {"r": FinishReason.LENGTH}


def test_drafts_never_preempt():
    """Paged, 3 blocks of 4 tokens: a and b (prompt 3, max_new 6) hold a block each, one free. Step 1, 4 drafts
    each: a's token and 4 drafts (positions 3-7) take the free block; b's drafts would need a block: it runs its
    one token (position 3 fits its block) without drafts, and nobody is preempted."""
    chk = InvariantChecker(Scheduler(16, 2, 12, kv_policy="paged", block_size=4, watermark=0.0))
    chk.add(Request("a", 3, 6))
    chk.add(Request("b", 3, 6))
    chk.complete(chk.schedule())
    chk.set_draft_tokens("a", 4)
    chk.set_draft_tokens("b", 4)
    plan = chk.schedule()
    assert plan.decode_tokens == (5, 1) and plan.preempted == ()
    assert chk.scheduler.stats().num_free_blocks == 0
    chk.complete(plan, num_accepted={"a": 1})  # all of a's drafts rejected: its second block goes back
    assert chk.scheduler.stats().num_free_blocks == 1


def test_a_decode_at_its_last_token_waits_for_its_verdict():
    """max_new 3, 1 generated, 1 draft counted provisionally: 3 = max_new, but the draft may be taken back, so
    it does not finish and the next plan leaves it out. take_back(0): it finishes ("length"). take_back(1)
    instead: it decodes its third token next step, from position 4 + 2 - 1 = 5."""
    for rejected in (0, 1):
        chk = InvariantChecker(Scheduler(16, 2, 1000))
        chk.add(Request("r", 4, 3))
        chk.add(Request("other", 4, 10))
        chk.complete(chk.schedule())
        chk.set_draft_tokens("r", 1)
        plan = chk.schedule()
        assert plan.decode_tokens == (2, 1)
        chk.complete(plan)
        assert "r" not in chk.last_finished and chk.scheduler.request_state("r").num_generated == 3
        plan = chk.schedule()
        assert plan.decode_rids == ("other",)
        chk.complete(plan)
        reason = chk.take_back("r", rejected)
        if rejected:
            assert reason is None
            plan = chk.schedule()
            assert [(c.rid, c.start) for c in plan.decodes] == [("r", 5), ("other", 6)]
            chk.complete(plan)
            assert chk.last_finished == {"r": FinishReason.LENGTH}
        else:
            assert reason is FinishReason.LENGTH and chk.last_finished == {"r": FinishReason.LENGTH}
            assert chk.scheduler.num_running == 1


def test_verdicts_a_step_late_are_settled_oldest_first():
    """Async order: step 1 (2 drafts) and step 2 (3 drafts) are both provisional before step 1's verdict; each
    take_back settles the oldest step and can take back no more than its drafts."""
    chk = InvariantChecker(Scheduler(16, 2, 1000))
    chk.add(Request("r", 4, 20))
    chk.complete(chk.schedule())
    for k in (2, 3):
        chk.set_draft_tokens("r", k)
        chk.complete(chk.schedule())
    assert chk.unsettled_drafts("r") == (2, 3)
    assert chk.scheduler.request_state("r").num_generated == 1 + 3 + 4
    with pytest.raises(SchedulerStateError, match="from 0 to 2"):
        chk.take_back("r", 3)
    chk.take_back("r", 2)
    chk.take_back("r", 1)
    assert chk.unsettled_drafts("r") == () and chk.scheduler.request_state("r").num_generated == 5


def test_bad_calls_raise_and_change_nothing():
    s = Scheduler(16, 2, 1000)
    s.add(Request("r", 4, 20))
    with pytest.raises(KeyError):
        s.set_draft_tokens("nope", 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(SchedulerStateError, match="num_drafts"):
            s.set_draft_tokens("r", bad)  # type: ignore[arg-type]
    s.complete(s.schedule())
    s.set_draft_tokens("r", 2)
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match="in flight"):
        s.take_back("r", 0)
    s.complete(plan)
    with pytest.raises(SchedulerStateError, match="from 0 to 2"):
        s.take_back("r", 3)
    assert s.unsettled_drafts("r") == (2,)
    s.take_back("r", 0)
    with pytest.raises(SchedulerStateError, match="no unsettled"):
        s.take_back("r", 0)
    spec = Scheduler(16, 2, 1000, num_spec_tokens=2)
    spec.add(Request("r", 4, 20))
    with pytest.raises(SchedulerStateError, match="num_spec_tokens"):
        spec.set_draft_tokens("r", 1)


def test_drafts_of_zero_leave_every_plan_as_without_them():
    """set_draft_tokens(rid, 0) for every decode each step gives the plans of a run without the call."""
    def run(zero: bool) -> list[list[tuple[object, int, int]]]:
        rng = random.Random(3)
        s = Scheduler(8, 3, 300, kv_policy="paged", block_size=4)
        for i in range(12):
            s.add(Request(i, rng.randint(1, 30), rng.randint(1, 12)))
        plans = []
        while s.has_unfinished():
            if zero:
                for rid in list(s._live):
                    s.set_draft_tokens(rid, 0)
            plan = s.schedule()
            plans.append([(c.rid, c.num_tokens, c.start) for c in plan])
            s.complete(plan)
        return plans
    assert run(True) == run(False)


class _TooManyDrafts(Scheduler):
    def set_draft_tokens(self, rid, num_drafts):  # type: ignore[no-untyped-def]
        super().set_draft_tokens(rid, num_drafts + 1)  # a fault: one draft more than asked


class _TakesBackTooMuch(Scheduler):
    def take_back(self, rid, num_rejected):  # type: ignore[no-untyped-def]
        return super().take_back(rid, min(num_rejected, self.unsettled_drafts(rid)[0]))  # a fault: no check


def test_the_checker_catches_more_drafts_than_set_and_an_over_take_back():
    chk = InvariantChecker(_TooManyDrafts(16, 2, 1000))
    chk.add(Request("r", 4, 20))
    chk.complete(chk.schedule())
    chk.set_draft_tokens("r", 2)
    with pytest.raises(InvariantViolation, match=r"1 \+ drafts <= 1 \+ k"):
        chk.schedule()
    chk = InvariantChecker(_TakesBackTooMuch(16, 2, 1000))
    chk.add(Request("r", 4, 20))
    chk.complete(chk.schedule())
    chk.set_draft_tokens("r", 2)
    chk.complete(chk.schedule())
    with pytest.raises(InvariantViolation, match="take back no more than scheduled"):
        chk.take_back("r", 3)


OPTIONS = [
    {},
    {"block_size": 4},
    {"kv_policy": "paged", "block_size": 4},
    {"kv_policy": "paged", "block_size": 4, "enable_prefix_caching": True},
    {"kv_policy": "paged", "block_size": 2, "policy": "priority"},
    {"kv_policy": "paged", "block_size": 4, "decode_overflow": "rotate"},
    {"kv_policy": "paged", "block_size": 4, "max_num_partial_prefills": 3, "long_prefill_token_threshold": 8},
]


@pytest.mark.parametrize("options", OPTIONS, ids=[str(o) for o in OPTIONS])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_drafts_keep_every_invariant(options, seed):
    """Seeded runs with random drafts, verdicts at once or a step late (and some aborts and stops), under every
    KV policy and option: the checker's shadow agrees at every call and all KV comes back."""
    rng = random.Random(seed)
    budget = max(rng.choice([1, 2, 3, 8, 16, 64]), int(options.get("block_size") or 1))  # type: ignore[call-overload]
    reqs = [Request(i, rng.randint(1, 60), rng.randint(1, 20)) for i in range(25)]
    kv = rng.choice([1, 2, 20]) * (max(r.prompt_len + r.max_new for r in reqs) + 8)
    chk = InvariantChecker(Scheduler(budget, rng.randint(1, 8), kv, **options))  # type: ignore[arg-type]
    s = chk.scheduler
    arrive = sorted(rng.randint(0, 60) for _ in reqs)
    late, at_once = rng.random() < 0.5, rng.random() < 0.3
    waiting: list[object] = []
    i = steps = 0
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrive[i] <= s.step:
            chk.add(reqs[i])
            i += 1
        for rid in list(s._live):
            if s.request_state(rid).status is RequestStatus.DECODING and rng.random() < 0.7:
                chk.set_draft_tokens(rid, rng.randint(0, 4))
        plan = chk.schedule()
        acc = {c.rid: rng.randint(1, c.num_tokens) for c in plan.decodes if rng.random() < 0.8} if at_once else None
        chk.complete(plan, [r for r in plan.sampled_rids if rng.random() < 0.02], acc)
        fresh = [c.rid for c in plan.decodes if c.num_tokens > 1 and not (acc and c.rid in acc)]
        for rid in (waiting if late else fresh):
            if rid in s._live and s.unsettled_drafts(rid):
                chk.take_back(rid, rng.randint(0, s.unsettled_drafts(rid)[0]))
        waiting = fresh
        if rng.random() < 0.01 and s._live:
            chk.abort(rng.choice(list(s._live)))
        steps += 1
        assert steps < 5000
    chk.check_final()
