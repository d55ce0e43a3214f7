"""Time budget mode (stallfree.sim.run.time_budget) and Scheduler.decode_load, which it reads."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stallfree import Request, Scheduler
from stallfree.cli import main
from stallfree.core.config import SchedulerConfig
from stallfree.core.request import RequestStatus
from stallfree.costmodel import CostModel
from stallfree.sim import LinearCostModel, Workload, parse_length_spec, simulate, synthetic
from stallfree.sim.run.time_budget import PlanPricer, TimeBudgetConfig, TimeBudgetScheduler, time_model


class HandModel:
    """step = 10 ms + 0.1 ms per token + 1 us per decode context token, in integer microseconds.

    Integer arithmetic makes the inverse exact, so tests can compare budgets with hand figures.
    """

    base_us, token_us, ctx_us = 10_000, 100, 1

    def step_time(self, plan):
        """Return the step's time, s."""
        if not plan.num_tokens:
            return 0.0
        return (self.base_us + self.token_us * plan.num_tokens + self.ctx_us * plan.decode_context_sum) / 1e6

    def max_tokens_within(self, target_s, num_decodes, decode_context_sum, chunk_start=0):
        """Return the most tokens within target_s (0 if the decodes alone exceed it)."""
        left = round(target_s * 1e6) - self.base_us - self.ctx_us * decode_context_sum
        tokens = left // self.token_us
        return tokens if tokens >= max(num_decodes, 1) else 0

    def decode_step_time(self, num_decodes, context_len):
        """Return a decode-only step's time, s."""
        return (self.base_us + (self.token_us + self.ctx_us * context_len) * num_decodes) / 1e6


class RecordingModel(HandModel):
    """A HandModel that records the arguments of every max_tokens_within call."""

    def __init__(self):
        self.calls = []

    def max_tokens_within(self, target_s, num_decodes, decode_context_sum, chunk_start=0):
        """Record the call, then answer as HandModel."""
        self.calls.append((num_decodes, decode_context_sum, chunk_start))
        return super().max_tokens_within(target_s, num_decodes, decode_context_sum, chunk_start)


def _decoding_reference(sched, live):
    """(ready decodes, context sum) from request_state: a decode's context is prompt + generated - 1."""
    count = total = 0
    for rid, prompt_len in live.items():
        try:
            st = sched.request_state(rid)
        except KeyError:
            continue
        if st.status is RequestStatus.DECODING:
            count += 1
            total += prompt_len + st.num_generated - 1
    return count, total


@pytest.mark.parametrize("overflow", ["oldest", "rotate"])
def test_decode_load_matches_request_states_and_plans(overflow):
    """decode_load equals the decodes counted from request_state, and the next plan's decodes when all fit."""
    rng = random.Random(7)
    s = Scheduler(64, 32, 100_000, decode_overflow=overflow)
    live, rid, checked, overflowed = {}, 0, 0, 0
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 1, 2])):
            p = rng.randint(1, 40)
            s.add(Request(rid, p, rng.randint(1, 30)))
            live[rid] = p
            rid += 1
        load = s.decode_load
        assert load == _decoding_reference(s, live)
        budget = rng.choice([None, None, 4, 16])  # small per-step budgets make decodes overflow
        plan = s.schedule(token_budget=budget)
        if plan.num_decodes == load[0]:
            assert plan.decode_context_sum == load[1]
            checked += 1
        else:
            overflowed += 1
        s.complete(plan)
    assert checked > 100 and overflowed > 20


def test_decode_load_empty_and_after_first_token():
    """An empty scheduler has no decodes; a 5-token prompt's request decodes at context 5 the step after."""
    s = Scheduler(8, 4, 100)
    assert s.decode_load == (0, 0)
    s.add(Request("a", 5, 3))
    s.complete(s.schedule())
    assert s.decode_load == (1, 5)
    s.complete(s.schedule())
    assert s.decode_load == (1, 6)


def test_plan_pricer_inverts_a_linear_model():
    """PlanPricer finds floor((target - base - ctx cost) / per-token) on a linear model (powers of two)."""
    lin = LinearCostModel(base_s=0.25, per_token_s=2**-7, per_context_token_s=2**-12)
    pricer = time_model(lin)
    assert isinstance(pricer, PlanPricer)
    assert pricer.max_tokens_within(1.0, 0, 0) == 96  # 0.75 / 2^-7
    assert pricer.max_tokens_within(1.0, 10, 1024) == 64  # (0.75 - 1024 / 4096) / 2^-7
    assert pricer.max_tokens_within(1.0, 100, 0) == 0  # 100 decodes alone: 0.25 + 100/128 > 1
    assert pricer.decode_step_time(8, 512) == pytest.approx(0.25 + 8 / 128 + 8 * 512 / 4096)


def test_time_model_keeps_the_roofline_model():
    """A CostModel has max_tokens_within of its own and is used as it is."""
    cm = CostModel.from_names(model="llama-3.3-70b", gpu="h100-sxm", tp=4, dtype="fp8")
    assert time_model(cm) is cm


def _wrapped(budget=4096, model=None, target=0.030, **kw):
    return TimeBudgetScheduler(Scheduler(budget, 256, 10**7, **kw), model or HandModel(), target)


def _start_decodes(tb, n, prompt_len=10, max_new=100):
    for i in range(n):
        tb.add(Request(("d", i), prompt_len, max_new))
    tb.complete(tb.scheduler.schedule())  # all prompts in one full step: n decodes at context prompt_len next


def test_step_budget_by_hand():
    """50 decodes at context 10 each, 30 ms target: (30 - 10 - 0.5) ms / 0.1 ms = 195 tokens."""
    tb = _wrapped()
    _start_decodes(tb, 50)
    assert tb.scheduler.decode_load == (50, 500)
    assert tb.step_budget() == 195
    tb.add(Request("p", 1000, 2))
    plan = tb.schedule()
    assert plan.num_decodes == 50 and plan.num_tokens == 195 and plan.token_budget == 195
    assert HandModel().step_time(plan) <= 0.030


def test_step_budget_clamped_to_the_configured_budget():
    """The budget never exceeds the scheduler's own token_budget."""
    tb = _wrapped(budget=64)
    assert tb.step_budget() == 64


def test_decodes_alone_over_target_overflow_to_those_that_fit():
    """180 decodes at context 10 need 28 ms; under 20 ms the step holds the 90 that fit (oldest first)."""
    tb = _wrapped(target=0.020)
    _start_decodes(tb, 180)
    # each decode at context 10 costs 0.1 + 0.01 ms: (20 - 10) / 0.11 = 90.9 -> 90
    assert tb.step_budget() == 90
    plan = tb.schedule()
    assert plan.decode_rids == tuple(("d", i) for i in range(90))
    assert HandModel().step_time(plan) <= 0.020


def test_one_entry_when_nothing_fits():
    """With a target under one token's step the budget is 1: one decode or a one-token chunk per step."""
    tb = _wrapped(target=0.005)
    tb.add(Request("a", 3, 2))
    plans = []
    while tb.has_unfinished():
        plan = tb.schedule()
        plans.append(plan.num_tokens)
        tb.complete(plan)
    assert plans == [1, 1, 1, 1]  # three prompt tokens, then one decode


def test_partial_prefill_offset_is_passed_to_the_cost_model():
    """The chunk offset handed to max_tokens_within is the tokens already prefilled of the partial prompt."""
    model = RecordingModel()
    tb = _wrapped(model=model, target=0.030)  # 200 tokens per step with nothing running
    tb.add(Request("long", 500, 2))
    starts = []
    while tb.has_unfinished():
        plan = tb.schedule()
        starts.append(model.calls[-1][2])
        tb.complete(plan)
    assert starts == [0, 200, 400, 0]  # chunks 200, 200, 100; then its one decode


def test_abort_of_the_partial_prompt_resets_the_offset():
    """Aborting the prompt being prefilled sets the next chunk offset back to 0."""
    model = RecordingModel()
    tb = _wrapped(model=model)
    tb.add(Request("long", 500, 2))
    tb.complete(tb.schedule())
    tb.abort("long")
    tb.add(Request("next", 50, 2))
    tb.schedule()
    assert model.calls[-1] == (0, 0, 0)


def test_rejects_bad_target_and_speculative_decodes():
    """A target <= 0 and a scheduler with speculative tokens are refused with the value named."""
    with pytest.raises(ValueError, match="-1"):
        TimeBudgetScheduler(Scheduler(64, 4, 1000), HandModel(), -1)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        TimeBudgetScheduler(Scheduler(64, 4, 1000, num_spec_tokens=2), HandModel(), 0.05)


def _step_times(res):
    dur = np.frombuffer(res.step_end) - np.frombuffer(res.step_start)
    return dur, np.asarray(res.step_tokens)


@pytest.mark.parametrize(
    ("prompts", "outputs", "rate", "target"),
    [
        ("uniform:1,40", "uniform:2,30", 3000.0, 0.015),  # many short prompts admitted per step
        pytest.param("lognormal:300,1.5", "lognormal:100,1", 100.0, 0.030, marks=pytest.mark.slow),
        # long context: chunks at large offsets
        pytest.param("lognormal:20000,0.2", "lognormal:100,0.5", 1.0, 0.050, marks=pytest.mark.slow),
    ],
    ids=["short-prompts", "mixed", "long-context"],
)
def test_roofline_steps_never_exceed_the_target(prompts, outputs, rate, target):
    """On the roofline model, every step with more than one token is predicted within the target."""
    cm = CostModel.from_names(model="llama-3.3-70b", gpu="h100-sxm", tp=4, dtype="fp8")
    wl = synthetic(400, rate, parse_length_spec(prompts), parse_length_spec(outputs), "poisson", 1.0, 3)
    cfg = TimeBudgetConfig(SchedulerConfig(65536, 512, cm.kv_capacity_tokens()), target, cm)
    res = simulate(wl, cfg, cm, check=True)
    dur, tokens = _step_times(res)
    assert res.num_steps > 40
    assert not np.any((dur > target) & (tokens > 1))
    assert dur.max() > 0.9 * target  # the target is what limits the steps, not the cap


def test_linear_steps_never_exceed_the_target_and_fill_it():
    """On the hand model, steps stay within 30 ms, and steps that left prompt tokens waiting are full to the token."""
    wl = synthetic(
        300, 200.0, parse_length_spec("uniform:50,400"), parse_length_spec("uniform:2,60"), "poisson", 1.0, 5
    )
    model = HandModel()
    res = simulate(wl, TimeBudgetConfig(SchedulerConfig(65536, 64, 10**6), 0.030, model), model)
    dur, tokens = _step_times(res)
    assert dur.max() <= 0.030 + 1e-12
    # A step whose queue was not empty afterwards could not take one more token.
    waiting = np.asarray(res.step_waiting)
    full = waiting > 0
    assert full.sum() > 50
    assert np.all(dur[full] + model.token_us / 1e6 > 0.030 - 1e-12)


def test_time_budget_config_is_picklable_and_labelled():
    """The config pickles (worker processes) and labels runs by their target."""
    import pickle

    cfg = TimeBudgetConfig(SchedulerConfig(65536, 256, 1000), 0.05, LinearCostModel(0.01, 1e-4))
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.warns(DeprecationWarning, match="TimeBudgetConfig"):  # the former form, for one release
        assert TimeBudgetConfig(1000, 0.05, cfg.cost_model) == cfg
    assert cfg.label == "time/50ms"
    assert isinstance(cfg(), TimeBudgetScheduler)


@pytest.mark.slow  # a whole simulate command on the bundled trace
def test_simulate_cli_step_time_target(capsys):
    """simulate --step-time-target runs the wrapper; no inter-token gap exceeds the 40 ms target."""
    import json

    code = main(["simulate", "--num-requests", "300", "--step-time-target", "40ms", "--json", "--check", "--no-range"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert out["header"]["step_time_target_s"] == 0.04
    assert run["label"] == "time/40ms" and run["completed"] == 300
    assert run["p99_itl_ms"] <= 40.0


def test_simulate_cli_step_time_target_with_compare_is_usage_error(capsys):
    """--step-time-target with --compare is one line on stderr and exit status 2."""
    assert main(["simulate", "--step-time-target", "50ms", "--compare"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-time-target" in err[0]


def test_workload_of_one_request_is_exact():
    """One 10-token prompt with a 20 ms target on the hand model: a single 10-token step, 11 ms."""
    wl = Workload((0.0,), (10,), (1,), "one")
    model = HandModel()
    res = simulate(wl, TimeBudgetConfig(SchedulerConfig(65536, 4, 1000), 0.020, model), model)
    assert list(res.step_tokens) == [10]
    assert res.step_end[0] == pytest.approx(0.011)
