"""Runs of plain decode steps taken at once (stallfree.core.plain_steps): two schedulers fed the same
requests, one stepping through schedule()/complete() and one taking runs where it may, plan for plan and
figure for figure the same; hand-worked counts of how many steps are plain; refusals that change nothing."""

from __future__ import annotations

import random

import pytest

from stallfree import InvalidConfig, Request, Scheduler, SchedulerStateError
from stallfree.core.plain_steps import plain_decode_run


def count(s, limit):
    run = plain_decode_run(s, limit)
    return 0 if run is None else run.num_steps


def plan_fields(plan):
    return (plan.step, plan.decode_rids, plan.decode_offsets, tuple(plan.prefills), plan.num_tokens,
            plan.decode_context_sum, plan.token_budget, plan.admitted, plan.preempted, plan.decode_tokens,
            plan.decode_offsets_sorted)


def figures(s):
    st = s.stats()
    return st, s.step, sorted((r, s.request_state(r)) for r in s._live)


def test_counts_by_hand_reserve():
    s = Scheduler(16, 4, 1000)
    s.add(Request("a", 4, 10))
    s.add(Request("b", 3, 6))
    # Step 0 prefills both (7 tokens): not a plain decode step.
    assert plain_decode_run(s, 100) is None
    s.complete(s.schedule())
    # Step 0 emitted each one's first token; "b" has 5 tokens left, its last in step 5; "a"'s in step 9.
    # The run: steps 1 .. 5, the last finishing "b".
    assert count(s, 100) == 5
    assert count(s, 3) == 3
    run = plain_decode_run(s, 100)
    plan = run.plan(2)
    # Step 3: "a" holds its 4 prompt tokens and 3 generated (offset 0 + step 3 + 4 = 7 in all, as
    # schedule() counts a decode's start: offset + step), "b" 3 + 3 = 6.
    assert (plan.step, plan.decode_rids, plan.num_tokens, plan.decode_starts) == (3, ("a", "b"), 2, (6, 5))
    free = run.take(4)
    assert free == [1000 - 14 - 9] * 4  # reservations: prompt + max_new each
    assert (s.step, run.step, run.num_steps, s.last_finished) == (5, 5, 1, {})
    assert run.take(1) == [1000 - 10 - 4]  # step 5 finishes "b": its reservation is freed
    assert (s.step, s.last_finished, s.stats().num_running) == (6, {"b": "length"}, 1)
    assert count(s, 100) == 4  # steps 6 .. 9; "a" finishes in step 9
    plan = s.schedule()
    assert plan.step == 6 and plan.decode_rids == ("a",)


def test_waiting_or_partial_prefill_is_not_plain():
    s = Scheduler(4, 4, 1000)
    s.add(Request("a", 2, 10))
    s.complete(s.schedule())
    assert count(s, 10) == 9  # steps 1 .. 9, the last finishing "a"
    s.add(Request("b", 9, 3))  # waits: the next step admits it
    assert count(s, 10) == 0
    s.complete(s.schedule())  # "b" takes 3 of 4 tokens: a partial prefill remains
    assert count(s, 10) == 0


def test_bad_counts_and_a_changed_scheduler_are_refused_and_change_nothing():
    s = Scheduler(16, 4, 1000)
    s.add(Request("a", 4, 5))
    s.complete(s.schedule())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidConfig, match="limit"):
            plain_decode_run(s, bad)
    run = plain_decode_run(s, 10)
    assert run.num_steps == 4  # steps 1 .. 4, the last finishing "a"
    before = figures(s)
    for bad in (-1, 1.5, True, 5):
        with pytest.raises(SchedulerStateError, match="count"):
            run.take(bad)
        with pytest.raises(SchedulerStateError, match="ahead"):
            run.plan(bad if bad != 5 else 4)
        assert figures(s) == before
    s.add(Request("b", 2, 2))  # the run ends: the next step admits "b"
    with pytest.raises(SchedulerStateError, match="changed"):
        run.take(1)
    assert (s.step, s.stats().num_waiting, s.request_state("a").num_generated) == (1, 1, 1)
    plan = s.schedule()
    assert plain_decode_run(s, 3) is None  # a plan in flight
    s.complete(plan)


def test_paged_stops_before_a_promise_that_fails():
    # 6 blocks of 4 tokens; "a" and "b" (prompt 4, 12 new each, 4 blocks at most): step 0 prefills both,
    # one block each; a decode's token at position 4, 8, 12 starts a block: steps 1, 5 and 9 promise
    # 2 blocks each. Both finish in step 11.
    s = Scheduler(16, 4, 24, kv_policy="paged", block_size=4)
    s.add(Request("a", 4, 12))
    s.add(Request("b", 4, 12))
    s.complete(s.schedule())
    assert s.stats().num_free_blocks == 4
    # Steps 1, 5, 9 promise 2 blocks each: 4 free covers steps 1 .. 8; step 9's promise fails.
    run = plain_decode_run(s, 100)
    assert run.num_steps == 8
    free = run.take(8)
    assert free == [8, 8, 8, 8, 0, 0, 0, 0]
    plan = s.schedule()
    assert plan.preempted == ("b",)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kv", ["reserve", "paged", "paged-cache"])
def test_skipping_matches_stepping(seed, kv):
    rng = random.Random(seed * 7 + len(kv))
    opts = {}
    if kv != "reserve":
        opts = dict(kv_policy="paged", block_size=4, enable_prefix_caching=kv == "paged-cache")
    budget, kv_tokens = rng.choice([(8, 320), (16, 400), (32, 4000)])
    stepper = Scheduler(budget, 6, kv_tokens, **opts)
    skipper = Scheduler(budget, 6, kv_tokens, **opts)
    rid = 0
    skipped = 0
    for _ in range(300):
        if rng.random() < 0.15:
            p, m = rng.randint(1, 40), rng.randint(1, 60)
            hashes = {}
            if kv == "paged-cache":
                hashes = dict(block_hashes=tuple(rng.randint(0, 3) for _ in range(p // 4)))
            for s in (stepper, skipper):
                s.add(Request(rid, p, m, **hashes))
            if rng.random() < 0.3:
                stop = rng.randint(1, m)
                for s in (stepper, skipper):
                    s.stop_after(rid, stop)
            rid += 1
        n = count(skipper, rng.randint(1, 30))
        if n:
            k = rng.randint(1, n)
            run = plain_decode_run(skipper, 100)
            want = [run.plan(i) for i in range(k)]
            free = run.take(k)
            for i in range(k):
                plan = stepper.schedule()
                assert plan_fields(plan) == plan_fields(want[i])
                stepper.complete(plan)
                if i < k - 1 or run.num_steps:
                    assert stepper.last_finished == {}  # only a run's last step finishes requests
                assert stepper.kv_free == free[i]
            assert stepper.last_finished == skipper.last_finished
            skipped += k
        elif stepper.has_unfinished():
            a, b = stepper.schedule(), skipper.schedule()
            assert plan_fields(a) == plan_fields(b)
            stepper.complete(a)
            skipper.complete(b)
            assert stepper.last_finished == skipper.last_finished
        assert figures(stepper) == figures(skipper)
    assert skipped > 10
