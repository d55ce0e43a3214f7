"""The decode phase as a strategy (core/decode.py): which one a scheduler uses, what the plain one does with
more decodes than budget, and the prefill view that is made once and never rewritten by a step."""

from __future__ import annotations

from stallfree import Request, Scheduler
from stallfree.core.decode import PlainDecodes, SpeculativeDecodes
from stallfree.core.invariants import InvariantChecker


def _decoding(n: int, budget: int, **kw: object) -> InvariantChecker:
    """`n` requests of a 1-token prompt and max_new 10, admitted and prefilled in step 0 (budget >= n), so
    that from step 1 on they are `n` ready decodes; then the budget is `budget` for each later step."""
    chk = InvariantChecker(Scheduler(max(n, budget), n, 1000, **kw))  # type: ignore[arg-type]
    for i in range(n):
        chk.add(Request(i, 1, 10))
    chk.complete(chk.schedule())
    return chk


def test_the_strategy_follows_the_options():
    """Plain by default; speculative with num_spec_tokens; a plain one becomes speculative the first time a
    decode is given draft tokens (and never before)."""
    assert type(Scheduler(8, 2, 100)._decode) is PlainDecodes
    spec = Scheduler(8, 2, 100, num_spec_tokens=2)._decode
    assert isinstance(spec, SpeculativeDecodes) and spec.num_spec_tokens == 2
    chk = _decoding(2, 8)
    s = chk.scheduler
    chk.complete(chk.schedule())
    assert type(s._decode) is PlainDecodes
    chk.set_draft_tokens(0, 3)
    assert isinstance(s._decode, SpeculativeDecodes) and s._decode.num_spec_tokens == 0
    # One token each (2), then 0's 3 drafts: 5 tokens; the drafts are for that one step.
    plan = chk.schedule()
    assert plan.decode_rids == (0, 1) and plan.decode_tokens == (4, 1) and plan.num_tokens == 5
    assert s._decode.drafted == {}


def test_plain_overflow_skips_the_newest_and_they_catch_up():
    """6 decodes, budget 4 (decode_overflow "oldest"): step 2 runs 0-3 and skips 4 and 5, whose progress then
    lags one step; the skipped list is what the plan left out and is empty once the step completes."""
    chk = _decoding(6, 6)
    s = chk.scheduler
    chk.complete(chk.schedule())  # step 1: all 6 decode (budget 6)
    plan = chk.schedule(token_budget=4)
    assert plan.decode_rids == (0, 1, 2, 3) and plan.num_tokens == 4
    assert [o.rid for o in s._decode.skipped] == [4, 5]
    chk.complete(plan)
    assert s._decode.skipped == []
    gen = {rid: s.request_state(rid).num_generated for rid in range(6)}
    # 1 token from the prefill, one per decode step: 3 for 0-3, 2 for the skipped 4 and 5.
    assert gen == {0: 3, 1: 3, 2: 3, 3: 3, 4: 2, 5: 2}


def test_the_prefill_view_is_not_rewritten_by_a_step():
    """schedule(admit=False) and schedule(chunk_cap=...) reach the prefill phase through one StepLimits value;
    the view holds no per-step field, and the next plain schedule() admits as usual."""
    s = Scheduler(8, 4, 1000)
    host = s._host
    # Its fields: __slots__, or in the compiled build (setup.py) mypyc's list of the class's attributes.
    fields = getattr(type(host), "__slots__", None) or type(host).__mypyc_attrs__
    assert not hasattr(host, "__dict__") and not {"admitting", "chunk_cap", "refused"} & set(fields)
    slots = {n: getattr(host, n) for n in fields}
    s.add(Request("a", 20, 2))
    plan = s.schedule(admit=False)
    assert plan.admitted == () and plan.num_tokens == 0
    s.complete(plan)
    assert {n: getattr(host, n) for n in fields} == slots
    plan = s.schedule(chunk_cap=lambda rid, start, n: 5)
    assert plan.admitted == ("a",) and [(c.rid, c.num_tokens) for c in plan] == [("a", 5)]
    s.complete(plan)
    plan = s.schedule()
    assert [(c.rid, c.start, c.num_tokens) for c in plan] == [("a", 5, 8)]
    assert host.admitting and host.chunk_cap is None and host.refused is None
