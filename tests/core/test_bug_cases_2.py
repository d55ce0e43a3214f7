"""Failure cases B38 (speculative tokens: the length cap against a stop) and B41 (abort of a preempted or
recomputing request) from the second set of public bug scenarios, replayed against the core."""

from __future__ import annotations

import pytest

from stallfree import FinishReason, PagedScheduler, Request, RequestStatus, Scheduler, SchedulerStateError
from stallfree.core.invariants import InvariantChecker


def _b38(kv_policy: str) -> InvariantChecker:
    """B38's config: budget 8, 2 slots, 100 tokens of KV, 3 speculative tokens; rids 1 and 2, prompt 2, max_new 4."""
    kw = {"kv_policy": "paged", "block_size": 2} if kv_policy == "paged" else {}
    chk = InvariantChecker(Scheduler(8, 2, 100, num_spec_tokens=3, **kw))  # type: ignore[arg-type]
    chk.add(Request(1, 2, 4))
    chk.add(Request(2, 2, 4))
    return chk


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_b38_verification_never_passes_max_new_and_a_stop_inside_the_block_is_a_stop(kv_policy):
    """Step 0 prefills both (first tokens); at step 1 each has 3 tokens left, so a decode costs 1 + min(3, 4 - 1 - 1)
    = 3, not 4: the accepted block can never carry a request past max_new. rid 1 accepts all 3 and ends at
    exactly 4 tokens ("length"); rid 2's stop falls on its 2nd token: the engine reports 2 accepted and the
    stop, and it ends with reason "stop" after 3 tokens, the tokens after the stop never counted."""
    chk = _b38(kv_policy)
    s = chk.scheduler
    chk.complete(chk.schedule())
    plan = chk.schedule()
    assert [(c.rid, c.num_tokens, c.start) for c in plan.decodes] == [(1, 3, 2), (2, 3, 2)]
    assert plan.num_tokens == 6
    assert s.request_state(1).num_generated == 1  # nothing charged before the step is applied
    assert chk.complete(plan, stopped=[2], num_accepted={1: 3, 2: 2}) == (1, 2)
    assert s.last_finished == {1: FinishReason.LENGTH, 2: FinishReason.STOP}
    assert not s.has_unfinished() and s.kv_free == s.stats().kv_total
    chk.check_final()


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_b38_a_stop_on_the_last_allowed_token_is_a_stop_and_overlong_acceptance_changes_nothing(kv_policy):
    """A stop on the token that also reaches max_new is reported as "stop" (the stop is checked first);
    accepting more tokens than the entry verified (4 of 3) is refused and changes nothing."""
    chk = _b38(kv_policy)
    s = chk.scheduler
    chk.complete(chk.schedule())
    plan = chk.schedule()
    with pytest.raises(SchedulerStateError, match=r"num_accepted\[1\] = 4, must be an integer from 1 to 3"):
        s.complete(plan, num_accepted={1: 4})
    assert s.request_state(1).num_generated == 1 and s.step == 1
    chk.complete(plan, stopped=[1], num_accepted={1: 3, 2: 1})
    assert s.last_finished == {1: FinishReason.STOP}
    assert s.request_state(2).num_generated == 2
    while s.has_unfinished():
        chk.complete(chk.schedule())
    chk.check_final()


def _b41() -> tuple[InvariantChecker, dict[int, list[tuple[object, int]]]]:
    """B41's config and hand trace up to step 9 (steps from 0): b is preempted at step 8."""
    chk = InvariantChecker(PagedScheduler(token_budget=8, max_seqs=2, num_blocks=6, block_size=4, watermark=0))
    chk.add(Request("a", 5, 10))
    chk.add(Request("b", 6, 10))
    plans = {}
    for _ in range(9):
        plan = chk.schedule()
        plans[plan.step] = [(c.rid, c.num_tokens) for c in plan]
        if plan.preempted:
            plans[plan.step].append(("preempted", len(plan.preempted)))
        chk.complete(plan)
    return chk, plans


def test_b41_hand_trace_preempts_b_at_step_8_and_recomputes_13_tokens():
    """s0 [(a,5),(b,3)]; s1 [(a,1),(b,3)]; s2..s7 both decode; s8 both need a 4th block, none free, b (7 tokens
    emitted) is preempted; a finishes at s9; b is readmitted at s10 and recomputes 13 tokens as (b,8) at s10
    and (b,5, start 8) at s11."""
    chk, plans = _b41()
    s = chk.scheduler
    assert plans[0] == [("a", 5), ("b", 3)] and plans[1] == [("a", 1), ("b", 3)]
    assert all(plans[k] == [("a", 1), ("b", 1)] for k in range(2, 8))
    assert plans[8] == [("a", 1), ("preempted", 1)]
    st = s.request_state("b")
    assert (st.status, st.num_generated, st.num_preemptions) == (RequestStatus.PREEMPTED, 7, 1)
    chk.complete(chk.schedule())
    assert s.last_finished == {"a": FinishReason.LENGTH}
    p10 = chk.schedule()
    assert [(c.rid, c.num_tokens, c.start) for c in p10] == [("b", 8, 0)]
    chk.complete(p10)
    p11 = chk.schedule()
    assert [(c.rid, c.num_tokens, c.start, c.is_last) for c in p11] == [("b", 5, 8, True)]
    chk.complete(p11)
    while s.has_unfinished():
        chk.complete(chk.schedule())
    chk.check_final()


def test_b41_abort_of_a_preempted_request_frees_its_slot_and_a_replacement_runs():
    """Aborting b while it waits preempted removes it at once: it holds no slot and no block, the next
    request is admitted into the free slot, and schedule() never fails for want of one."""
    chk, _ = _b41()
    s = chk.scheduler
    chk.abort("b")
    assert (s.num_running, s.num_waiting) == (1, 0)
    chk.add(Request("c", 4, 2))
    plan = chk.schedule()
    assert plan.admitted == ("c",) and s.num_running == 2
    chk.complete(plan)
    while s.has_unfinished():
        chk.complete(chk.schedule())
    chk.check_final()


def test_b41_abort_while_recomputing_reclaims_every_block_at_complete():
    """Aborting b while its recompute chunk is in flight (step 10) takes effect at that complete(): it emits
    nothing and every block returns to the pool."""
    chk, _ = _b41()
    s = chk.scheduler
    chk.complete(chk.schedule())  # step 9: a finishes
    plan = chk.schedule()
    assert plan.admitted == ("b",) and s.stats().num_used_blocks == 2
    chk.abort("b")
    assert s.num_running == 1  # deferred: the engine may still be writing its KV
    assert chk.complete(plan) == ()
    assert s.last_finished == {"b": FinishReason.ABORT}
    assert s.stats().num_free_blocks == s.stats().num_blocks and not s.has_unfinished()
    chk.check_final()
