"""Scheduler options: per-step budget, speculative tokens, overflow rotation, block alignment, priorities."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from factories import RandomWorkload, make_scheduler, run_to_end
from stallfree import InvalidConfig, Request, RequestRejected, Scheduler, SchedulerStateError
from stallfree.core.invariants import InvariantChecker

CASES = {
    c["id"]: c
    for c in json.loads((Path(__file__).parents[1] / "data" / "public_bug_scenarios.json").read_text())["cases"]
}


def _running_decodes(s, n, prompt=1, max_new=50):
    """Admit n one-token prompts and complete their prefill step so they all decode."""
    for i in range(n):
        s.add(Request(i, prompt, max_new))
    while s.num_waiting or any(s.request_state(i).num_generated == 0 for i in range(n)):
        s.complete(s.schedule())


# ---------------------------------------------------------------- per-step budget and overflow


def test_per_step_budget_limits_one_step_only():
    """schedule(token_budget=b) spends at most b tokens in that step; the next step uses the configured budget."""
    s = make_scheduler(token_budget=16)
    s.add(Request(1, 40, 2))
    plan = s.schedule(token_budget=5)
    assert plan.num_tokens == 5 and plan.token_budget == 5
    s.complete(plan)
    assert s.schedule().num_tokens == 16


@pytest.mark.parametrize("bad", [0, -1, 17, True, 2.5], ids=["zero", "neg", "above", "bool", "float"])
def test_per_step_budget_out_of_range_is_an_error(bad):
    """A per-step budget outside 1..token_budget raises InvalidConfig naming it, and no plan is in flight."""
    s = make_scheduler(token_budget=16)
    s.add(Request(1, 4, 2))
    with pytest.raises(InvalidConfig, match="token_budget"):
        s.schedule(token_budget=bad)
    assert s.schedule().num_tokens == 4


def test_overflow_oldest_serves_oldest_and_delays_the_rest():
    """With 6 ready decodes and a per-step budget of 4, the 4 oldest run; the other 2 skip and finish a step later."""
    s = make_scheduler(token_budget=8, max_seqs=8, kv_tokens=1000)
    _running_decodes(s, 6, max_new=3)  # each has 1 token; 2 decodes left
    plan = s.schedule(token_budget=4)
    assert plan.decode_rids == (0, 1, 2, 3)
    s.complete(plan)
    assert [s.request_state(i).num_generated for i in range(6)] == [2, 2, 2, 2, 1, 1]
    plan = s.schedule()
    assert plan.decode_rids == (0, 1, 2, 3, 4, 5)
    s.complete(plan)
    assert set(s.last_finished) == {0, 1, 2, 3}
    plan = s.schedule()
    assert plan.decode_rids == (4, 5) and [c.start for c in plan.decodes] == [2, 2]
    s.complete(plan)
    assert set(s.last_finished) == {4, 5} and s.kv_free == 1000


@pytest.mark.parametrize(("ready", "fit"), [(7, 3), (5, 2), (4, 3), (9, 1)], ids=["7-3", "5-2", "4-3", "9-1"])
def test_rotate_fairness_bound(ready, fit):
    """With 'rotate', over any k consecutive steps each of R ready decodes runs >= floor(k*S/R) - 1 times."""
    s = make_scheduler(token_budget=16, max_seqs=16, kv_tokens=10_000, decode_overflow="rotate")
    _running_decodes(s, ready, max_new=500)
    served = []
    for _ in range(40):
        plan = s.schedule(token_budget=fit)
        assert plan.num_decodes == fit
        served.append(set(plan.decode_rids))
        s.complete(plan)
    for k in range(1, 41):
        for start in range(0, 41 - k):
            window = served[start : start + k]
            for rid in range(ready):
                assert sum(rid in w for w in window) >= (k * fit) // ready - 1


def test_oldest_overflow_is_unfair_where_rotate_is_not():
    """Under 'oldest' the newest decode starves while the budget stays short; under 'rotate' it does not."""
    counts = {}
    for mode in ("oldest", "rotate"):
        s = make_scheduler(token_budget=8, max_seqs=8, kv_tokens=10_000, decode_overflow=mode)
        _running_decodes(s, 4, max_new=500)
        n = 0
        for _ in range(12):
            plan = s.schedule(token_budget=3)
            n += 3 in plan.decode_rids
            s.complete(plan)
        counts[mode] = n
    assert counts == {"oldest": 0, "rotate": 9}


# ---------------------------------------------------------------- speculative decode tokens


def test_spec_tokens_hand_case():
    """k=3: a decode costs 1 + min(3, tokens left - 1); accepting 4 then 1 ends a max_new=6 request exactly."""
    s = make_scheduler(token_budget=16, kv_tokens=100, num_spec_tokens=3)
    s.add(Request("r", 2, 6))
    s.complete(s.schedule())  # prefill: first token
    plan = s.schedule()
    assert [(c.rid, c.num_tokens, c.start) for c in plan.decodes] == [("r", 4, 2)] and plan.num_tokens == 4
    s.complete(plan, num_accepted={"r": 4})  # 1 + 4 = 5 tokens
    assert s.request_state("r").num_generated == 5
    plan = s.schedule()
    assert [(c.num_tokens, c.start) for c in plan.decodes] == [(1, 6)]  # only 1 token left to make
    s.complete(plan)
    assert s.last_finished == {"r": "length"} and s.kv_free == 100


@pytest.mark.parametrize(
    "bad", [{"r": 0}, {"r": 5}, {"r": 1.0}, {"x": 1}], ids=["zero", "above-cost", "float", "unknown"]
)
def test_num_accepted_validation(bad):
    """num_accepted outside 1..cost, or for a rid that did not decode, raises and changes nothing."""
    s = make_scheduler(token_budget=16, kv_tokens=100, num_spec_tokens=3)
    s.add(Request("r", 2, 10))
    s.complete(s.schedule())
    plan = s.schedule()
    with pytest.raises(SchedulerStateError, match="num_accepted"):
        s.complete(plan, num_accepted=bad)
    assert s.request_state("r").num_generated == 1
    s.complete(plan, num_accepted={"r": 2})
    assert s.request_state("r").num_generated == 3


def test_spec_cost_overflow_is_possible_with_a_fixed_budget():
    """With k=3 and budget 8, four decodes cost 16 > 8: the oldest two run (4 tokens each)."""
    s = make_scheduler(token_budget=8, max_seqs=8, kv_tokens=1000, num_spec_tokens=3)
    _running_decodes(s, 4, max_new=20)
    plan = s.schedule()
    assert plan.decode_rids == (0, 1) and plan.num_tokens == 8


# ---------------------------------------------------------------- block-aligned chunks


def test_block_aligned_hand_trace():
    """Budget 8, B=4: the hand trace's 20-token prompt behind one decode goes 4,4,4,4,4; first token on step 5."""
    s = make_scheduler(token_budget=8, kv_tokens=100, block_size=4)
    s.add(Request("d", 2, 10))
    s.complete(s.schedule())
    s.add(Request("p", 20, 2))
    chunks = []
    while "p" not in s.complete(plan := s.schedule()):
        chunks.append(plan.prefills[0].num_tokens)
    chunks.append(plan.prefills[0].num_tokens)
    assert chunks == [4, 4, 4, 4, 4] and plan.step == 5


@pytest.mark.parametrize(
    ("budget", "prompt", "expected"),
    [(10, 21, [8, 8, 5]), (10, 16, [8, 8]), (16, 16, [16]), (7, 9, [4, 5]), (4, 3, [3])],
    ids=["b10-p21", "b10-p16", "b16-p16", "b7-p9", "b4-p3"],
)
def test_block_aligned_chunk_sizes(budget, prompt, expected):
    """Non-final chunks are whole blocks of 4 (budget rounded down); the final chunk is exact."""
    s = make_scheduler(token_budget=budget, kv_tokens=200, block_size=4)
    s.add(Request(1, prompt, 2))
    chunks = []
    while s.request_state(1).num_generated == 0:
        plan = s.schedule()
        chunks.append(plan.prefills[0].num_tokens)
        s.complete(plan)
    assert chunks == expected


def test_block_aligned_b26_plans():
    """Scenario B26: budget 10, B=4, chunks 8, 8, 5 behind one decode; first token at case step 4, finish at 5."""
    case = CASES["B26"]
    cfg = case["config"]
    s = Scheduler(**cfg)
    arrivals = {r["arrival_step"] - 1: [Request(r["rid"], r["prompt_len"], r["max_new"])] for r in case["requests"]}
    plans, first, finish = run_to_end(s, arrivals)
    exp = case["expected"]
    assert {str(k + 1): [list(e) for e in v] for k, v in plans.items()} == exp["plans"]
    assert {str(k): v + 1 for k, v in first.items()} == exp["first_token_step"]
    assert {str(k): v + 1 for k, v in finish.items()} == exp["finish_step"]


def test_block_aligned_reserves_whole_blocks():
    """KV is reserved as ceil((prompt+max_new)/B) blocks out of floor(kv_tokens/B); too many blocks is rejected."""
    s = make_scheduler(token_budget=8, kv_tokens=102, block_size=4)
    assert s.stats().kv_total == 100
    s.add(Request(1, 21, 2))  # 23 tokens -> 6 blocks = 24 tokens
    s.schedule()
    assert s.kv_free == 76
    with pytest.raises(RequestRejected, match="never fit"):
        s.add(Request(2, 98, 3))  # 101 tokens -> 26 blocks > 25


@pytest.mark.parametrize(
    "kw",
    [{"token_budget": 3, "block_size": 4}, {"block_size": 0}, {"block_size": True}, {"kv_tokens": 3, "block_size": 4}],
    ids=["budget-below-block", "block-0", "block-bool", "kv-below-block"],
)
def test_block_size_config_errors(kw):
    """A budget or KV capacity below one block, or a bad block_size, is rejected at construction."""
    args = {"token_budget": 8, "max_seqs": 2, "kv_tokens": 100, **kw}
    with pytest.raises(InvalidConfig, match="block_size"):
        Scheduler(**args)


def test_per_step_budget_never_below_block():
    """With B=4 a per-step budget of 1 is raised to 4 so a chunk can still progress."""
    s = make_scheduler(token_budget=8, block_size=4)
    s.add(Request(1, 10, 2))
    plan = s.schedule(token_budget=1)
    assert plan.token_budget == 4 and plan.prefills[0].num_tokens == 4


# ---------------------------------------------------------------- priorities with aging


def _b23_admit_steps(aging_interval):
    case = CASES["B23"]
    s = Scheduler(**case["config"], policy="priority", aging_interval=aging_interval)
    chk = InvariantChecker(s)
    by_step = {}
    for r in case["requests"]:
        by_step.setdefault(r["arrival_step"] - 1, []).append(
            Request(r["rid"], r["prompt_len"], r["max_new"], r["priority"])
        )
    admit = {}
    while s.has_unfinished() or s.step <= max(by_step):
        for req in by_step.get(s.step, []):
            chk.add(req)
        plan = chk.schedule()
        for rid in plan.admitted:
            admit[rid] = plan.step + 1
        chk.complete(plan)
    chk.check_final()
    return admit


def test_b23_aging_admits_low_priority_request():
    """Scenario B23, aging every step: rid k at step 2k-1 (k<=10), rid 0 at 21 (tie broken by arrival), rid 11 at 23."""
    admit = _b23_admit_steps(1)
    assert {str(k): admit[k] for k in (0, 1, 2, 10, 11)} == CASES["B23"]["expected"]["admit_step"]
    assert all(admit[k] == 2 * k - 1 for k in range(1, 11))


def test_b23_without_aging_starves_until_the_stream_ends():
    """Without aging, rid 0 (priority 10) is admitted only after all 40 urgent requests, at step 81."""
    assert _b23_admit_steps(None)[0] == 81


@pytest.mark.parametrize(("low", "interval"), [(10, 1), (5, 3), (2, 10)], ids=["p10-i1", "p5-i3", "p2-i10"])
def test_priority_starvation_bound(low, interval):
    """Under an endless stream of urgent requests (priority 0, one per step, 2 steps each, 1 slot), a request of
    priority p waits at most (p * I + 1) urgent services: only arrivals within p*I steps of it can go first."""
    s = Scheduler(token_budget=8, max_seqs=1, kv_tokens=100, policy="priority", aging_interval=interval)
    s.add(Request("low", 4, 2, priority=low))
    admitted_at = None
    for step in range(1000):
        s.add(Request(step, 4, 2, priority=0))
        plan = s.schedule()
        if "low" in plan.admitted:
            admitted_at = plan.step
            break
        s.complete(plan)
    bound = 2 * (low * interval + 1)
    assert admitted_at is not None and admitted_at <= bound


def test_priority_aging_in_seconds_with_a_clock():
    """With clock=, waited is clock() - arrival in seconds: after 2 s with interval 1 s, priority 3 ranks as 1."""
    now = [0.0]
    s = Scheduler(
        token_budget=4, max_seqs=1, kv_tokens=100, policy="priority", aging_interval=1.0, clock=lambda: now[0]
    )
    s.add(Request("busy", 2, 3))
    s.complete(s.schedule())
    s.add(Request("old", 2, 2, priority=3, arrival=0.0))
    now[0] = 2.0
    s.add(Request("new", 2, 2, priority=2, arrival=2.0))
    s.complete(s.schedule())
    s.complete(s.schedule())  # "busy" finishes
    assert s.schedule().admitted == ("old",)


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "lifo"},
        {"aging_interval": 0},
        {"aging_interval": -1.0},
        {"decode_overflow": "newest"},
        {"num_spec_tokens": -1},
        {"policy": "priority", "decode_overflow": "rotate"},
        {"clock": 3},
    ],
    ids=["policy", "aging-0", "aging-neg", "overflow", "spec-neg", "priority-rotate", "clock"],
)
def test_option_errors_name_the_field(kw):
    """An unknown or out-of-range option raises InvalidConfig naming it."""
    with pytest.raises(InvalidConfig, match=next(iter(kw))):
        Scheduler(token_budget=8, max_seqs=2, kv_tokens=100, **kw)


# ---------------------------------------------------------------- every combination, randomized

COMBOS = [
    dict(block_size=b, num_spec_tokens=k, **extra)
    for b, k, extra in itertools.product(
        [None, 4],
        [0, 2],
        [{}, {"decode_overflow": "rotate"}, {"policy": "priority"}, {"policy": "priority", "aging_interval": 3}],
    )
]


_COMBO_IDS = [",".join(f"{k}={v}" for k, v in o.items() if v) or "default" for o in COMBOS]


@pytest.mark.slow
@pytest.mark.parametrize("options", COMBOS, ids=_COMBO_IDS)
def test_randomized_simulations_for_every_option_combination(options):
    """15 seeded simulations per combination, with random per-step budgets, keep every invariant and option rule
    (the paged runs of tests/core/test_kv_policies.py cover the same combinations again)."""
    for seed in range(15):
        RandomWorkload(seed, options=options, vary_budget=True).run()


@pytest.mark.parametrize("options", COMBOS, ids=_COMBO_IDS)
def test_randomized_simulations_for_every_option_combination_quick(options):
    """One seeded simulation of 15 requests per combination keeps every invariant and option rule."""
    RandomWorkload(0, num_requests=15, options=options, vary_budget=True).run()


# ---------------------------------------------------------------- priority ties


def test_priority_ties_by_arrival_order_equal_priorities_by_arrival_time():
    """priority_ties="arrival": four requests of priority 1 added with arrivals 4, 1, 3, 2 s are admitted by
    arrival (rids 1, 3, 2, 0); a more urgent one (priority 0) still goes first; by add order they run 0..3."""
    def admitted(ties):
        chk = InvariantChecker(make_scheduler(token_budget=4, max_seqs=8, policy="priority", priority_ties=ties))
        for rid, t in enumerate([4.0, 1.0, 3.0, 2.0]):
            chk.add(Request(rid, 1, 1, priority=1, arrival=t))
        chk.add(Request(9, 1, 1, priority=0, arrival=9.0))
        plan = chk.schedule()
        chk.complete(plan)
        return plan.admitted
    assert admitted("arrival") == (9, 1, 3, 2)
    assert admitted("add") == (9, 0, 1, 2)


def test_priority_ties_bad_value_is_refused():
    with pytest.raises(InvalidConfig, match="priority_ties must be 'add' or 'arrival', got 'time'"):
        make_scheduler(policy="priority", priority_ties="time")


@pytest.mark.parametrize("seed", range(3))
def test_priority_ties_by_arrival_keep_every_invariant(seed):
    """Seeded random arrivals out of add order, paged KV with preemptions, aging on and off: the checker works
    out each plan (its queue ordered by (effective priority, arrival, add order))."""
    rng = random.Random(seed)
    aging = rng.choice([None, 3])
    s = Scheduler(token_budget=rng.choice([8, 32]), max_seqs=4, kv_tokens=160, kv_policy="paged", block_size=8,
                  policy="priority", priority_ties="arrival", aging_interval=aging)
    chk = InvariantChecker(s)
    reqs = [Request(i, rng.randint(1, 60), rng.randint(1, 20), priority=rng.randint(0, 2),
                    arrival=float(rng.randint(0, 5))) for i in range(30)]
    arrive = sorted(rng.randint(0, 40) for _ in reqs)
    i = 0
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrive[i] <= s.step:
            chk.add(reqs[i])
            i += 1
        chk.complete(chk.schedule())
    chk.check_final()
