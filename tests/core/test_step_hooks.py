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


def test_an_identity_cap_changes_no_plan():
    """A cap that always answers n gives the same plans as no cap (seeded random workload, paged, K = 1)."""
    def run(with_cap):
        rng = random.Random(7)
        s = make_scheduler(token_budget=16, max_seqs=4, kv_tokens=400, kv_policy="paged", block_size=8)
        out = []
        for i in range(30):
            s.add(Request(i, rng.randint(1, 60), rng.randint(1, 12)))
        while s.has_unfinished():
            plan = s.schedule(chunk_cap=(lambda r, st, n: n)) if with_cap else s.schedule()
            out.append((tuple(plan.decode_rids), _chunks(plan), plan.preempted))
            s.complete(plan)
        return out
    assert run(True) == run(False)


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
    with pytest.raises(InvalidConfig, match="admit must be a bool, got 'no'"):
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
