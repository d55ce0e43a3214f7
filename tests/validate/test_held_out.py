"""Verdicts on held-out data: `validate --against` reports the rows a profile was fitted on apart, judges
the rest, and gives the signed bias beside each absolute error."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.sim.inputs.engine_profile import EngineProfile, fit_rows, load_profile
from stallfree.validate.silicon import held_out_verdict, is_fitted, validate_silicon

CSV = Path(__file__).parent / "data" / "silicon_small.csv"


def _row(model, gpu, ttft_err, tpot_err, fitted=False):
    return {"model": model, "gpu": gpu, "engine": "vllm", "mode": "agg", "fitted": fitted,
            "ttft_ape_pct": abs(ttft_err), "tpot_ape_pct": abs(tpot_err),
            "ttft_err_pct": ttft_err, "tpot_err_pct": tpot_err}


def test_the_shipped_profile_names_the_rows_it_was_fitted_on():
    """Profile vllm: the Llama-3.1-70B vLLM aggregated rows on H100 and H200; none and hand-made: nothing."""
    fit = fit_rows(load_profile("vllm"))
    assert fit == {"engine": "vllm", "mode": "agg", "model_contains": "llama-3.1-70b", "gpu": ["h100-sxm", "h200"]}
    assert fit_rows(EngineProfile("none")) is None
    assert fit_rows(EngineProfile("mine", step_s=0.001)) is None
    assert is_fitted(_row("meta-llama/Llama-3.1-70B", "h200", 0, 0), fit)
    assert not is_fitted(_row("meta-llama/Llama-3.1-70B", "b200", 0, 0), fit)
    assert not is_fitted(_row("Qwen/Qwen3-32B", "h100-sxm", 0, 0), fit)


def test_the_verdict_is_on_the_held_out_rows_with_the_signed_bias():
    """Held out: TTFT errors +10% and -30% (median APE of 10 and 30: 20%; bias -10%), TPOT -4% and -8% (6%,
    bias -6%): TTFT 20% is within its goal of 20%, TPOT 6% within 10%. The fitted row's +90% TTFT is
    reported apart and does not sink the verdict."""
    rows = [_row("q", "h100-sxm", 10.0, -4.0), _row("q", "h100-sxm", -30.0, -8.0),
            _row("l", "h200", 90.0, 2.0, fitted=True)]
    split, line = held_out_verdict(rows, load_profile("vllm"))
    assert split["held_out"]["rows"] == 2 and split["fitted"]["rows"] == 1
    assert split["held_out"]["ttft_median_ape_pct"] == pytest.approx(20.0)
    assert split["held_out"]["ttft_bias_pct"] == pytest.approx(-10.0)
    assert split["held_out"]["tpot_bias_pct"] == pytest.approx(-6.0)
    assert split["fitted"]["ttft_bias_pct"] == pytest.approx(90.0)
    assert line.startswith("verdict: within the goals on 2 held-out rows: median APE TTFT 20.0% (bias -10.0%; "
                           "goal 20%), TPOT 6.0% (bias -6.0%) (goal 10%); the 1 rows engine profile vllm was "
                           "fitted on, reported apart: median APE TTFT 90.0%")


def test_every_row_fitted_on_is_not_judged():
    """Only fitted rows: no verdict is given on them."""
    _, line = held_out_verdict([_row("l", "h200", 5.0, 1.0, fitted=True)], load_profile("vllm"))
    assert line.startswith("verdict: not judged: every one of the 1 rows was fitted on")


def test_validate_silicon_marks_the_fitted_row_of_the_small_csv():
    """Of the small CSV's two replayable vLLM rows, line 3 (Llama-3.1-70B on H100) is profile vllm's fit set,
    line 2 (Llama-3.1-8B-FP8 on H200) is held out; each row's signed error has its APE as magnitude."""
    res = validate_silicon(str(CSV), load_profile("vllm"), engine="vllm")
    assert [(r["line"], r["fitted"]) for r in res["rows"]] == [(2, False), (3, True)]
    assert (res["overall"]["held_out"]["rows"], res["overall"]["fitted"]["rows"]) == (1, 1)
    held = res["rows"][0]
    assert abs(held["ttft_err_pct"]) == pytest.approx(held["ttft_ape_pct"])
    assert res["overall"]["held_out"]["ttft_bias_pct"] == pytest.approx(held["ttft_err_pct"])
    assert "on 1 held-out rows" in res["verdict"]


def test_the_default_pricing_marks_the_rows_its_profile_was_fitted_on():
    """Without --kernels or --engine-profile (profile None, kernels None) the rows are priced by vLLM's kernel
    tables with profile vllm, as under --kernels vllm: the same rows are fitted (here the one replayable
    row, line 3, Llama-3.1-70B on H100) and the verdict names that profile. The fitted set was looked up on
    the profile given, None, so every row read as held out."""
    res = validate_silicon(str(CSV), None, None, engine="vllm")
    named = validate_silicon(str(CSV), load_profile("vllm"), "vllm", engine="vllm")
    assert [(r["line"], r["engine_profile"], r["fitted"]) for r in res["rows"]] == [(3, "vllm", True)]
    assert [(r["line"], r["fitted"]) for r in named["rows"]] == [(3, True)]
    assert [r["sim_ttft_ms"] for r in res["rows"]] == [r["sim_ttft_ms"] for r in named["rows"]]
    assert res["overall"]["fitted"] == named["overall"]["fitted"] and res["overall"]["held_out"]["rows"] == 0
    assert res["verdict"] == named["verdict"]
    assert res["verdict"].startswith("verdict: not judged: every one of the 1 rows was fitted on; the 1 rows "
                                     "engine profile vllm was fitted on"), res["verdict"]


def test_today_pricing_fits_no_row():
    """--kernels none: no profile priced the rows (profile none), so none is fitted."""
    res = validate_silicon(str(CSV), None, "none", engine="vllm")
    assert [r["engine_profile"] for r in res["rows"]] == ["none", "none"]
    assert not any(r["fitted"] for r in res["rows"]) and "(no row was fitted on)" in res["verdict"]


def test_run_folders_are_all_held_out_and_carry_their_signed_bias():
    """No profile or calibration reads run folders: every run is held out; over one run the bias of a figure
    is that run's signed error."""
    from stallfree.validate.against import validate_runs

    res = validate_runs(Path(__file__).parent / "data" / "run_small", EngineProfile("none"))
    s = res["summary"]
    assert (s["held_out_runs"], s["fitted_runs"]) == (1, 0)
    assert s["mean_signed_error_pct"]["mean_ttft"] == pytest.approx(res["runs"][0]["error_pct"]["mean_ttft"])
    assert "range" not in res["runs"][0] and "range_coverage" not in s


def test_run_folder_ranges_bracket_the_replay_and_count_coverage():
    """--range: each figure's range holds the replay's own value; coverage is the share of runs (here one)
    whose measured figure lies inside, so 0 or 1, agreeing with inside_range."""
    from stallfree.validate.against import validate_runs

    res = validate_runs(Path(__file__).parent / "data" / "run_small", EngineProfile("none"), ranges=True)
    run = res["runs"][0]
    for key, (low, high) in run["range"].items():
        assert low <= run["simulated"][key] <= high
        assert run["inside_range"][key] == (low <= run["measured"][key] <= high)
        assert res["summary"]["range_coverage"][key] == float(run["inside_range"][key])
    low, high = run["range"]["mean_e2e_ms"]
    assert high > low > 0
    assert res["summary"]["range_median_rel_width"]["mean_e2e_ms"] == pytest.approx(
        (high - low) / run["simulated"]["mean_e2e_ms"])


def test_cli_range_flag_prints_the_coverage(capsys):
    """`validate --against RUN --range` prints the coverage line."""
    from stallfree.cli import main

    assert main(["validate", "--against", str(Path(__file__).parent / "data" / "run_small"), "--range",
                 "--kernels", "none"]) == 3  # outside the goals, printed first
    assert "ranges (every step at x0.939 and x1.231): measured inside on mean_ttft" in capsys.readouterr().out


def test_cli_ranges_are_on_by_default_and_no_range_drops_them(capsys):
    """`validate --against RUN --json` carries each run's range; --no-range leaves range and coverage out."""
    import json

    from stallfree.cli import main

    run = str(Path(__file__).parent / "data" / "run_small")
    assert main(["validate", "--against", run, "--kernels", "none", "--json"]) == 3  # outside the goals
    out = json.loads(capsys.readouterr().out)
    assert "range" in out["runs"][0] and "range_coverage" in out["summary"]
    assert main(["validate", "--against", run, "--kernels", "none", "--json", "--no-range"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert "range" not in out["runs"][0] and "range_coverage" not in out["summary"]
