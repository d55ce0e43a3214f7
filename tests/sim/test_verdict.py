"""Verdict lines: the paired bootstrap, the binomial noise of the P:D search and validate's line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stallfree.sim.outputs.verdict import (
    bootstrap_diff,
    disagg_verdict,
    mean_error_interval,
    offered_load_note,
    validate_verdict,
)


def test_bootstrap_of_a_uniform_shift_is_exact_and_of_one_outlier_is_noise():
    # Every request 1 ms slower: every resample shows +1 ms, so the interval is [1, 1].
    assert bootstrap_diff(np.ones(8), np.full(8, 2.0), "mean") == (1.0, 1.0, 1.0)
    assert bootstrap_diff(np.ones(8), np.ones(8), "p99") == (0.0, 0.0, 0.0)
    # One request of ten 10 ms slower: +1 ms on all, but a resample misses it with probability
    # 0.9^10 = 0.35, so the interval reaches 0: within the noise.
    base = np.zeros(10)
    other = base.copy()
    other[9] = 10.0
    d, lo, hi = bootstrap_diff(base, other, "mean")
    assert d == 1.0 and lo == 0.0 and hi > 1.0
    with pytest.raises(ValueError, match="one length"):
        bootstrap_diff(np.ones(2), np.ones(3), "mean")


def test_disagg_verdict_binomial_noise_by_hand():
    """n = 1000, p = 0.99 on both: se = g sqrt(0.01 / 990); 0.25 -> 7.95e-4, 0.30 -> 9.53e-4;
    1.96 x hypot = 2.43e-3 req/s/GPU, far under the +0.05 difference."""
    agg = {"label": "aggregated x4 b2048", "goodput_per_gpu": 0.25, "slo_attainment": 0.99}
    dis = {"label": "disagg 1P:3D b2048/2048", "goodput_per_gpu": 0.30, "slo_attainment": 0.99}
    line, v = disagg_verdict(agg, dis, 1000)
    assert v["noise"] == pytest.approx(1.96 * math.hypot(0.25, 0.30) * math.sqrt(0.01 / 990))
    assert v["pays"] and v["beyond_noise"] and v["change"] == pytest.approx(0.2)
    assert line.startswith("verdict: disaggregation pays: best disaggregated 1P:3D b2048/2048 0.300 req/s/GPU "
                           "against best aggregated x4 b2048 0.250 (+20%;")
    # A difference under the noise is no verdict either way.
    _, close = disagg_verdict(agg, dis | {"goodput_per_gpu": 0.251}, 1000)
    assert not close["beyond_noise"] and not close["pays"]
    # Both serve all 1,000 requests: 0.4832 against 0.4830 req/s/GPU (the last request ends a little
    # earlier) is the offered load twice, not "disaggregation pays" beyond a noise of 0.
    full = {"num_requests": 1000, "completed": 1000, "rejected": 0, "slo_attainment": 1.0}
    line, tie = disagg_verdict(agg | full | {"goodput_per_gpu": 0.4830}, dis | full | {"goodput_per_gpu": 0.4832},
                               1000)
    assert not tie["pays"] and not tie["beyond_noise"] and tie["noise"] == 0.0
    assert line.startswith("verdict: no difference: both serve every request offered within the SLOs: best "
                           "disaggregated 1P:3D b2048/2048 0.483 req/s/GPU against best aggregated x4 b2048 0.483 "
                           "(both the offered load per GPU)")
    # A difference under half a percent is not written as "+0%" or "-0%" (noise 1.96 x 0.3535 x 0.003178).
    line, _ = disagg_verdict(agg | {"goodput_per_gpu": 0.2500}, dis | {"goodput_per_gpu": 0.2499}, 1000)
    assert "(under 1% apart; noise +/-0.0022 req/s/GPU" in line and "-0%" not in line


def test_disagg_verdict_and_note_at_a_light_load_keep_two_significant_digits():
    """At 0.0006 and 0.0004 req/s/GPU the verdict said "0.000 against 0.000" (three decimals): it writes
    them as the reports write rates (wording.rate_text), and the note's offered 0.004 req/s likewise."""
    agg = {"label": "aggregated x4 b2048", "goodput_per_gpu": 0.0004, "slo_attainment": 0.5}
    dis = {"label": "disagg 1P:3D b2048/2048", "goodput_per_gpu": 0.0006, "slo_attainment": 0.5}
    line, v = disagg_verdict(agg, dis, 100)
    noise = 1.96 * math.hypot(0.0004, 0.0006) * math.sqrt(0.5 / 50)
    assert v["noise"] == pytest.approx(noise)
    assert v["pays"]  # +0.00020 against a noise of 0.00014
    assert line == ("verdict: disaggregation pays: best disaggregated 1P:3D b2048/2048 0.00060 req/s/GPU "
                    "against best aggregated x4 b2048 0.00040 (+50%; noise +/-0.00014 req/s/GPU, binomial 95% on "
                    "the attainment)")
    full = {"num_requests": 10, "completed": 10, "rejected": 0, "slo_attainment": 1.0, "num_gpus": 8}
    assert "serves all 0.0040 req/s offered" in str(offered_load_note([full], None, 0.004))


def test_offered_load_note_when_every_aggregated_run_serves_everything():
    """7.73 req/s offered on 16 GPUs: all that goodput per GPU can show (at most 0.483 req/s/GPU) when
    every aggregated run serves all 1,000 requests within the SLOs; no note when one misses a request."""
    full = {"num_requests": 1000, "completed": 1000, "rejected": 0, "slo_attainment": 1.0, "num_gpus": 16}
    split = {**full, "slo_attainment": 0.9}
    note = offered_load_note([full, full], split, 7.73)
    assert note == ("note: every aggregated configuration serves all 7.73 req/s offered within the SLOs: there "
                    "goodput per GPU measures the offered load (7.73 req/s on 16 GPUs), a lower bound on capacity, "
                    "not capacity; raise --rate-scale to compare capacities")
    assert "and so does the best split:" in str(offered_load_note([full], full, 7.73))
    assert offered_load_note([full, split], full, 7.73) is None
    assert offered_load_note([{**full, "rejected": 1, "completed": 999}], full, 7.73) is None


def test_validate_verdict_and_mean_error_interval():
    e, lo, hi = mean_error_interval([100.0] * 5, [110.0] * 5)
    assert (e, lo, hi) == pytest.approx((10.0, 10.0, 10.0))
    line = validate_verdict({"mean_e2e": 5.0, "mean_ttft": -30.0}, {"e2e": 10.0, "ttft": 20.0},
                            {"e2e": (-2.0, 12.0)})
    assert line == ("verdict: the simulator is outside the goals: mean E2E +5.0% (within 10%; within the noise, "
                    "95% interval -2.0% to +12.0%); mean TTFT -30.0% (outside 20%)")
    plain = validate_verdict({"mean_e2e": 5.0}, {"e2e": 10.0}, noise_note="drift 3%")
    assert plain.endswith("mean E2E +5.0% (within 10%) (noise: drift 3%)")


def test_validate_engine_mode_gets_a_verdict_line():
    from stallfree.validate.cli import add_verdict

    res = {"engine": {"mean_ttft_ms": 100.0, "mean_tpot_ms": 10.0, "mean_e2e_ms": 1000.0},
           "simulator": {"mean_ttft_ms": 150.0, "mean_tpot_ms": 10.5, "mean_e2e_ms": 1050.0},
           "config": {"engine_speed_drift_pct": 7.0}}
    add_verdict(res, "engine")
    assert res["verdict"].startswith("verdict: the simulator is outside the goals: mean E2E +5.0% (within 10%); "
                                     "mean TTFT +50.0% (outside 20%); mean TPOT +5.0% (within 10%)")
    assert "moved +7% between the run's halves" in res["verdict"]


def test_compare_verdict_on_two_runs_of_one_workload():
    """Steps of 1 s: caching-free runs of budget 8 and budget 4 on one 8-token prompt (1 then 2 steps to
    its first token): TTFT 1 s -> 2 s on the one request, +100%; a single request is its own resample."""
    from stallfree.sim.inputs.workload import Workload
    from stallfree.sim.outputs.verdict import compare_verdict
    from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
    from stallfree.sim.run.costs import LinearCostModel
    from stallfree.sim.run.simulator import simulate

    wl = Workload((0.0,), (8,), (3,))
    cost = LinearCostModel(base_s=1.0, per_token_s=0.0)
    a, b = simulate(wl, SchedulerConfig(100, 8, 2), cost), simulate(wl, SchedulerConfig(100, 4, 2), cost)
    line, data = compare_verdict([a, b], ["b8", "b4"], "budget")
    assert data["b4"]["TTFT p50"] == {"base_ms": 1000.0, "other_ms": 2000.0, "low_ms": 1000.0, "high_ms": 1000.0,
                                      "beyond_noise": True}
    assert "TTFT p50 1,000 ms -> 2,000 ms (+100%, beyond the noise)" in line
    assert data["b4"]["TPOT p99"]["beyond_noise"] is False  # 1 s per token in both


def test_tune_best_by_kind_reads_the_ranked_rows():
    from stallfree.sim.studies.tune_report import best_by_kind

    def row(b, m, g, pp=None):
        return {"token_budget": b, "max_seqs": m, "request_goodput": g, "slo_attainment": 1.0, "p99_tpot_ms": 30.0,
                "partial_prefills": pp}

    # Ranked best first: the best overall has partial prefills; without them budget 512 at max_seqs 256 leads.
    rows = [row(512, 256, 5.0, (2, 2, 64)), row(512, 512, 4.9), row(512, 256, 4.8), row(1024, 256, 4.7),
            row(512, 128, 4.0)]
    kinds = best_by_kind(rows, 256)
    assert [(k["kind"], k["value"], k["tried"]) for k in kinds] == [
        ("token_budget", 512, [512, 1024]), ("max_seqs", 512, [128, 256, 512]),
        ("partial_prefills", (2, 2, 64), [(2, 2, 64)])]
    assert kinds[0]["request_goodput"] == 4.8  # the best budget at the base max_seqs, no partial prefills
