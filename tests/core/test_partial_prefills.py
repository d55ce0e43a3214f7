"""Concurrent partial prefills (max_num_partial_prefills, max_long_partial_prefills,
long_prefill_token_threshold): hand traces, the progress bound, validation and seeded random runs."""

from __future__ import annotations

import random

import pytest

from factories import RandomWorkload
from stallfree import Request, Scheduler
from stallfree.core.errors import InvalidConfig
from stallfree.core.invariants import InvariantChecker
from stallfree.core.request import FinishReason


def _step(chk: InvariantChecker, stopped=()):
    plan = chk.schedule()
    chk.complete(plan, stopped)
    return plan.decode_rids, [(c.rid, c.num_tokens, c.is_last) for c in plan.prefills]


def test_hand_trace_long_prompt_is_passed_and_tops_up():
    """Budget 8, K=2, L=1, T=4: a 20-token prompt takes T=4 then the rest of the budget while no
    decode runs, but only T=4 in a step with a decode; a 3-token prompt is admitted beside it; a
    6-token (long) prompt waits while one long prompt is partial."""
    chk = InvariantChecker(Scheduler(8, 4, 1000, max_num_partial_prefills=2, long_prefill_token_threshold=4))
    chk.add(Request("L", 20, 2))
    # Alone, with no decode, the long prompt gets T=4, then the 4 left over (work-conserving).
    assert _step(chk) == ((), [("L", 8, False)])
    chk.add(Request("a", 3, 2))
    chk.add(Request("b", 6, 1))
    # L: 4 (long); a: 3 (short, passes b); b is long and L=1 long prompt is partial: it waits;
    # no decode in the step, so the 1 token left goes back to L.
    assert _step(chk) == ((), [("L", 5, False), ("a", 3, True)])
    # a decodes (1); L (7 left, long) takes T=4 and, with a decode in the step, nothing more: 3 idle.
    assert _step(chk) == (("a",), [("L", 4, False)])
    # No decode (a finished): L's last 3 (short now) finish; b is admitted with T=4 and the 1 left over.
    assert _step(chk) == ((), [("L", 3, True), ("b", 5, False)])
    # L decodes; b's last token (short) finishes.
    assert _step(chk) == (("L",), [("b", 1, True)])
    assert chk.scheduler.last_finished == {"L": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    chk.check_final()


def test_hand_trace_short_prompts_pass_a_waiting_long_one():
    """Budget 10, K=3, L=1, T=4: with A (30 tokens) partial, B (30, long) waits and C (2) passes it;
    A gets 4 + the 4 left over."""
    chk = InvariantChecker(Scheduler(10, 8, 1000, max_num_partial_prefills=3, long_prefill_token_threshold=4))
    chk.add(Request("A", 30, 1))
    assert _step(chk) == ((), [("A", 10, False)])
    chk.add(Request("B", 30, 1))
    chk.add(Request("C", 2, 1))
    assert _step(chk) == ((), [("A", 8, False), ("C", 2, True)])
    # A has 12 left: 4, then the 6 left over (B still waits: A is a partial long prompt).
    assert _step(chk) == ((), [("A", 10, False)])
    # A's last 2 tokens finish; B is admitted with T=4, then takes the 4 left over.
    assert _step(chk) == ((), [("A", 2, True), ("B", 8, False)])
    while chk.scheduler.has_unfinished():
        _step(chk)
    chk.check_final()


def test_hand_trace_two_long_prompts_with_l_two():
    """Budget 10, K=2, L=2, T=3: two long prompts each take 3, then the 4 left go to the older one."""
    chk = InvariantChecker(Scheduler(
        10, 8, 1000, max_num_partial_prefills=2, max_long_partial_prefills=2, long_prefill_token_threshold=3))
    chk.add(Request("A", 20, 1))
    chk.add(Request("B", 20, 1))
    # Admission: A takes T=3 (long), B takes T=3 (long, L=2); the 4 left go back to A.
    assert _step(chk) == ((), [("A", 7, False), ("B", 3, False)])
    # Partial phase: A 3, B 3; nothing waits; the 4 left go to A.
    assert _step(chk) == ((), [("A", 7, False), ("B", 3, False)])


def test_contract_unchanged_with_k_one():
    """max_num_partial_prefills=1 (the default) gives the contract's plans: the hand trace of DESIGN
    (budget 8, one decode, a 20-token prompt -> chunks 7, 7, 6)."""
    s = Scheduler(8, 4, 1000, max_num_partial_prefills=1)
    assert s.config.partial_prefill_limits == (1, 1, None)
    chk = InvariantChecker(s)
    chk.add(Request("d", 1, 10))
    _step(chk)
    chk.add(Request("p", 20, 1))
    assert [_step(chk)[1] for _ in range(3)] == [[("p", 7, False)], [("p", 7, False)], [("p", 6, True)]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_partial_prefills": 2}, "long_prefill_token_threshold"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
        ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3, "long_prefill_token_threshold": 4},
         "max_long_partial_prefills"),
        ({"long_prefill_token_threshold": 4}, "long_prefill_token_threshold"),
        ({"max_num_partial_prefills": 2, "long_prefill_token_threshold": 0}, "long_prefill_token_threshold"),
        ({"max_num_partial_prefills": 2, "long_prefill_token_threshold": 4, "block_size": 8}, "block_size"),
    ],
    ids=["k2-no-threshold", "k0", "l-above-k", "threshold-with-k1", "threshold-0", "threshold-below-block"],
)
def test_bad_options_are_rejected(kwargs, field):
    """Out-of-range partial-prefill options raise InvalidConfig naming the field."""
    with pytest.raises(InvalidConfig, match=field):
        Scheduler(16, 4, 1000, **kwargs)


def _progress_bound_run(seed: int, num_requests: int) -> int:
    rng = random.Random(seed)
    budget = rng.randint(4, 64)
    thr = rng.randint(1, 32)
    k = rng.randint(2, 4)
    s = Scheduler(budget, rng.randint(2, 8), 100_000, max_num_partial_prefills=k,
                  max_long_partial_prefills=rng.randint(1, k), long_prefill_token_threshold=thr)
    chk = InvariantChecker(s)
    arrivals = sorted(rng.randint(0, 60) for _ in range(num_requests))
    reqs = [Request(i, rng.choice([rng.randint(1, 20), rng.randint(50, 400)]), rng.randint(1, 20))
            for i in range(num_requests)]
    i = checked = 0
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrivals[i] <= s.step:
            chk.add(reqs[i])
            i += 1
        # Admission order; under "reserve" an episode prefills its prompt.
        rests = [(rid, reqs[rid].prompt_len - s.request_state(rid).num_prefilled) for rid in s.partial_prefills]
        plan = chk.schedule()
        left = plan.token_budget - sum(c.num_tokens for c in plan.decodes)
        for j, (rid, rest) in enumerate(rests):
            got = sum(c.num_tokens for c in plan.prefills if c.rid == rid)
            # Each partial prefill before it in order took at most T (a long one is capped at T, a
            # short one has at most T left), so the j-th gains at least min(T, rest, left - j T).
            assert got >= min(thr, rest, left - j * thr), (seed, s.step, j, got, thr, rest, left)
            if plan.num_decodes and rest > thr:
                # A step with decodes gives a long prompt at most T: no top-up.
                assert got <= thr, (seed, s.step, got, thr, rest)
            checked += 1
        chk.complete(plan)
    chk.check_final()
    return checked


def test_progress_bound_quick():
    """The j-th partial prefill in admission order gains at least min(T, its rest, budget left after
    decodes - j T) tokens every step, and a long one at most T in a step with decodes (FCFS, exact
    chunks), over 10 seeded runs."""
    assert sum(_progress_bound_run(seed, 12) for seed in range(10)) > 50


@pytest.mark.slow
def test_progress_bound_long():
    """As the quick variant, over 80 seeded runs of 60 requests."""
    assert sum(_progress_bound_run(seed, 60) for seed in range(80)) > 400


_CONFIGS = [
    {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 40},
    {"max_num_partial_prefills": 3, "max_long_partial_prefills": 2, "long_prefill_token_threshold": 16},
    {"max_num_partial_prefills": 4, "long_prefill_token_threshold": 100, "policy": "priority", "aging_interval": 5},
    {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 16, "block_size": 8},
    {"max_num_partial_prefills": 3, "long_prefill_token_threshold": 24, "kv_policy": "paged", "block_size": 8},
    {"max_num_partial_prefills": 3, "max_long_partial_prefills": 2, "long_prefill_token_threshold": 24,
     "kv_policy": "paged", "block_size": 4, "policy": "priority"},
    {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 30, "num_spec_tokens": 2},
    {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 30, "decode_overflow": "rotate",
     "kv_policy": "paged", "block_size": 4},
]
_IDS = ["k2", "k3-l2", "priority", "aligned", "paged", "paged-priority", "spec", "paged-rotate"]


@pytest.mark.parametrize("options", _CONFIGS, ids=_IDS)
def test_randomized_under_checker_quick(options):
    """3 seeded random runs of 20 requests per option mix (aborts, stops, tight KV, varying step
    budgets) keep every invariant, including the partial-prefill rules, and finish."""
    for seed in range(3):
        RandomWorkload(seed, num_requests=20, options=options, vary_budget=seed % 2 == 1).run()


@pytest.mark.slow
@pytest.mark.parametrize("options", _CONFIGS, ids=_IDS)
def test_randomized_under_checker_long(options):
    """40 seeded random runs per option mix keep every invariant and finish."""
    for seed in range(40):
        RandomWorkload(seed, options=options, vary_budget=seed % 2 == 1).run()


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_stop_on_last_allowed_token_is_stop_from_prefill_and_decode(kv_policy):
    """A stop named on a request's last allowed token is reason "stop", whether the token came from the
    last prefill chunk (max_new=1) or from a decode (max_new=2)."""
    s = Scheduler(64, 4, 1000, kv_policy=kv_policy, block_size=4 if kv_policy == "paged" else None)
    s.add(Request("p", 5, 1))
    s.add(Request("d", 5, 2))
    plan = s.schedule()
    s.complete(plan, stopped=["p"])
    assert s.last_finished == {"p": FinishReason.STOP}
    plan = s.schedule()
    s.complete(plan, stopped=["d"])
    assert s.last_finished == {"d": FinishReason.STOP}
    s2 = Scheduler(64, 4, 1000)
    s2.add(Request("q", 5, 1))
    s2.complete(s2.schedule())
    assert s2.last_finished == {"q": FinishReason.LENGTH}
