"""LoRA adapters in the core: at most max_loras adapters per step, bounded pass-over, and a checker that can fail."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_scheduler, random_lora_run
from stallfree import Request, Scheduler
from stallfree.core.config import SchedulerConfig
from stallfree.core.errors import InvalidConfig, RequestRejected
from stallfree.core.invariants import InvariantChecker, InvariantViolation
from stallfree.core.lora import LoraSlots


def _step(s, stopped=()):
    plan = s.schedule()
    s.complete(plan, stopped)
    return plan


def test_keyword_and_config_forms_build_the_same_limit():
    """Scheduler(..., max_loras=N) and Scheduler(SchedulerConfig(..., max_loras=N)) carry the same limit."""
    a = Scheduler(token_budget=64, max_seqs=8, kv_tokens=1000, max_loras=2)
    b = Scheduler(SchedulerConfig(64, 8, 1000, max_loras=2, max_lora_passes=5))
    assert a.config.max_loras == 2 and a.config.max_lora_passes == 256
    assert b.config.max_loras == 2 and b.config.max_lora_passes == 5


def test_passed_over_then_admitted_when_its_adapter_can_join():
    """max_loras=1: A runs, B cannot join and is passed by a later A and a base request; B runs after A ends.

    Worked out by hand: budget 64, prompts of 4 tokens; step 0 admits r0 (A), passes r1 (B), admits r2 (A)
    and r3 (base); r0 and r2 (max_new 2) finish at step 1, so step 2 admits r1.
    """
    s = InvariantChecker(make_scheduler(64, 8, 1000, max_loras=1))
    s.add(Request(rid=0, prompt_len=4, max_new=2, lora="A"))
    s.add(Request(rid=1, prompt_len=4, max_new=2, lora="B"))
    s.add(Request(rid=2, prompt_len=4, max_new=2, lora="A"))
    s.add(Request(rid=3, prompt_len=4, max_new=5))
    assert _step(s).admitted == (0, 2, 3)
    assert s.max_lora_passes_of_one == 1
    assert s.scheduler.request_state(1).num_lora_passes == 1
    assert _step(s).admitted == ()  # nothing admitted past r1: no second pass
    assert s.max_lora_passes_of_one == 1
    assert set(s.last_finished) == {0, 2}
    assert _step(s).admitted == (1,)
    while s.has_unfinished():
        _step(s)
    s.check_final()


def test_the_bound_makes_it_block_the_queue():
    """max_lora_passes=1: after one pass, B stops admission; a later A waits behind it until A drains."""
    s = InvariantChecker(make_scheduler(64, 8, 1000, max_loras=1, max_lora_passes=1))
    s.add(Request(rid=0, prompt_len=4, max_new=3, lora="A"))
    s.add(Request(rid=1, prompt_len=4, max_new=2, lora="B"))
    s.add(Request(rid=2, prompt_len=4, max_new=2, lora="A"))
    assert _step(s).admitted == (0, 2)  # r1 passed once
    s.add(Request(rid=3, prompt_len=4, max_new=2, lora="A"))
    assert _step(s).admitted == ()  # r1 has used its pass: r3 (A, which could join) waits behind it
    assert _step(s).admitted == ()  # r0 finishes in this step (3 tokens: steps 0, 1, 2)
    assert 0 in s.last_finished and 2 in s.last_finished or 0 in s.last_finished
    assert _step(s).admitted == (1,)  # A drained: B joins; r3 (A) cannot join behind it and r1 has
    # no passes left, so r3 is not passed either: strict order again
    assert s.scheduler.request_state(3).status.name == "WAITING"
    while s.has_unfinished():
        _step(s)
    s.check_final()
    assert s.max_lora_passes_of_one == 1


def test_zero_passes_is_strict_queue_order():
    """max_lora_passes=0: an adapter that cannot join stops admission at once (the contract's strict FCFS)."""
    s = InvariantChecker(make_scheduler(64, 8, 1000, max_loras=1, max_lora_passes=0))
    s.add(Request(rid=0, prompt_len=4, max_new=2, lora="A"))
    s.add(Request(rid=1, prompt_len=4, max_new=2, lora="B"))
    s.add(Request(rid=2, prompt_len=4, max_new=2))
    assert _step(s).admitted == (0,)
    assert _step(s).admitted == ()
    assert _step(s).admitted == (1, 2)
    while s.has_unfinished():
        _step(s)
    s.check_final()


def test_base_model_requests_take_no_slot():
    """Requests without an adapter never count against max_loras: 5 base requests run beside one adapter."""
    s = make_scheduler(64, 8, 1000, max_loras=1)
    s.add(Request(rid="a", prompt_len=4, max_new=2, lora="A"))
    for i in range(5):
        s.add(Request(rid=i, prompt_len=4, max_new=2))
    assert s.schedule().admitted == ("a", 0, 1, 2, 3, 4)


def test_without_max_loras_plans_are_unchanged():
    """max_loras=None: plans with adapter names equal the plans of the same requests without them."""
    rng = random.Random(7)
    specs = [(i, rng.randint(1, 90), rng.randint(1, 20), rng.choice([None, "A", "B", "C"])) for i in range(60)]
    runs = []
    for named in (True, False):
        s = make_scheduler(32, 5, 600, kv_policy="paged", block_size=4)
        plans = []
        for rid, p, m, lora in specs:
            s.add(Request(rid=rid, prompt_len=p, max_new=m, lora=lora if named else None))
        while s.has_unfinished():
            plan = s.schedule()
            plans.append([(c.rid, c.num_tokens, c.start) for c in plan])
            s.complete(plan)
        runs.append(plans)
    assert runs[0] == runs[1]


def test_resolved_config_has_no_lora_fields_without_the_limit():
    """The `--json` record of a configuration without max_loras is the one before adapters existed."""
    assert "max_loras" not in SchedulerConfig(8, 4, 100).resolved()
    assert SchedulerConfig(8, 4, 100, max_loras=3).resolved()["max_loras"] == 3


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4"], ids=["zero", "neg", "bool", "float", "str"])
def test_bad_max_loras_is_refused(bad):
    """max_loras must be None or an integer >= 1; the error names the field and the value."""
    with pytest.raises(InvalidConfig, match=r"max_loras.*" + repr(bad).replace(".", r"\.")):
        Scheduler(token_budget=8, max_seqs=4, kv_tokens=100, max_loras=bad)


@pytest.mark.parametrize("bad", [-1, True, 2.0, None], ids=["neg", "bool", "float", "none"])
def test_bad_max_lora_passes_is_refused(bad):
    """max_lora_passes must be an integer >= 0."""
    with pytest.raises(InvalidConfig, match="max_lora_passes"):
        SchedulerConfig(8, 4, 100, max_loras=2, max_lora_passes=bad)


@pytest.mark.parametrize("bad", [["A"], True, float("nan")], ids=["list", "bool", "nan"])
def test_bad_adapter_name_is_refused_and_nothing_changes(bad):
    """Request(lora=...) refuses an unhashable, bool or NaN name, naming the field."""
    s = make_scheduler(max_loras=2)
    with pytest.raises(RequestRejected, match="lora"):
        s.add(Request(rid=1, prompt_len=4, max_new=2, lora=bad))
    assert 1 not in s and s.num_waiting == 0 and s.kv_free == s.stats().kv_total


def test_an_empty_adapter_name_is_the_base_model():
    """lora="" is the base model (a trace's empty column): stored as None, it takes no slot."""
    assert Request(rid=1, prompt_len=4, max_new=2, lora="").lora is None
    s = make_scheduler(64, 8, 1000, max_loras=1)
    s.add(Request(rid="a", prompt_len=4, max_new=2, lora="A"))
    s.add(Request(rid="b", prompt_len=4, max_new=2, lora=""))
    assert s.schedule().admitted == ("a", "b")


def test_lora_slots_count_each_adapter_until_its_last_request_leaves():
    """LoraSlots: an adapter holds its slot while any running request holds it; None takes none."""
    slots = LoraSlots(max_loras=2, max_lora_passes=3)
    slots.join("A")
    slots.join("A")
    slots.join(None)
    slots.join("B")
    assert not slots.can_join("C") and slots.can_join("A") and slots.can_join(None)
    slots.leave("A")
    assert not slots.can_join("C")
    slots.leave("A")
    assert slots.can_join("C") and slots.running == {"B": 1}


class _NoCount(LoraSlots):
    def join(self, lora):
        pass


class _NoPasses(LoraSlots):
    def passed(self, recs):
        pass


class _IgnoresAdapters(Scheduler):
    """A deliberately broken scheduler: it never counts running adapters (every adapter can join)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._lora = self._host.lora = _NoCount(self.config.max_loras, self.config.max_lora_passes)


class _PassesForever(Scheduler):
    """A deliberately broken scheduler: passes are never counted, so a blocked adapter is passed forever."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._lora = self._host.lora = _NoPasses(self.config.max_loras, self.config.max_lora_passes)


@pytest.mark.parametrize("broken", [_IgnoresAdapters, _PassesForever], ids=["no-limit", "unbounded-pass"])
def test_checker_catches_broken_adapter_rules(broken):
    """The checker raises on a scheduler that runs too many adapters or passes a request too often."""
    chk = InvariantChecker(broken(token_budget=64, max_seqs=8, kv_tokens=1000, max_loras=1, max_lora_passes=2))
    with pytest.raises(InvariantViolation):
        chk.add(Request("a0", 4, 30, lora="A"))
        chk.add(Request("b", 4, 3, lora="B"))
        for i in range(30):
            chk.add(Request(f"a{i + 1}", 4, 30, lora="A"))
            chk.complete(chk.schedule())


_REQS = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.sampled_from([None, "a", "b", "c", "d", "e"]),
                           st.integers(0, 30)), min_size=1, max_size=30)


@settings(max_examples=60)
@given(reqs=_REQS, max_loras=st.integers(1, 3), budget=st.integers(1, 48), paged=st.booleans(),
       passes=st.integers(0, 5))
def test_public_api_keeps_the_adapter_limit_and_finishes(reqs, max_loras, budget, paged, passes):
    """Driven through the public API alone (Request(lora=), Scheduler(max_loras=), schedule, complete and
    `rid in scheduler`, has_request's replacement), with requests arriving at random steps: every plan holds
    at most max_loras distinct adapters (counted here from the requests' own names) and at most the budget,
    and every request finishes."""
    kw = dict(kv_policy="paged", block_size=4) if paged else {}
    s = Scheduler(token_budget=budget, max_seqs=6, kv_tokens=400, max_loras=max_loras, max_lora_passes=passes, **kw)
    lora = {}
    pending = sorted(((at, i, p, m, a) for i, (p, m, a, at) in enumerate(reqs)))
    steps = 0
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= steps:
            _, i, p, m, a = pending.pop(0)
            s.add(Request(rid=i, prompt_len=p, max_new=m, lora=a))
            lora[i] = a
        plan = s.schedule()
        assert plan.num_tokens <= budget
        assert len({lora[c.rid] for c in plan} - {None}) <= max_loras
        s.complete(plan)
        steps += 1
        assert steps < 20_000
    assert not any(i in s for i in lora)
    assert s.kv_free == s.stats().kv_total


@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_random_runs_with_adapters_hold_every_invariant_quick(kv_policy):
    """8 seeded random runs per KV policy: the adapter limit and the pass bound hold (checked every step),
    every request finishes and all KV is returned."""
    for seed in range(8):
        chk = random_lora_run(seed, kv_policy)
        assert chk.max_lora_passes_of_one <= chk.scheduler.config.max_lora_passes


@pytest.mark.slow
@pytest.mark.parametrize("kv_policy", ["reserve", "paged"])
def test_random_runs_with_adapters_hold_every_invariant(kv_policy, capsys):
    """30 more seeded random runs per KV policy under the checker (benchmarks/lora_sim.py --core runs 300);
    prints the longest pass-over against its bound, which some runs reach."""
    steps = passes = at_bound = 0
    for seed in range(30):
        chk = random_lora_run(1000 + seed, kv_policy)
        steps += chk.num_steps
        bound = chk.scheduler.config.max_lora_passes
        assert chk.max_lora_passes_of_one <= bound
        passes = max(passes, chk.max_lora_passes_of_one)
        at_bound += chk.max_lora_passes_of_one == bound and bound > 0
    with capsys.disabled():
        print(f"\n[lora {kv_policy}] 30 runs, 1200 requests finished, {steps} steps checked; longest pass-over "
              f"{passes} steps; {at_bound} runs reached their bound")
    assert at_bound > 0  # the bound is exercised, not only respected
