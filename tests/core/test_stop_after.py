"""stop_after(): a request whose output length is known ends with reason "stop" on that token, under both
KV policies, across a preemption, and bad calls change nothing."""

from __future__ import annotations

import pytest

from stallfree import FinishReason, PagedScheduler, Request, Scheduler, SchedulerStateError
from stallfree.core.invariants import InvariantChecker


def test_stop_after_ends_on_that_token_with_reason_stop_and_keeps_the_reservation():
    """Prompt 3, max_new 10, stop_after 3: first token at step 0, decodes at steps 1 and 2, finished at step 2
    with reason "stop"; 13 tokens of KV stay reserved until then (the reservation is for max_new)."""
    chk = InvariantChecker(Scheduler(8, 4, 100))
    chk.add(Request(1, 3, 10))
    chk.stop_after(1, 3)
    finished = {}
    while chk.has_unfinished():
        plan = chk.schedule()
        assert chk.kv_free == 87
        chk.complete(plan)
        finished.update({rid: (plan.step, why) for rid, why in chk.last_finished.items()})
    assert finished == {1: (2, FinishReason.STOP)}
    chk.check_final()


@pytest.mark.parametrize(
    ("n", "match"), [(0, "from 1 to max_new = 10"), (11, "from 1 to max_new = 10"), (True, "True")],
    ids=["zero", "over-max-new", "bool"],
)
def test_stop_after_bad_count_is_refused_and_changes_nothing(n, match):
    """A count outside 1..max_new (or not an integer) raises SchedulerStateError naming it."""
    s = Scheduler(8, 4, 100)
    s.add(Request(1, 3, 10))
    with pytest.raises(SchedulerStateError, match=match):
        s.stop_after(1, n)
    s.stop_after(1, 10)  # max_new itself is allowed: it ends with "length"


def test_stop_after_needs_a_waiting_request():
    """An unknown rid is a KeyError; a request already admitted is refused."""
    s = Scheduler(8, 4, 100)
    with pytest.raises(KeyError):
        s.stop_after(9, 1)
    s.add(Request(1, 3, 10))
    s.complete(s.schedule())
    with pytest.raises(SchedulerStateError, match="admitted already"):
        s.stop_after(1, 2)


def test_stop_after_holds_across_a_preemption():
    """B41's paged config: b (stop after 9 tokens) is preempted at step 8 with 7 tokens, recomputes, and ends
    on its 9th token with reason "stop"; a runs to max_new ("length")."""
    chk = InvariantChecker(PagedScheduler(token_budget=8, max_seqs=2, num_blocks=6, block_size=4, watermark=0))
    chk.add(Request("a", 5, 10))
    chk.add(Request("b", 6, 10))
    chk.stop_after("b", 9)
    reasons = {}
    while chk.has_unfinished():
        chk.complete(chk.schedule())
        reasons.update(chk.last_finished)
    assert chk.num_preemptions == 1
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.STOP}
    chk.check_final()
