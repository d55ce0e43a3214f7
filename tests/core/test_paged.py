"""The paged scheduler: blocks as tokens arrive, watermark admission, preemption by recompute, and the
failure scenarios B21 and B30 (paged half), checked by hand-worked traces and randomized simulations."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from factories import drive_randomly, run_to_end
from stallfree import (
    FinishReason,
    InvalidConfig,
    PagedScheduler,
    Request,
    RequestRejected,
    RequestStatus,
    Scheduler,
    SchedulerStateError,
)
from stallfree.core.invariants import PagedInvariantChecker, PagedInvariantViolation

CASES = {c["id"]: c for c in json.loads(
    (Path(__file__).parents[1] / "data" / "public_bug_scenarios.json").read_text())["cases"]}
NUM_SIMULATIONS = 250


def make_paged(token_budget=8, max_seqs=4, num_blocks=64, block_size=4, watermark=0.0):
    """A PagedScheduler with small defaults (budget 8, 4 slots, 64 blocks of 4 tokens, no watermark)."""
    return PagedScheduler(token_budget, max_seqs, num_blocks, block_size, watermark)


def snapshot(s: PagedScheduler):
    """Everything observable about a paged scheduler, for 'nothing changed' checks."""
    live = {}
    for rid in list(s._live):
        st = s.request_state(rid)
        live[rid] = (st.status, st.num_prefilled, st.num_generated, st.num_preemptions, s.block_table(rid))
    return (s.stats().num_free_blocks, s.kv_free, s.num_waiting, s.num_running, s.step, s.stats().num_preemptions, live)


def trace(chk, arrivals, last_step=None):
    """Run a checked scheduler with scenario numbering (steps from 1, arrivals added before their step).

    Returns per step: the plan as [(rid, tokens)], admitted, preempted, emitted and finished rids.
    """
    out = {}
    step = 1
    while chk.scheduler.has_unfinished() or step <= max(arrivals, default=0):
        for req in arrivals.get(step, []):
            chk.add(req)
        plan = chk.schedule()
        emitted = chk.complete(plan)
        out[step] = {
            "plan": [(c.rid, c.num_tokens) for c in plan], "admitted": plan.admitted,
            "preempted": plan.preempted, "emitted": emitted, "finished": dict(chk.scheduler.last_finished),
            "used": chk.scheduler.stats().num_used_blocks,
        }
        step += 1
        assert last_step is None or step <= last_step + 1, "did not finish in time"
    chk.check_final()
    return out


def steps_where(out, key):
    """{rid: step} of the last step at which each rid appears in out[step][key]."""
    return {rid: step for step, row in out.items() for rid in row[key]}


# ---------------------------------------------------------------- construction and add()


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_blocks", 0), ("num_blocks", -4), ("block_size", 0), ("block_size", 2.0), ("num_blocks", True),
     ("num_blocks", "64"), ("watermark", -0.1), ("watermark", 1.0), ("watermark", 1), ("watermark", "0.1"),
     ("watermark", True), ("watermark", math.nan), ("token_budget", 0), ("max_seqs", None)],
    ids=["blocks-0", "blocks-neg", "size-0", "size-float", "blocks-bool", "blocks-str", "wm-neg", "wm-1.0",
         "wm-int-1", "wm-str", "wm-bool", "wm-nan", "budget-0", "seqs-none"],
)
def test_bad_config_names_field_and_value(field, value):
    """A constructor argument out of range raises InvalidConfig naming it and its value."""
    kw = {"token_budget": 8, "max_seqs": 4, "num_blocks": 64, "block_size": 4, "watermark": 0.01, field: value}
    with pytest.raises(InvalidConfig, match=field) as exc:
        PagedScheduler(**kw)
    assert repr(value) in str(exc.value)


def test_capacity_reported_in_tokens_and_watermark_in_blocks():
    """kv_total and kv_free are blocks x block_size; watermark_blocks is floor(watermark x num_blocks)."""
    s = PagedScheduler(8, 4, num_blocks=99, block_size=16, watermark=0.01)
    assert (s.stats().kv_total, s.kv_free, s.stats().num_free_blocks, s.stats().watermark_blocks) == (1584, 1584, 99, 0)
    assert PagedScheduler(8, 4, num_blocks=100, block_size=16, watermark=0.01).stats().watermark_blocks == 1
    assert PagedScheduler(8, 4, num_blocks=10, block_size=1, watermark=0.25).stats().watermark_blocks == 2


def test_never_fits_rejected_by_blocks_of_prompt_plus_max_new_minus_one():
    """ceil((prompt_len + max_new - 1) / block_size) > num_blocks is rejected with the numbers; exactly
    num_blocks fits (the last token's KV is never computed) and runs to the end using every block."""
    s = make_paged(token_budget=64, num_blocks=8, block_size=4)
    with pytest.raises(RequestRejected, match=r"ceil\(\(30 \+ 4 - 1\) / 4\) = 9 blocks > num_blocks = 8"):
        s.add(Request(1, 30, 4))
    assert snapshot(s) == (8, 32, 0, 0, 0, 0, {})
    chk = PagedInvariantChecker(s)
    chk.add(Request(2, 30, 3))  # 32 computed tokens at most: 8 blocks although prompt + max_new = 33
    out = trace(chk, {})
    assert max(row["used"] for row in out.values()) == 8
    assert steps_where(out, "finished") == {2: 3}


def test_duplicate_rid_and_non_request_rejected_and_state_unchanged():
    """A live rid added again, or something that is not a Request, raises and changes nothing."""
    s = make_paged()
    s.add(Request(1, 4, 3))
    s.complete(s.schedule())
    before = snapshot(s)
    with pytest.raises(RequestRejected, match="already live"):
        s.add(Request(1, 5, 5))
    with pytest.raises(RequestRejected, match="Request"):
        s.add((2, 4, 3))
    assert snapshot(s) == before


def test_unknown_rid_queries_raise_key_error():
    """request_state, block_table and abort of a rid never added raise KeyError naming it."""
    s = make_paged()
    for call in (s.request_state, s.block_table, s.abort):
        with pytest.raises(KeyError, match="nope"):
            call("nope")


# ---------------------------------------------------------------- blocks follow the tokens


def test_blocks_taken_as_tokens_are_scheduled_and_freed_at_finish():
    """Budget 8, blocks of 4, prompt 10, max_new 6: chunks 8 + 2 take 2 then 3 blocks; decodes at
    positions 10, 11 need none, the one at 12 takes the 4th; all 4 return when the 6th token comes."""
    s = make_paged(token_budget=8, num_blocks=10, block_size=4)
    s.add(Request("r", 10, 6))
    tables, chunks = [], []
    while s.has_unfinished():
        plan = s.schedule()
        chunks.append([(c.num_tokens, c.start, c.is_prefill) for c in plan])
        s.complete(plan)
        tables.append(s.block_table("r") if s.has_unfinished() else None)
    assert chunks == [[(8, 0, True)], [(2, 8, True)], [(1, 10, False)], [(1, 11, False)], [(1, 12, False)],
                      [(1, 13, False)], [(1, 14, False)]]
    assert tables == [(0, 1), (0, 1, 2), (0, 1, 2), (0, 1, 2), (0, 1, 2, 3), (0, 1, 2, 3), None]
    assert s.stats().num_free_blocks == 10 and s.last_finished == {"r": FinishReason.LENGTH}


def test_hand_trace_and_empty_plan_as_in_the_core():
    """With blocks to spare the step order is the contract's: chunks 7, 7, 6 beside one decode; an empty
    scheduler plans an empty step."""
    s = make_paged(token_budget=8, num_blocks=100)
    plan = s.schedule()
    assert len(plan) == 0 and plan.num_tokens == 0 and s.complete(plan) == ()
    s.add(Request("d", 2, 10))
    s.complete(s.schedule())
    s.add(Request("p", 20, 2))
    got = []
    for _ in range(3):
        plan = s.schedule()
        got.append((plan.decode_rids, [c.num_tokens for c in plan.prefills], "p" in s.complete(plan)))
    assert got == [(("d",), [7], False), (("d",), [7], False), (("d",), [6], True)]


def test_ample_blocks_plan_exactly_like_the_reservation_scheduler():
    """With memory to spare and no watermark, the paged scheduler's plans equal the reservation
    scheduler's on 30 seeded random workloads (same decodes, chunks and admissions every step)."""
    for seed in range(30):
        rng = random.Random(seed)
        budget, seqs = rng.randint(1, 64), rng.randint(1, 8)
        reqs: dict[int, list[Request]] = {}
        for i in range(25):
            reqs.setdefault(rng.randint(0, 60), []).append(Request(i, rng.randint(1, 90), rng.randint(1, 30)))
        plans = []
        for s in (Scheduler(budget, seqs, kv_tokens=10**6), PagedScheduler(budget, seqs, 10**4, 16, 0.0)):
            plans.append(run_to_end(s, reqs))
        assert plans[0] == plans[1], seed


# ---------------------------------------------------------------- watermark admission


def test_watermark_keeps_blocks_free_at_admission_in_fcfs_order():
    """10 blocks, watermark 0.2 (2 blocks): two 4-block prompts are admitted, then a 1-block prompt that
    would leave 1 < 2 free waits, and the request behind it does not skip ahead."""
    s = make_paged(token_budget=64, num_blocks=10, block_size=4, watermark=0.2)
    for rid, prompt in (("a", 16), ("b", 16), ("c", 4), ("d", 1)):
        s.add(Request(rid, prompt, 2))
    plan = s.schedule()
    assert plan.admitted == ("a", "b") and s.stats().num_free_blocks == 2 and s.num_waiting == 2


def test_watermark_waived_when_nothing_runs():
    """A request whose first chunk needs more than num_blocks - watermark blocks still runs when the
    cache is empty (no one to push into preemption) instead of waiting forever."""
    chk = PagedInvariantChecker(make_paged(token_budget=64, num_blocks=10, block_size=4, watermark=0.5))
    out = trace(chk, {1: [Request("big", 39, 2), Request("next", 4, 1)]})
    assert out[1]["plan"] == [("big", 39)] and out[1]["used"] == 10
    assert steps_where(out, "admitted") == {"big": 1, "next": 3}


# ---------------------------------------------------------------- preemption by recompute


def test_victims_are_the_newest_and_requeue_in_arrival_order():
    """Four 2-token prompts fill 4 blocks of 2; at step 2 a and b each need a block: a preempts d, b
    preempts c; c and d go back in front of e in arrival order, recompute prompt + their 1 token, and
    their recompute chunk samples their 2nd token (emitted once)."""
    chk = PagedInvariantChecker(make_paged(token_budget=8, max_seqs=4, num_blocks=4, block_size=2))
    reqs = [Request(rid, 2, 3) for rid in "abcd"]
    out = trace(chk, {1: reqs, 2: [Request("e", 2, 1)]})
    assert out[2]["plan"] == [("a", 1), ("b", 1)] and out[2]["preempted"] == ("c", "d")
    assert out[2]["admitted"] == ()
    assert out[4]["plan"] == [("c", 3), ("d", 3)] and out[4]["emitted"] == ("c", "d")
    assert steps_where(out, "admitted") == {"a": 1, "b": 1, "c": 4, "d": 4, "e": 6}
    assert steps_where(out, "finished") == {"a": 3, "b": 3, "c": 5, "d": 5, "e": 6}
    assert chk.scheduler.stats().num_preemptions == 2 and chk.scheduler.stats().num_recomputed_tokens == 6
    emitted = [rid for row in out.values() for rid in row["emitted"]]
    assert {rid: emitted.count(rid) for rid in "abcde"} == {"a": 3, "b": 3, "c": 3, "d": 3, "e": 1}


def test_decode_that_is_the_newest_preempts_itself_and_returns_when_its_whole_recompute_fits():
    """Budget 4, 6 blocks of 2: at step 3 a (older) takes the last block and c, whose decode at position 6
    needs one, is the newest, so it preempts itself (1 token generated, no blocks left). Its first
    recompute chunk (3 tokens, 2 blocks) would fit the 3 free blocks, but its whole recompute (prompt 6
    + 1 = 7 tokens, 4 blocks) does not, so it waits until a finishes (step 10); then chunks 4 + 3, and the
    last samples its 2nd token."""
    s = make_paged(token_budget=4, max_seqs=4, num_blocks=6, block_size=2)
    chk = PagedInvariantChecker(s)
    chk.add(Request("a", 2, 11))
    chk.add(Request("c", 6, 7))
    prefills = []
    for _ in range(3):  # c's prompt in chunks 2, 3, 1 beside a; c's first token at step 2
        plan = chk.schedule()
        prefills.append([(c.rid, c.num_tokens) for c in plan.prefills])
        chk.complete(plan)
    assert prefills == [[("a", 2), ("c", 2)], [("c", 3)], [("c", 1)]] and s.stats().num_free_blocks == 1
    plan = chk.schedule()
    assert plan.decode_rids == ("a",) and plan.preempted == ("c",) and plan.admitted == ()
    st = s.request_state("c")
    assert (st.status, st.num_generated, st.num_prefilled, st.num_preemptions) == (
        RequestStatus.PREEMPTED, 1, 0, 1)
    assert s.block_table("c") == () and s.stats().num_free_blocks == 3
    chk.complete(plan)
    rows = {}
    while s.has_unfinished():
        plan = chk.schedule()
        rows[plan.step] = ([(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills], plan.admitted,
                           chk.complete(plan), dict(s.last_finished))
    assert all(row[1] == () for step, row in rows.items() if step < 11)
    assert rows[10][3] == {"a": FinishReason.LENGTH}
    assert rows[11] == ([("c", 4, 0, False)], ("c",), (), {})
    assert rows[12] == ([("c", 3, 4, True)], (), ("c",), {})
    assert rows[17][3] == {"c": FinishReason.LENGTH}
    assert s.stats().num_recomputed_tokens == 7
    chk.check_final()


def test_partial_prefill_that_cannot_get_its_blocks_preempts_itself():
    """A partly prefilled prompt is the newest running request, so when its next chunk's block is not
    free it is its own victim and the older decode goes on."""
    chk = PagedInvariantChecker(make_paged(token_budget=4, max_seqs=4, num_blocks=3, block_size=4))
    chk.add(Request("a", 1, 5))
    chk.add(Request("b", 12, 1))
    plans = []
    for _ in range(3):
        plan = chk.schedule()
        plans.append(([(c.rid, c.num_tokens) for c in plan], plan.preempted))
        chk.complete(plan)
    assert plans == [([("a", 1), ("b", 3)], ()), ([("a", 1), ("b", 3)], ()), ([("a", 1)], ("b",))]
    st = chk.scheduler.request_state("b")
    assert (st.status, st.num_prefilled, st.num_generated) == (RequestStatus.PREEMPTED, 0, 0)
    while chk.scheduler.has_unfinished():
        chk.complete(chk.schedule())
    chk.check_final()


# ---------------------------------------------------------------- early stop and abort


def test_stop_frees_blocks_and_bad_stopped_changes_nothing():
    """A stopped request frees its blocks that step; naming a request that did not sample raises and
    changes nothing."""
    s = make_paged(token_budget=8, num_blocks=10, block_size=4)
    s.add(Request("a", 5, 10))
    s.add(Request("b", 9, 10))
    plan = s.schedule()  # a: 5 tokens (last), b: 3 of 9
    before = snapshot(s)
    with pytest.raises(SchedulerStateError, match="did not sample"):
        s.complete(plan, stopped=["a", "b"])
    assert snapshot(s) == before
    assert s.complete(plan, stopped=["a"]) == ("a",)
    assert s.last_finished == {"a": FinishReason.STOP} and s.stats().num_free_blocks == 9


def test_abort_running_waiting_and_in_flight():
    """abort() frees a decode's blocks at once, removes a waiting request, and defers an in-flight one to
    complete(), which keeps its blocks until then and emits nothing for it; a finished rid is a no-op."""
    s = make_paged(token_budget=8, max_seqs=2, num_blocks=10, block_size=4)
    for rid in ("a", "b", "w"):
        s.add(Request(rid, 4, 10))
    s.complete(s.schedule())
    assert s.stats().num_free_blocks == 8
    s.abort("a")
    s.abort("w")
    assert s.stats().num_free_blocks == 9 and s.num_waiting == 0 and s.last_finished == {}
    plan = s.schedule()
    s.abort("b")
    assert s.stats().num_free_blocks == 8 and s.block_table("b") == (1, 0)  # the engine may be writing its KV
    assert s.complete(plan) == ()
    assert s.last_finished == {"b": FinishReason.ABORT} and s.stats().num_free_blocks == 10
    s.abort("b")
    assert not s.has_unfinished()


def test_abort_of_a_preempted_request_removes_it_from_the_queue():
    """A preempted request waiting for readmission can be aborted; it holds no blocks."""
    chk = PagedInvariantChecker(make_paged(token_budget=8, max_seqs=4, num_blocks=4, block_size=2))
    for rid in "abcd":
        chk.add(Request(rid, 2, 3))
    chk.complete(chk.schedule())
    plan = chk.schedule()
    assert plan.preempted == ("c", "d")
    chk.abort("c")  # not in the plan in flight: removed at once
    chk.complete(plan)
    assert chk.scheduler.num_waiting == 1
    while chk.scheduler.has_unfinished():
        chk.complete(chk.schedule())
    chk.check_final()


# ---------------------------------------------------------------- failure scenarios


def scenario_arrivals(case):
    """{arrival_step: [Request]} of a scenario."""
    arrivals: dict[int, list[Request]] = {}
    for r in case["requests"]:
        arrivals.setdefault(r["arrival_step"], []).append(Request(r["rid"], r["prompt_len"], r["max_new"]))
    return arrivals


def test_b21_preemption_thrashing_facts():
    """B21: exact tokens across preemption, preempted readmitted before never-started, no victim in the
    step it was readmitted, at most 2 preemptions each, at most 8 blocks used and all free at the end."""
    case = CASES["B21"]
    cfg = case["config"]
    s = PagedScheduler(cfg["token_budget"], cfg["max_seqs"], cfg["kv_tokens"] // cfg["block_size"],
                       cfg["block_size"])
    chk = PagedInvariantChecker(s)
    out = trace(chk, scenario_arrivals(case))
    emitted = [rid for row in out.values() for rid in row["emitted"]]
    assert {rid: emitted.count(rid) for rid in (1, 2, 3)} == {1: 16, 2: 16, 3: 4}
    assert all(row["used"] <= 8 for row in out.values()) and s.stats().num_free_blocks == 8
    assert chk.num_preemptions >= 1 and chk.max_preemptions_of_one <= 2
    assert not any(set(row["admitted"]) & set(row["preempted"]) for row in out.values())
    # Hand-worked: rid 3 takes the last 2 blocks at step 3 and is its own victim at step 4 (its decode at
    # position 8 needs a block); at step 10 rid 1's decode at 16 needs one and rid 2 (newer) is preempted
    # after 9 tokens; rid 2 (preempted later but older) is readmitted before rid 3 once rid 1 finishes.
    assert {step: row["preempted"] for step, row in out.items() if row["preempted"]} == {4: (3,), 10: (2,)}
    assert out[17]["plan"] == [(2, 16)] and out[18]["plan"] == [(2, 1), (3, 9)]
    assert steps_where(out, "admitted") == {1: 1, 2: 17, 3: 18}
    assert steps_where(out, "finished") == {1: 16, 3: 20, 2: 24}
    assert s.stats().num_recomputed_tokens == (8 + 9) + (8 + 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_b30_paged_admits_behind_a_long_max_new(block_size):
    """B30, paged half: blocks follow the tokens, so rid 2 is admitted at step 1 and rid 3 at step 2
    (the reservation scheduler holds both until step 57); every request finishes as early as it can."""
    case = CASES["B30"]
    cfg = case["config"]
    chk = PagedInvariantChecker(PagedScheduler(cfg["token_budget"], cfg["max_seqs"],
                                               cfg["kv_tokens"] // block_size, block_size))
    out = trace(chk, scenario_arrivals(case))
    assert steps_where(out, "admitted") == {1: 1, 2: 1, 3: 2}
    assert out[1]["plan"] == [(1, 4), (2, 4)] and out[2]["plan"] == [(1, 1), (2, 1), (3, 2)]
    assert steps_where(out, "finished") == {1: 56, 2: 4, 3: 2}
    assert chk.num_preemptions == 0


def test_reservation_vs_paged_on_b30():
    """The contrast on B30's requests with the same 64 tokens of KV: TTFT of rids 2 and 3 is step 57
    under reservation and steps 1 and 2 paged; both end at step 56 (rid 1 bounds the run)."""
    case = CASES["B30"]
    cfg = case["config"]
    runs = {}
    for name, s in (("reserve", Scheduler(**cfg)), ("paged", PagedScheduler(16, 4, 16, 4))):
        arrivals = {step - 1: reqs for step, reqs in scenario_arrivals(case).items()}
        _, first, finish = run_to_end(s, arrivals)
        runs[name] = ({rid: st + 1 for rid, st in first.items()}, max(finish.values()) + 1)
    assert runs["reserve"] == ({1: 1, 2: 57, 3: 57}, 60)
    assert runs["paged"] == ({1: 1, 2: 1, 3: 2}, 56)


def test_reservation_vs_paged_when_requests_stop_early():
    """Four requests (prompt 4, max_new 28) that all stop at their 3rd token in 64 tokens of KV: reservation
    runs two at a time (32 tokens each) and needs 6 steps; paged runs all four and needs 3."""
    steps = {}
    for name, s in (("reserve", Scheduler(64, 4, kv_tokens=64)), ("paged", PagedScheduler(64, 4, 16, 4, 0.0))):
        for rid in range(4):
            s.add(Request(rid, 4, 28))
        generated = dict.fromkeys(range(4), 0)
        while s.has_unfinished():
            plan = s.schedule()
            for rid in plan.sampled_rids:
                generated[rid] += 1
            s.complete(plan, stopped=[r for r in plan.sampled_rids if generated[r] == 3])
        steps[name] = s.step
    assert steps == {"reserve": 6, "paged": 3}


# ---------------------------------------------------------------- randomized simulations


def random_paged_run(seed: int, num_requests: int = 25) -> tuple[PagedInvariantChecker, int]:
    """One seeded simulation on a tight cache with aborts and early stops; returns the checker and the
    step bound: last arrival + 1 + sum(prompt_len + max_new - 1) (the oldest running request progresses
    every step and is never preempted, so each step is charged to one request's final episode)."""
    rng = random.Random(seed)
    budget = rng.choice([1, 2, 3, rng.randint(1, 16), rng.randint(1, 256)])
    bs = rng.choice([1, 2, 3, 4, 16])
    reqs = [Request(i, rng.randint(1, 120), rng.randint(1, 48)) for i in range(num_requests)]
    largest = max(-(-(r.prompt_len + r.max_new - 1) // bs) for r in reqs)
    num_blocks = rng.choice([largest, largest, largest + rng.randint(0, largest // 4 + 1), largest * 3])
    s = PagedScheduler(budget, rng.randint(1, 11), num_blocks, bs, rng.choice([0.0, 0.01, 0.1, 0.3]))
    chk = PagedInvariantChecker(s, table_every=rng.choice([1, 2, 5, 50]))
    arrive = sorted(rng.randint(0, 100) for _ in reqs)
    p_abort, p_stop = rng.choice([0.0, 0.1]), rng.choice([0.0, 0.05])
    drive_randomly(chk, s, reqs, arrive, rng, p_abort, p_stop, abort_in_flight=True)
    return chk, arrive[-1] + 1 + sum(r.prompt_len + r.max_new - 1 for r in reqs)


@pytest.mark.slow
def test_randomized_paged_simulations_hold_every_invariant(capsys):
    """250 seeded simulations (budgets 1-256, blocks of 1-16 tokens, caches from exactly the largest request
    to 3x, watermarks 0-0.3, aborts, early stops) keep every paged invariant after every call, preempt
    often, and end within the step bound."""
    _randomized_paged(NUM_SIMULATIONS, capsys)


def test_randomized_paged_simulations_hold_every_invariant_quick(capsys):
    """The first 16 of those seeded simulations keep every paged invariant and preempt in some of them."""
    _randomized_paged(16, capsys)


def _randomized_paged(num: int, capsys) -> None:
    steps = preemptions = with_preemption = recomputed = 0
    for seed in range(num):
        chk, bound = random_paged_run(seed)
        assert chk.num_steps <= bound, seed
        steps += chk.num_steps
        preemptions += chk.num_preemptions
        recomputed += chk.num_recomputed_tokens
        with_preemption += chk.num_preemptions > 0
    with capsys.disabled():
        print(f"\n[paged invariants] {num} simulations, {steps} steps, {preemptions} preemptions "
              f"in {with_preemption} of them, {recomputed} tokens recomputed")
    assert with_preemption >= num // 4


# ---------------------------------------------------------------- the checker can fail


class _PreemptsOldest(PagedScheduler):
    """Broken: it takes blocks from the oldest decode instead of the newest running request."""

    def _victim_for(self, obj):
        recs = self._decodes.recs
        return recs[0] if recs else super()._victim_for(obj)


class _ForgetsGenerated(PagedScheduler):
    """Broken: a preempted request recomputes only its prompt, so it would emit its tokens again."""

    def _preempt(self, obj, step, victims):
        super()._preempt(obj, step, victims)
        obj.gen0, obj.target = 0, obj.num_prompt_tokens


class _ReleasesAtPromptEnd(PagedScheduler):
    """Broken: it hands a request's blocks back when its prompt is done."""

    def _first_token(self, obj, step):
        super()._first_token(obj, step)
        if obj.status is RequestStatus.DECODING:
            self._kv.pool.release(obj.block_table)


@pytest.mark.parametrize("broken", [_PreemptsOldest, _ForgetsGenerated, _ReleasesAtPromptEnd],
                         ids=["oldest-victim", "forgets-generated", "early-release"])
def test_checker_catches_broken_paged_schedulers(broken):
    """The paged checker raises on a wrong victim, a recompute that forgets generated tokens, and
    blocks released at the end of the prompt."""
    chk = PagedInvariantChecker(broken(8, 4, 4, 2, 0.0))
    with pytest.raises(PagedInvariantViolation):
        trace(chk, {1: [Request(rid, 2, 3) for rid in "abcd"]})
