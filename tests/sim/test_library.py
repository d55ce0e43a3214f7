"""The simulator as a library: Setup from typed options, run_experiment, sweep and tune called from
Python give the figures the commands print; `tune` says when no candidate meets the SLOs (exit 3);
metric units stay consistent (a public report's case, worked by hand)."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.sim.commands.common import flag_message, flag_words
from stallfree.sim.commands.tune import EXIT_NO_CANDIDATE_MEETS_SLO
from stallfree.sim.inputs.options import HardwareOptions, SetupError, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.experiment import run_experiment
from stallfree.sim.studies.sweep import sweep
from stallfree.sim.studies.tune import tune

# A transparent replica: every step costs 10 ms plus 50 us per token.
LINEAR = HardwareOptions(linear_cost="10,50", kv_tokens=200_000)


def _synthetic(n: int = 120) -> WorkloadOptions:
    return WorkloadOptions(
        synthetic="poisson", rate=8.0, prompt_len="uniform:100,900", output_len="uniform:5,60", num_requests=n
    )


def test_setup_from_options_matches_the_command_line(capsys):
    """run_experiment on a Setup gives the figures of `stallfree simulate --json` with the same options."""
    setup = Setup(_synthetic(), LINEAR, {"max_seqs": 32})
    study = run_experiment(setup, budget=512, slo_ttft=0.5, slo_tpot=0.05)
    argv = ["simulate", "--synthetic", "poisson", "--rate", "8", "--prompt-len", "uniform:100,900",
            "--output-len", "uniform:5,60", "--num-requests", "120", "--linear-cost", "10,50",
            "--kv-tokens", "200000", "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--slo-ttft", "500ms",
            "--slo-tpot", "50ms", "--json"]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    mine = study.summaries[0]
    for key in ("completed", "p99_ttft_ms", "p99_tpot_ms", "request_goodput", "num_steps", "load"):
        assert mine[key] == run[key], key


def test_sweep_api_rows_in_grid_order():
    """sweep() runs one point per (mode, budget), in grid order, with the budgets asked for."""
    setup = Setup(_synthetic(), LINEAR, {"max_seqs": 32})
    grid = sweep(setup, [256, 1024], batching=["chunked", "no-chunk"], slo_ttft=0.5, slo_tpot=0.05)
    assert [(r["batching"], r["token_budget"]) for r in grid.table_rows] == [
        ("chunked", 256), ("chunked", 1024), ("no-chunk", 256), ("no-chunk", 1024)
    ]
    assert all(r["completed"] == 120 for r in grid.table_rows)
    assert grid.header["requests"] == 120


def test_setup_errors_name_the_option():
    """Contradicting options raise SetupError naming their fields (not flags), marked as a usage error;
    the commands word the same error in flags."""
    with pytest.raises(SetupError, match="^`trace` and `synthetic` are exclusive$") as exc:
        Setup(WorkloadOptions(trace="x.csv", synthetic="poisson"), LINEAR)
    assert exc.value.usage and exc.value.fields == ("trace", "synthetic")
    assert flag_message(exc.value) == "--trace and --synthetic are exclusive"
    with pytest.raises(SetupError) as exc:
        Setup(_synthetic(), LINEAR, {"cpu_kv_tokens": 4096})
    assert exc.value.fields == ("cpu_kv_tokens", "enable_prefix_caching", "kv_policy")
    assert flag_message(exc.value) == ("--cpu-kv-tokens: a CPU KV tier keeps prefix-cache blocks: add "
                                       "--enable-prefix-caching (and --kv-policy paged)")
    with pytest.warns(DeprecationWarning, match="Setup"):  # the former keyword form, for one release
        assert Setup(_synthetic(), LINEAR, max_seqs=32).scheduler_config.max_seqs == 32
    with pytest.raises(SetupError, match="nonexistent-gpu"):
        Setup(_synthetic(), HardwareOptions(gpu="nonexistent-gpu"))


def test_cost_model_errors_name_their_fields_as_options():
    """A cost-model error reaches Setup's caller with its fields named as options (`tp`,
    `gpu_memory_utilization`), which the commands word as their flags."""
    with pytest.raises(SetupError) as exc:
        Setup(_synthetic(), HardwareOptions(tp=3))
    assert str(exc.value) == "`tp` 3 does not divide the 64 attention heads of llama-3.3-70b; use a divisor of 64"
    assert flag_message(exc.value).startswith("--tp 3 does not divide the 64 attention heads")
    with pytest.raises(SetupError) as exc:
        Setup(_synthetic(), HardwareOptions(tp=1, dtype="int4", model="llama-3.3-70b", gpu_memory_utilization=0.4))
    assert exc.value.fields == ("tp", "gpu_memory_utilization")
    assert flag_message(exc.value).endswith("; raise --tp or use a higher --gpu-memory-utilization")


def test_flag_words_maps_fields_to_flags():
    """Backticked fields become flags, `field`=value becomes "--flag value", other text stays."""
    assert (flag_words("`linear_cost` and `kernels`='vllm' are exclusive")
            == "--linear-cost and --kernels vllm are exclusive")
    assert flag_words("`num_requests`=6,000,000 is more") == "--num-requests 6,000,000 is more"
    assert flag_words("`kv_offloading_gib`: x") == "--kv-offloading-size: x"
    assert flag_words("no fields, --as-is, `two words`") == "no fields, --as-is, `two words`"


def test_setup_error_names_the_field_and_the_cli_the_flag(capsys):
    """The library's SetupError says `linear_cost` and `kernels`='vllm'; `stallfree simulate` says
    --linear-cost and --kernels vllm, as typed."""
    with pytest.raises(SetupError, match=r"^`linear_cost` and `kernels`='vllm' are exclusive \(both price"):
        Setup(_synthetic(), HardwareOptions(linear_cost="10,50", kernels="vllm"))
    code = main(["simulate", "--synthetic", "poisson", "--num-requests", "5", "--linear-cost", "10,50",
                 "--kernels", "vllm", "--json"])
    assert code == 2
    assert "error: --linear-cost and --kernels vllm are exclusive (both price the steps)" in capsys.readouterr().err


def test_tune_api_reports_whether_the_slos_are_met():
    """tune() with a reachable SLO has slo_met True; with a TTFT objective below any prefill, False."""
    setup = Setup(_synthetic(), LINEAR, {"max_seqs": 32})
    ok = tune(setup.workload, setup.kv_tokens, setup.cost_model, 2.0, 0.1, max_seqs=32, budgets=[512])
    assert ok.slo_met and ok.best["request_goodput"] > 0
    # Every first token needs at least one 10 ms step: a 1 ms TTFT objective can never be met.
    none = tune(setup.workload, setup.kv_tokens, setup.cost_model, 0.001, 0.1, max_seqs=32, budgets=[512])
    assert not none.slo_met and none.best["slo_attainment"] == 0


def test_tune_command_exits_3_when_no_candidate_meets_the_slos(capsys):
    """`stallfree tune` with unreachable SLOs says so plainly, prints the best found with its
    attainment and no serve line, and exits 3; --json carries slo_met false and serve and vllm_serve null."""
    argv = ["tune", "--synthetic", "poisson", "--rate", "8", "--prompt-len", "uniform:100,900",
            "--output-len", "uniform:5,60", "--num-requests", "120", "--linear-cost", "10,50",
            "--kv-tokens", "200000", "--budgets", "256,512", "--max-seqs-candidates", "32",
            "--slo-ttft", "1ms", "--slo-tpot", "100ms", "--jobs", "1"]
    assert main(argv) == EXIT_NO_CANDIDATE_MEETS_SLO == 3
    out = capsys.readouterr().out
    assert "no candidate meets the SLOs" in out and "0.0% within the SLOs" in out
    assert "stallfree serve" not in out
    assert main([*argv, "--json"]) == 3
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["slo_met"] is False and report["serve"] is None and report["vllm_serve"] is None
    assert report["chosen"]["slo_attainment"] == 0
    assert "no candidate meets the SLOs" in captured.err


def test_tune_table_explains_the_tie_tolerance(capsys):
    """The candidates' table says which goodputs count as tied and what breaks the tie."""
    argv = ["tune", "--synthetic", "poisson", "--rate", "8", "--prompt-len", "uniform:100,900",
            "--output-len", "uniform:5,60", "--num-requests", "120", "--linear-cost", "10,50",
            "--kv-tokens", "200000", "--budgets", "512", "--max-seqs-candidates", "32",
            "--slo-ttft", "2s", "--slo-tpot", "100ms", "--jobs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "within 0.1% of the highest are tied" in out
    assert "serve it: vllm serve MODEL --tensor-parallel-size 4 --quantization fp8 --max-num-batched-tokens 512 " in out


def test_metric_units_and_goodput_by_hand(tmp_path, capsys):
    """Every latency is in ms and TPOT is each request's own (a serving simulator once reported mean E2E in s
    while the rest was in ms; a benchmark once averaged TPOT across requests before goodput).

    Hand-worked: steps cost 10 ms; two 4-token prompts arrive at 0 with outputs 3 and 1. Step 1 prefills
    both (both first tokens at 10 ms; the 1-token request ends), steps 2 and 3 decode the other (20, 30 ms).
    TTFT 10 and 10 ms; TPOT of the 3-token request (30 - 10) / 2 = 10 ms; E2E 30 and 10 ms (mean 20).
    SLOs TTFT 20 ms, TPOT 5 ms: the 3-token request misses TPOT, the 1-token one is judged on TTFT alone
    and meets it: 1 good request over 30 ms = 33.3 req/s, attainment 50%.
    """
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0.0,4,3\n0.0,4,1\n")
    argv = ["simulate", "--trace", str(trace), "--linear-cost", "10,0", "--kv-tokens", "100",
            "--max-num-batched-tokens", "16",
            "--max-num-seqs", "4", "--slo-ttft", "20ms", "--slo-tpot", "5ms", "--json"]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["mean_ttft_ms"] == pytest.approx(10.0)
    assert run["mean_tpot_ms"] == pytest.approx(10.0)
    assert run["median_tpot_ms"] == pytest.approx(10.0)
    assert run["mean_e2el_ms"] == pytest.approx(20.0)
    assert run["p99_e2el_ms"] == pytest.approx(29.8)
    assert run["request_goodput"] == pytest.approx(1 / 0.030)
    assert run["slo_attainment"] == pytest.approx(0.5)
