"""The design's hand trace and the failure scenarios from other engines' bug reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factories import make_scheduler, run_to_end
from stallfree import Request, Scheduler
from stallfree.core.invariants import InvariantChecker

ALL_CASES = json.loads((Path(__file__).parents[1] / "data" / "public_bug_scenarios.json").read_text())["cases"]
# Scenarios with exact plans for the base contract; variants, metrics and HTTP have tests of their own.
CASES = [c for c in ALL_CASES if c["layer"] == "scheduler" and "plans" in c["expected"]]


def test_hand_trace_chunks_7_7_6():
    """Budget 8, one decode running, a 20-token prompt: chunks 7, 7, 6; first token on the third step."""
    s = make_scheduler(token_budget=8, kv_tokens=100)
    s.add(Request("d", prompt_len=2, max_new=10))
    s.complete(s.schedule())  # step 0: d's prompt, d now decodes
    s.add(Request("p", prompt_len=20, max_new=2))
    chunks, emitted_p = [], []
    for _ in range(3):
        plan = s.schedule()
        assert plan.decode_rids == ("d",)
        chunks.append([c.num_tokens for c in plan.prefills])
        emitted_p.append("p" in s.complete(plan))
    assert chunks == [[7], [7], [6]]
    assert emitted_p == [False, False, True]
    assert s.request_state("p").first_token_step == 3


def test_empty_scheduler_returns_empty_plan():
    """An empty scheduler plans an empty step, which completes with nothing emitted."""
    s = make_scheduler()
    plan = s.schedule()
    assert len(plan) == 0 and plan.num_tokens == 0 and not plan
    assert s.complete(plan) == ()
    assert s.step == 1


def _case_id(case):
    return f"{case['id']}-{case['kind']}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_public_bug_scenario(case):
    """Each scenario's plans, KV, first-token, admission and finish steps match the hand-worked values."""
    cfg, exp = case["config"], case["expected"]
    chk = InvariantChecker(Scheduler(**cfg))
    arrivals: dict[int, list[Request]] = {}
    for r in case["requests"]:
        arrivals.setdefault(r["arrival_step"], []).append(
            Request(r["rid"], prompt_len=r["prompt_len"], max_new=r["max_new"])
        )
    aborts = {r["abort_at_step"]: r["rid"] for r in case["requests"] if "abort_at_step" in r}
    plans, kv_after, first, finish, admit, rejected = {}, {}, {}, {}, {}, []
    step = 1
    while step <= exp["last_step"]:
        for req in arrivals.get(step, []):
            try:
                chk.add(req)
            except ValueError:
                rejected.append(req.rid)
        if step in aborts:
            chk.abort(aborts[step])
            chk.abort(aborts[step])  # a second abort of the same rid is a no-op
        plan = chk.schedule()
        plans[str(step)] = [[c.rid, c.num_tokens] for c in plan]
        for rid in plan.admitted:
            admit[str(rid)] = step
        for c in plan.prefills:
            if c.is_last:
                first[str(c.rid)] = step
        chk.complete(plan)
        for rid in chk.scheduler.last_finished:
            finish[str(rid)] = step
        kv_after[str(step)] = chk.scheduler.kv_free
        step += 1
    assert {k: v for k, v in plans.items() if k in exp["plans"]} == exp["plans"]
    assert {k: kv_after[k] for k in exp["kv_free_after_step"]} == exp["kv_free_after_step"]
    assert first == exp["first_token_step"]
    assert finish == exp["finish_step"]
    assert admit == exp["admit_step"]
    assert rejected == exp["rejected_at_add"]
    chk.check_final()


def test_b04_decode_entries_never_exceed_budget():
    """B04's burst: 8 one-token prompts at budget 4 leave rids 5..8 waiting although slots and KV are free."""
    s = make_scheduler(token_budget=4, max_seqs=8, kv_tokens=100)
    plans, first, finish = run_to_end(s, {0: [Request(i, 1, 3) for i in range(1, 9)]})
    assert plans[0] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert all(sum(n for _, n in p) <= 4 for p in plans.values())
    assert first == {1: 0, 2: 0, 3: 0, 4: 0, 5: 3, 6: 3, 7: 3, 8: 3}
