"""The engine's per-step hooks: schedule(admit=False), schedule(chunk_cap=...) and add(front=True)."""

from __future__ import annotations

import random
import zlib

import pytest

from factories import make_scheduler
from stallfree import InvalidConfig, Request, RequestRejected, Scheduler, SchedulerStateError
from stallfree.core.invariants import InvariantChecker, InvariantViolation


def _chunks(plan):
    return [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills]


class _Calls:
    """A chunk cap answering from a table {(rid, start, n): m} (default: n), recording every call."""

    def __init__(self, table=None):
        self.table = dict(table or {})
        self.calls = []

    def __call__(self, rid, start, n):
        self.calls.append((rid, start, n))
        return self.table.get((rid, start, n), n)


# ---------------------------------------------------------------- chunk_cap, worked by hand


def test_chunk_cap_shortens_a_first_chunk_and_closes_the_budget():
    """Budget 8; A (20 tokens) then B (3): the cap gives A's first chunk 5 of its 8 tokens. A does not finish,
    so it keeps the rest of the budget (B waits), and continues uncapped at token 5 next step."""
    chk = InvariantChecker(make_scheduler(token_budget=8))
    chk.add(Request("A", 20, 2))
    chk.add(Request("B", 3, 2))
    cap = _Calls({("A", 0, 8): 5})
    plan = chk.schedule(chunk_cap=cap)
    assert cap.calls == [("A", 0, 8)]
    assert _chunks(plan) == [("A", 5, 0, False)] and plan.admitted == ("A",) and plan.num_tokens == 5
    chk.complete(plan)
    plan = chk.schedule()
    assert _chunks(plan) == [("A", 8, 5, False)]
    chk.complete(plan)
    plan = chk.schedule()  # A's last 7 tokens, then B's first token in the 1 left
    assert _chunks(plan) == [("A", 7, 13, True), ("B", 1, 0, False)]
    chk.complete(plan)


def test_chunk_cap_zero_for_the_head_stops_admission():
    """A cap of 0 for the queue's head admits nothing, not even B behind it (admission stays in queue order)."""
    chk = InvariantChecker(make_scheduler(token_budget=8))
    chk.add(Request("A", 4, 2))
    chk.add(Request("B", 4, 2))
    cap = _Calls({("A", 0, 4): 0})
    plan = chk.schedule(chunk_cap=cap)
    assert cap.calls == [("A", 0, 4)] and not plan and plan.admitted == ()
    chk.complete(plan)
    assert chk.num_waiting == 2


def test_chunk_cap_zero_for_the_partial_prefill_lets_decodes_run():
    """Budget 8: D decodes, A (12 tokens) has 8 left to prefill; a cap of 0 holds A's chunk for a step while D's
    decode runs, and nothing is admitted behind A."""
    chk = InvariantChecker(make_scheduler(token_budget=8))
    chk.add(Request("D", 1, 5))
    chk.complete(chk.schedule())  # D's prompt
    chk.add(Request("A", 12, 2))
    plan = chk.schedule()
    assert plan.decode_rids == ("D",) and _chunks(plan) == [("A", 7, 0, False)]
    chk.complete(plan)
    chk.add(Request("B", 1, 2))
    cap = _Calls({("A", 7, 5): 0})
    plan = chk.schedule(chunk_cap=cap)
    assert cap.calls == [("A", 7, 5)]
    assert plan.decode_rids == ("D",) and _chunks(plan) == [] and plan.admitted == ()
    chk.complete(plan)
    plan = chk.schedule()
    assert _chunks(plan) == [("A", 5, 7, True), ("B", 1, 0, True)]


def test_chunk_cap_is_asked_again_for_a_top_up():
    """K = 2, L = 1, T = 4, budget 10, one long prompt A (20) and no decodes: its admission chunk is T = 4
    (cap asked for 4), the top-up adds the 6 left and asks for the whole 10; the cap's 7 leaves a chunk of 7."""
    chk = InvariantChecker(make_scheduler(
        token_budget=10, max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=4))
    chk.add(Request("A", 20, 2))
    cap = _Calls({("A", 0, 10): 7})
    plan = chk.schedule(chunk_cap=cap)
    assert cap.calls == [("A", 0, 4), ("A", 0, 10)]
    assert _chunks(plan) == [("A", 7, 0, False)]
    chk.complete(plan)


def test_chunk_cap_is_rounded_to_blocks_when_chunks_are_aligned():
    """Block-aligned chunks (block 4): a cap of 7 of 8 tokens gives a chunk of 4 (ends on a block boundary)."""
    chk = InvariantChecker(make_scheduler(token_budget=8, kv_policy="paged", block_size=4, align_chunks=True))
    chk.add(Request("A", 20, 2))
    plan = chk.schedule(chunk_cap=_Calls({("A", 0, 8): 7}))
    assert _chunks(plan) == [("A", 4, 0, False)]
    chk.complete(plan)


def _plans_of_a_random_run(seed: int, **hooks) -> list:
    """The plans of a seeded random workload (30 requests, paged, K = 1), each step scheduled with `hooks`."""
    rng = random.Random(seed)
    s = make_scheduler(token_budget=16, max_seqs=4, kv_tokens=400, kv_policy="paged", block_size=8)
    out = []
    for i in range(30):
        s.add(Request(i, rng.randint(1, 60), rng.randint(1, 12)))
    while s.has_unfinished():
        plan = s.schedule(**hooks)
        out.append((tuple(plan.decode_rids), _chunks(plan), plan.preempted))
        s.complete(plan)
    return out


def test_an_identity_cap_changes_no_plan():
    """A cap that always answers n gives the same plans as no cap (seeded random workload, paged, K = 1)."""
    assert _plans_of_a_random_run(7, chunk_cap=lambda r, st, n: n) == _plans_of_a_random_run(7)


# ---------------------------------------------------------------- admit=False


def test_admit_false_runs_the_running_and_admits_nothing():
    """D decodes and B waits: schedule(admit=False) runs D's decode only; the next step admits B."""
    chk = InvariantChecker(make_scheduler(token_budget=8))
    chk.add(Request("D", 2, 4))
    chk.complete(chk.schedule())
    chk.add(Request("B", 3, 2))
    plan = chk.schedule(admit=False)
    assert plan.decode_rids == ("D",) and _chunks(plan) == [] and chk.num_waiting == 1
    chk.complete(plan)
    plan = chk.schedule()
    assert plan.decode_rids == ("D",) and _chunks(plan) == [("B", 3, 0, True)]


def test_admit_false_with_partial_prefills():
    """K = 2: a partial prefill goes on under admit=False, the waiting request stays queued."""
    chk = InvariantChecker(make_scheduler(
        token_budget=6, max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=100))
    chk.add(Request("A", 10, 2))
    chk.complete(chk.schedule())  # A: 6 of 10
    chk.add(Request("B", 2, 2))
    plan = chk.schedule(admit=False)
    assert _chunks(plan) == [("A", 4, 6, True)] and plan.admitted == ()
    chk.complete(plan)


# ---------------------------------------------------------------- add(front=True)


def test_add_front_goes_ahead_of_every_waiting_request():
    """FCFS, budget 3, each prompt 3 tokens: A, B, then C at the front: admitted one a step, C, A, B."""
    chk = InvariantChecker(make_scheduler(token_budget=3))
    chk.add(Request("A", 3, 1))
    chk.add(Request("B", 3, 1))
    chk.add(Request("C", 3, 1), front=True)
    order = []
    while chk.has_unfinished():
        plan = chk.schedule()
        order += list(plan.admitted)
        chk.complete(plan)
    assert order == ["C", "A", "B"]
    chk.check_final()


def test_add_front_stays_ahead_of_a_later_victim():
    """Paged, 3 blocks of 4 tokens, budget 4: A (4 tokens) runs and B (4) is admitted behind it. F is added at
    the front; A's growth preempts B, which is queued behind F (F was added at the front after B's add)."""
    chk = InvariantChecker(make_scheduler(token_budget=8, max_seqs=4, kv_tokens=12, kv_policy="paged",
                                          block_size=4))
    chk.add(Request("A", 4, 6))
    chk.add(Request("B", 4, 6))
    chk.complete(chk.schedule())  # A and B prefilled: 2 blocks held
    chk.add(Request("F", 8, 1), front=True)
    seen = []
    while chk.has_unfinished():
        plan = chk.schedule()
        seen.append((plan.admitted, plan.preempted))
        chk.complete(plan)
    chk.check_final()
    admitted = [rid for a, _ in seen for rid in a]
    assert "B" in [rid for _, p in seen for rid in p]
    assert admitted.index("F") < admitted.index("B")


@pytest.mark.parametrize("front, policy, match", [
    ("yes", "fcfs", "front must be a bool"),
    (True, "priority", "front=True needs policy='fcfs'"),
])
def test_add_front_bad_input_is_refused_and_nothing_is_queued(front, policy, match):
    s = make_scheduler(policy=policy)
    s.add(Request("A", 3, 1))
    with pytest.raises(RequestRejected, match=match):
        s.add(Request("B", 3, 1), front=front)
    assert s.num_waiting == 1
    with pytest.raises(KeyError):
        s.request_state("B")
    s.add(Request("B", 3, 1))  # the rid was never taken
    assert s.num_waiting == 2


# ---------------------------------------------------------------- bad input, and the checker


def test_schedule_bad_hook_arguments_are_refused_with_nothing_in_flight():
    s = make_scheduler()
    s.add(Request("A", 3, 1))
    with pytest.raises(InvalidConfig, match="admit must be a bool or callable, got 'no'"):
        s.schedule(admit="no")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="chunk_cap must be None or callable, got 5"):
        s.schedule(chunk_cap=5)  # type: ignore[arg-type]
    plan = s.schedule()
    assert _chunks(plan) == [("A", 3, 0, True)]


@pytest.mark.parametrize("answer", [9, -1, 2.0, True])
def test_a_cap_answer_out_of_range_is_an_error(answer):
    s = make_scheduler(token_budget=8)
    s.add(Request("A", 20, 1))
    with pytest.raises(SchedulerStateError, match=rf"chunk_cap\('A', start=0, n=8\) returned {answer!r}"):
        s.schedule(chunk_cap=lambda rid, start, n: answer)


class _IgnoresCap(Scheduler):
    def schedule(self, token_budget=None, *, admit=True, chunk_cap=None):
        return super().schedule(token_budget, admit=admit)


class _AdmitsAnyway(Scheduler):
    def schedule(self, token_budget=None, *, admit=True, chunk_cap=None):
        return super().schedule(token_budget, chunk_cap=chunk_cap)


def test_the_checker_catches_a_chunk_over_its_cap():
    chk = InvariantChecker(_IgnoresCap(token_budget=8, max_seqs=4, kv_tokens=1000))
    chk.add(Request("A", 20, 1))
    with pytest.raises(InvariantViolation, match="chunk"):
        chk.schedule(chunk_cap=lambda rid, start, n: 3)


def test_the_checker_catches_an_admission_under_admit_false():
    chk = InvariantChecker(_AdmitsAnyway(token_budget=8, max_seqs=4, kv_tokens=1000))
    chk.add(Request("A", 4, 1))
    with pytest.raises(InvariantViolation, match="prefill chunks"):
        chk.schedule(admit=False)


@pytest.mark.parametrize("options", [
    {},
    {"kv_policy": "paged", "block_size": 4},
    {"kv_policy": "paged", "block_size": 4, "align_chunks": True},
    {"max_num_partial_prefills": 2, "max_long_partial_prefills": 1, "long_prefill_token_threshold": 16,
     "kv_policy": "paged", "block_size": 4},
], ids=["reserve", "paged", "aligned", "multi"])
def test_random_caps_admits_and_front_adds_keep_every_invariant(options):
    """Seeded: caps from a hash of (rid, start, n), one step in five admits nothing, one add in five at the front
    (fcfs), tight KV so that requests are preempted; the checker works out every plan."""
    rng = random.Random(11)
    s = Scheduler(token_budget=24, max_seqs=5, kv_tokens=240, **options)
    chk = InvariantChecker(s)

    def cap(rid, start, n):
        h = zlib.crc32(f"{rid}/{start}/{n}".encode())
        return n if h % 3 else h % (n + 1)

    reqs = [Request(i, rng.randint(1, 80), rng.randint(1, 30)) for i in range(40)]
    arrive = sorted(rng.randint(0, 60) for _ in reqs)
    i = 0
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrive[i] <= s.step:
            chk.add(reqs[i], front=rng.random() < 0.2)
            i += 1
        plan = chk.schedule(admit=rng.random() >= 0.2, chunk_cap=cap if rng.random() < 0.7 else None)
        chk.complete(plan, [r for r in plan.sampled_rids if rng.random() < 0.05])
        assert s.step < 20_000
    chk.check_final()
    assert chk.num_preemptions > 0 or not options  # the paged runs preempt


# ---------------------------------------------------------------- the queue's read-only view, and membership


def test_waiting_order_peek_and_membership_by_hand():
    """FCFS, budget 3, prompts of 3 tokens: A, B, then C at the front. The queue reads C, A, B; C is admitted
    first, and once its one token is out it is no longer a member."""
    s = make_scheduler(token_budget=3)
    assert s.waiting_order() == () and s.peek_waiting() is None and "A" not in s
    s.add(Request("A", 3, 1))
    s.add(Request("B", 3, 1))
    s.add(Request("C", 3, 1), front=True)
    assert s.waiting_order() == ("C", "A", "B") and s.peek_waiting() == "C"
    assert "A" in s and "B" in s and "Z" not in s and [1] not in s
    plan = s.schedule()
    assert plan.admitted == ("C",) and s.waiting_order() == ("A", "B") and s.peek_waiting() == "A"
    assert "C" in s  # running while its step is in flight
    s.complete(plan)
    assert "C" not in s and s.waiting_order() == ("A", "B")
    s.abort("B")
    assert s.waiting_order() == ("A",) and "B" not in s


def test_waiting_order_under_priority():
    """policy="priority": the order is (priority, add order); a copy, so changing it changes nothing."""
    s = make_scheduler(policy="priority")
    s.add(Request("A", 3, 1, priority=2))
    s.add(Request("B", 3, 1, priority=0))
    s.add(Request("C", 3, 1, priority=2))
    order = s.waiting_order()
    assert order == ("B", "A", "C") and s.peek_waiting() == "B"
    assert isinstance(order, tuple) and s.waiting_order() == order


# ---------------------------------------------------------------- schedule(admit=filter)


class _Filter:
    """An admission filter refusing the rids in `refuse`, recording every call."""

    def __init__(self, refuse=()):
        self.refuse = set(refuse)
        self.calls = []

    def __call__(self, rid):
        self.calls.append(rid)
        return rid not in self.refuse


@pytest.mark.parametrize("options", [{}, {"max_num_partial_prefills": 2, "max_long_partial_prefills": 1,
                                          "long_prefill_token_threshold": 100}], ids=["K1", "K2"])
def test_an_admission_filter_passes_over_the_refused_who_keep_their_places(options):
    """Budget 8; A (4 tokens), B (3), C (2) wait. The filter refuses A: B and C are admitted (3 + 2 tokens, both
    whole), A stays at the head. The next step (no filter) runs B's and C's decodes and admits A (4 tokens)."""
    chk = InvariantChecker(make_scheduler(token_budget=8, **options))
    for rid, n in (("A", 4), ("B", 3), ("C", 2)):
        chk.add(Request(rid, n, 2))
    flt = _Filter({"A"})
    plan = chk.schedule(admit=flt)
    assert flt.calls == ["A", "B", "C"]
    assert _chunks(plan) == [("B", 3, 0, True), ("C", 2, 0, True)] and plan.admitted == ("B", "C")
    assert chk.scheduler.waiting_order() == ("A",)
    chk.complete(plan)
    plan = chk.schedule()
    assert plan.decode_rids == ("B", "C") and _chunks(plan) == [("A", 4, 0, True)] and plan.admitted == ("A",)
    chk.complete(plan)


def test_a_refused_head_keeps_its_place_ahead_of_later_adds():
    """A is refused in step 0 while B is admitted; D is added after. A is still the head: order A, D."""
    s = make_scheduler(token_budget=3)
    s.add(Request("A", 3, 1))
    s.add(Request("B", 3, 1))
    plan = s.schedule(admit=_Filter({"A"}))
    assert plan.admitted == ("B",)
    s.complete(plan)
    s.add(Request("D", 3, 1))
    assert s.waiting_order() == ("A", "D")
    plan = s.schedule()
    assert plan.admitted == ("A",)


def test_a_filter_that_refuses_everyone_admits_nothing_and_decodes_go_on():
    chk = InvariantChecker(make_scheduler(token_budget=8))
    chk.add(Request("D", 2, 4))
    chk.complete(chk.schedule())
    chk.add(Request("B", 3, 2))
    plan = chk.schedule(admit=lambda rid: False)
    assert plan.decode_rids == ("D",) and _chunks(plan) == [] and chk.scheduler.waiting_order() == ("B",)
    chk.complete(plan)


@pytest.mark.parametrize("answer", ["yes", None, 1, 0])
def test_a_filter_answer_that_is_not_a_bool_is_refused_and_nothing_changes(answer):
    """The filter's answers are checked before anything changes: the error names the rid and the value, no plan
    is in flight, and the next schedule() plans what it would have planned anyway."""
    def build():
        s = make_scheduler(token_budget=8, kv_policy="paged", block_size=4)
        s.add(Request("D", 5, 4))
        s.complete(s.schedule())
        s.add(Request("A", 4, 2))
        s.add(Request("B", 6, 2))
        return s
    s, twin = build(), build()
    free = s.stats().num_free_blocks
    with pytest.raises(InvalidConfig, match=rf"admit\('B'\) must return a bool, got {answer!r}"):
        s.schedule(admit=lambda rid: True if rid == "A" else answer)
    assert s.waiting_order() == ("A", "B") and s.stats().num_free_blocks == free and s.step == twin.step
    got, want = s.schedule(), twin.schedule()
    assert (got.decode_rids, _chunks(got), got.admitted) == (want.decode_rids, _chunks(want), want.admitted)
    assert _chunks(got) == [("A", 4, 0, True), ("B", 3, 0, False)]


def test_a_filter_refusing_nothing_changes_no_plan():
    """A filter that always admits gives the same plans as admit=True (seeded random workload, paged, K = 1)."""
    assert _plans_of_a_random_run(5, admit=lambda rid: True) == _plans_of_a_random_run(5)


class _IgnoresFilter(Scheduler):
    def schedule(self, token_budget=None, *, admit=True, chunk_cap=None):
        if callable(admit):
            for rid in self.waiting_order():
                admit(rid)
            admit = True
        return super().schedule(token_budget, admit=admit, chunk_cap=chunk_cap)


def test_the_checker_catches_an_admission_the_filter_refused():
    chk = InvariantChecker(_IgnoresFilter(token_budget=8, max_seqs=4, kv_tokens=1000))
    chk.add(Request("A", 4, 1))
    chk.add(Request("B", 4, 1))
    with pytest.raises(InvariantViolation, match="prefill chunks"):
        chk.schedule(admit=lambda rid: rid != "A")


@pytest.mark.parametrize("options", [
    {"kv_policy": "paged", "block_size": 4},
    {"max_num_partial_prefills": 2, "max_long_partial_prefills": 1, "long_prefill_token_threshold": 16,
     "kv_policy": "paged", "block_size": 4},
    {"kv_policy": "paged", "block_size": 4, "policy": "priority"},
], ids=["paged", "multi", "priority"])
def test_random_admission_filters_keep_every_invariant(options):
    """Seeded: a filter refusing by a hash of (rid, step) in one step of three, tight KV so that requests are
    preempted, some adds at the front (fcfs); the checker works out every plan."""
    rng = random.Random(13)
    s = Scheduler(token_budget=24, max_seqs=5, kv_tokens=240, **options)
    chk = InvariantChecker(s)
    reqs = [Request(i, rng.randint(1, 80), rng.randint(1, 30), priority=rng.randint(0, 2)) for i in range(40)]
    arrive = sorted(rng.randint(0, 60) for _ in reqs)
    i = 0
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrive[i] <= s.step:
            chk.add(reqs[i], front=options.get("policy") != "priority" and rng.random() < 0.2)
            i += 1
        step = s.step
        flt = (lambda rid, step=step: zlib.crc32(f"{rid}/{step}".encode()) % 2 == 0) if rng.random() < 0.35 else True
        plan = chk.schedule(admit=flt)
        chk.complete(plan)
        assert s.step < 20_000
    chk.check_final()
    assert chk.num_preemptions > 0
