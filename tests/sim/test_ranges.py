"""The range of each latency figure (stallfree.sim.studies.ranges) and `simulate`'s `range` key."""

from __future__ import annotations

import json

import pytest

from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.studies.ranges import RANGE_KEYS, STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, run_range


def test_the_error_model_brackets_one_and_is_the_measured_percentiles():
    """The factors are the 10th and 90th percentile of measured / simulated TPOT over the dev runs
    (benchmarks/step_time_error.py: 0.939 and 1.231 on 210 samples)."""
    assert (STEP_TIME_LOW, STEP_TIME_HIGH) == (0.939, 1.231)


def test_scaled_cost_scales_every_step_but_not_the_front_end():
    """A 100 ms step scaled by 1.5 takes 150 ms; the front end (a request's cost) stays as it was."""
    class Inner:
        frontend_s = 0.006

        def step_time(self, plan):
            return 0.1

    cost = ScaledCost(Inner(), 1.5)
    assert cost.step_time(None) == pytest.approx(0.15)  # type: ignore[arg-type]
    assert cost.frontend_s == 0.006
    assert ScaledCost(LinearCostModel(0.1, 0.0), 2.0).frontend_s == 0.0


@pytest.mark.parametrize("factor", [0, -1.0, float("inf"), float("nan")], ids=["zero", "negative", "inf", "nan"])
def test_scaled_cost_refuses_a_factor_that_is_not_positive_and_finite(factor):
    """The error names the field and the value."""
    with pytest.raises(ValueError, match=r"ScaledCost.factor must be a finite number > 0, got"):
        ScaledCost(LinearCostModel(0.1, 0.0), factor)


def test_run_range_is_the_min_and_max_of_the_three_replays():
    """Low end from the fast replay, high from the slow one, whatever their order; None where any lacks it."""
    base = dict.fromkeys(RANGE_KEYS, 10.0) | {"p99_tpot_ms": None}
    fast = dict.fromkeys(RANGE_KEYS, 8.0) | {"mean_ttft_ms": 12.0}
    slow = dict.fromkeys(RANGE_KEYS, 15.0)
    r = run_range(base, [fast, slow])
    assert set(r) == set(RANGE_KEYS) and len(RANGE_KEYS) == 20
    assert r["mean_e2el_ms"] == [8.0, 15.0]
    assert r["mean_ttft_ms"] == [10.0, 15.0]
    assert r["p99_tpot_ms"] is None


def _trace(tmp_path):
    # Lone requests 10 s apart: 10-token prompts, 3 tokens out; nothing ever queues.
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{10.0 * k},10,3\n" for k in range(6)))
    return str(path)


def test_simulate_ranges_an_unloaded_run_by_the_factors_exactly(tmp_path, capsys):
    """Steps of 100 ms, synchronous, one request at a time: TTFT is one step (100 ms), TPOT one step, E2E
    three steps, no queue; replayed at 0.939 and 1.231 x every step, TTFT is [93.9, 123.1] ms, E2E
    [281.7, 369.3] ms, queueing [0, 0]."""
    from stallfree.cli import main

    assert main(["simulate", "--trace", _trace(tmp_path), "--linear-cost", "100,0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["mean_ttft_ms"] == pytest.approx(100.0)
    assert run["range"]["mean_ttft_ms"] == [pytest.approx(93.9), pytest.approx(123.1)]
    assert run["range"]["p99_tpot_ms"] == [pytest.approx(93.9), pytest.approx(123.1)]
    assert run["range"]["mean_e2el_ms"] == [pytest.approx(281.7), pytest.approx(369.3)]
    assert run["range"]["p99_queue_ms"] == [0.0, 0.0]
    assert out["header"]["range_model"]["step_time_high"] == STEP_TIME_HIGH


def test_simulate_no_range_leaves_the_keys_out_and_the_rest_the_same(tmp_path, capsys):
    """--no-range: no `range`, no `range_model`; every other key of the run keeps its value."""
    from stallfree.cli import main

    trace = _trace(tmp_path)
    assert main(["simulate", "--trace", trace, "--linear-cost", "100,0", "--json"]) == 0
    with_range = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--trace", trace, "--linear-cost", "100,0", "--json", "--no-range"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert "range" not in without["runs"][0] and "range_model" not in without["header"]
    a, b = with_range["runs"][0], without["runs"][0]
    assert {k: v for k, v in a.items() if k not in ("range", "sim_wall_s")} == \
        {k: v for k, v in b.items() if k != "sim_wall_s"}


def test_the_table_shows_each_range(tmp_path, capsys):
    """The terminal table prints [low-high] beside each latency it has a range for."""
    from stallfree.cli import main

    assert main(["simulate", "--trace", _trace(tmp_path), "--linear-cost", "100,0"]) == 0
    out = capsys.readouterr().out
    assert "100.0 [93.9-123.1]" in out


def test_sweep_range_brackets_each_point_by_the_factors(tmp_path, capsys):
    """sweep --range on the unloaded trace: each point's TTFT range is [93.9, 123.1] ms; without it, no key."""
    from stallfree.cli import main

    base = ["sweep", "--trace", _trace(tmp_path), "--linear-cost", "100,0", "--budgets", "64",
            "--batching", "chunked", "--jobs", "1", "--json"]
    assert main([*base, "--range"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["rows"][0]
    assert row["range"]["median_ttft_ms"] == [pytest.approx(93.9), pytest.approx(123.1)]
    assert out["header"]["range_model"]["step_time_low"] == STEP_TIME_LOW
    assert main(base) == 0
    assert "range" not in json.loads(capsys.readouterr().out)["rows"][0]


def test_scaled_cost_pickles_for_worker_processes():
    """A ScaledCost crosses to a worker process and prices as before."""
    import pickle

    cost = pickle.loads(pickle.dumps(ScaledCost(LinearCostModel(0.1, 0.0), 1.5)))
    assert (cost.factor, cost.inner) == (1.5, LinearCostModel(0.1, 0.0))


def test_tune_range_is_the_chosen_candidates(tmp_path, capsys):
    """tune --range on the unloaded trace: the chosen candidate's TTFT range is [93.9, 123.1] ms."""
    from stallfree.cli import main

    args = ["tune", "--trace", _trace(tmp_path), "--linear-cost", "100,0", "--budgets", "64", "--slo-ttft", "1s",
            "--slo-tpot", "1s", "--jobs", "1", "--range"]
    assert main([*args, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["range"]["median_ttft_ms"] == [pytest.approx(93.9), pytest.approx(123.1)]
    assert main(args) == 0
    assert "range of the chosen (every step x0.939 to x1.231): TTFT p99 93.9-123.1 ms" in capsys.readouterr().out


def test_plan_range_is_the_answers_cluster(tmp_path, capsys):
    """plan --range: twelve one-token requests 0.25 s apart, 1 s steps of one request, four replicas (the
    answer): each request finds a free replica, TTFT one step; at 0.939 x every step still so (939 ms, the
    low end), at 1.231 x the replicas fall behind, so the high end is at least 1,231 ms."""
    from stallfree.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{0.25 * k},10,1\n" for k in range(12)))
    args = ["plan", "--trace", str(trace), "--linear-cost", "1000,0", "--max-num-seqs", "1", "--slo-ttft", "1s",
            "--executor", "serial", "--no-disaggregate", "--range"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    span = report["answer"]["row"]["range"]
    assert report["answer"]["replicas"] == 4
    assert span["median_ttft_ms"][0] == pytest.approx(939.0)
    assert span["p99_ttft_ms"][1] >= 1231.0 - 1e-6
    assert "p99_tpot_ms" in span and "mean_ttft_ms" not in span  # the row's own keys only
    assert main(args) == 0
    assert "range of the answer (every step at the 10th to 90th percentile" in capsys.readouterr().out


def test_a_time_budget_plans_with_the_unscaled_model():
    """With --step-time-target the scheduler sizes each step by the model's prediction; a range's replay
    scales the steps as run, not that prediction (the planner does not know the error)."""
    from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.studies.experiment import scheduler_for

    setup = Setup(WorkloadOptions(num_requests=10), HardwareOptions(linear_cost="10,50"))
    base = setup.cost_model
    setup.cost_model = ScaledCost(base, 1.231)
    sched = scheduler_for(setup, "chunked", 2048, 0.05)
    assert sched.cost_model is base
