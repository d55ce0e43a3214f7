"""The `stallfree simulate` and `stallfree sweep` commands."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.sim.defaults import DEFAULT_RATE_SCALE


def test_simulate_json_header_and_runs(capsys):
    """simulate --json reports the rate scale, the utilisation and vLLM-named metrics."""
    argv = ["simulate", "--num-requests", "300", "--json", "--slo-ttft", "1s", "--slo-tpot", "50", "--kernels", "none"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["rate_scale"] == DEFAULT_RATE_SCALE
    assert out["header"]["requests"] == 300
    run = out["runs"][0]
    assert run["batching"] == "chunked"
    assert run["completed"] == 300
    assert 0 < run["load"] < 1
    for key in (
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "p99_e2el_ms",
        "request_goodput",
        "output_throughput",
    ):
        assert run[key] is not None, key


def test_simulate_json_names_what_priced_the_steps(capsys):
    """--kernels none: the header's cost_model says 'floor' (H100 has no calibration), chosen by --kernels."""
    argv = ["simulate", "--num-requests", "20", "--json", "--kernels", "none"]
    assert main(argv) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["cost_model"] == "floor"
    assert header["cost_model_source"]["kind"] == "floor" and header["cost_model_source"]["chosen_by"] == "--kernels"
    assert "steps priced by the floor" in header["hardware"]


def test_simulate_bad_kernels_is_a_usage_error(capsys):
    """An unknown --kernels engine is refused with the value named."""
    assert main(["simulate", "--num-requests", "5", "--kernels", "tgi"]) != 0
    assert "'tgi'" in capsys.readouterr().err


def test_simulate_linear_cost_and_kernels_are_exclusive(capsys):
    """--linear-cost with --kernels vllm is a usage error naming both."""
    assert main(["simulate", "--num-requests", "5", "--linear-cost", "5,50", "--kernels", "vllm"]) == 2
    assert "--linear-cost and --kernels vllm" in capsys.readouterr().err


@pytest.mark.slow
def test_simulate_compare_table_and_out_dir(tmp_path, capsys):
    """--compare prints the three modes side by side; --out writes records, steps and plots."""
    code = main(
        ["simulate", "--compare", "--num-requests", "200", "--max-tokens", "256", "--out", str(tmp_path)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert f"rate scale {DEFAULT_RATE_SCALE:g} " in text and "of capacity" in text
    assert "chunked/2048" in text and "prefill-first/2048" in text and "no-chunk/2048" in text
    names = ("summary.json", "requests-chunked-reserve.csv", "steps-no-chunk-reserve.csv", "cdf.png", "timeline.png")
    for name in names:
        assert (tmp_path / name).stat().st_size > 0, name
    header = (tmp_path / "requests-chunked-reserve.csv").read_text().splitlines()[0]
    assert header.startswith("rid,arrival_s,prompt_len,prompt_bucket,max_new,output_tokens,admitted_s,first_token_s")


def test_records_json(tmp_path):
    """--records FILE.json writes one record per request."""
    path = tmp_path / "r.json"
    assert main(["simulate", "--num-requests", "50", "--records", str(path), "--json"]) == 0
    rows = json.loads(path.read_text())
    assert len(rows) == 50
    assert rows[0]["ttft_ms"] > 0


def test_missing_trace_is_one_line(capsys):
    """A missing trace file is one line on stderr and exit status 2 (a command-line value that cannot
    be used, as validate --against's), naming the bundled traces."""
    assert main(["simulate", "--trace", "/nonexistent/t.csv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "error: --trace: trace file not found: /nonexistent/t.csv (the bundled traces: leave --trace out" in err
    assert "--trace mooncake)" in err


def test_bad_value_is_one_line(capsys):
    """A bad option value is one line on stderr and exit status 2."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--max-num-batched-tokens", "lots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--max-num-batched-tokens" in err and "lots" in err


def test_malformed_trace_stops_before_simulating(tmp_path, capsys):
    """A malformed row stops the run with file and line; --skip-bad-rows skips and reports it."""
    p = tmp_path / "t.csv"
    p.write_text("arrival_time,prompt_len,output_len\n0,10,5\n1,ten,5\n2,10,5\n")
    assert main(["simulate", "--trace", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}:3: prompt_len 'ten' is not an integer" in err
    assert main(["simulate", "--trace", str(p), "--skip-bad-rows"]) == 0
    assert "skipped 1 malformed rows" in capsys.readouterr().out


def test_synthetic_workload(capsys):
    """A synthetic Gamma workload runs and is labelled with its parameters."""
    argv = [
        "simulate",
        "--synthetic",
        "gamma",
        "--rate",
        "4",
        "--burstiness",
        "0.5",
        "--num-requests",
        "100",
        "--prompt-len",
        "uniform:10,500",
        "--output-len",
        "fixed:20",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["workload"].startswith("gamma(rate=4, burstiness=0.5")
    assert out["runs"][0]["total_output_tokens"] == 2000


def test_check_with_a_baseline_is_a_usage_error(capsys):
    """--check applies to the contract's scheduler only."""
    assert main(["simulate", "--check", "--batching", "prefill-first", "--num-requests", "10"]) == 2
    assert "--check" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_writes_rows_and_plots(tmp_path, capsys):
    """sweep runs one configuration per (mode, budget) and writes the CSV and both plots."""
    argv = [
        "sweep",
        "--budgets",
        "256,2048",
        "--batching",
        "chunked,prefill-first",
        "--num-requests",
        "150",
        "--jobs",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 5
    assert rows[0].startswith("batching,rate_scale,token_budget")
    assert (tmp_path / "tradeoff.png").stat().st_size > 0
    assert (tmp_path / "cdf.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["sweep", "--budgets", ","], "--budgets"),
        (["sweep", "--batching", ","], "--batching"),
        (["simulate", "--synthetic", "poisson", "--num-requests", "10", "--linear-cost", "nan,1"], "finite"),
        (["simulate", "--synthetic", "poisson", "--num-requests", "1000000000000"], "at most"),
        (["simulate", "--synthetic", "poisson", "--prompt-len", "lognormal:1e308,100"], "finite"),
        (["demo", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ],
    ids=["empty-budgets", "empty-modes", "nan-cost", "too-many", "overflowing-length", "demo-budget-0"],
)
def test_bad_values_are_one_line_errors(argv, needle, capsys):
    """Edge values found by fuzzing are refused with one line naming the problem, not a traceback or a hang."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code in (1, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


_SIM = ["simulate", "--num-requests", "10", "--linear-cost", "5,50"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-long-partial-prefills", "5", "--max-num-partial-prefills", "2"],
         "--max-long-partial-prefills 5 must be <= --max-num-partial-prefills 2"),
        (["--long-prefill-token-threshold", "256"], "--long-prefill-token-threshold 256 applies when"),
        (["--step-time-target", "0"], "--step-time-target: must be a duration > 0"),
        (["--disaggregate", "1:1", "--router", "nope"], "--router: invalid choice: 'nope'"),
        (["--affinity-load-factor", "-1"], "--affinity-load-factor -1: must be >= 1"),
        (["--replicas", "2", "--router", "prefix-affinity", "--affinity-load-margin", "-5"],
         "--affinity-load-margin -5: must be >= 0"),
        (["--prefix-affinity-threshold", "-1"], "--prefix-affinity-threshold -1: must be >= 0"),
        (["--replicas", "2", "--affinity-load-factor", "2"],
         "--affinity-load-factor applies to --router prefix-affinity"),
        (["--router-seed", "3"], "--router-seed applies to --router random"),
        (["--prompt-len", "fixed:abc"], "--prompt-len applies to synthetic load"),
        (["--prompt-len", "fixed:512"], "--prompt-len applies to synthetic load"),
        (["--output-len", "uniform:5"], "--output-len applies to synthetic load"),
        (["--rate", "5"], "--rate applies to synthetic arrivals"),
        (["--burstiness", "0.5"], "--burstiness applies to --synthetic gamma"),
        (["--synthetic", "poisson", "--burstiness", "0.5"], "--burstiness applies to --synthetic gamma"),
        (["--synthetic", "shared-prefix", "--shared-prefix", "2,2,8,4", "--prompt-len", "fixed:9"],
         "--prompt-len applies to synthetic load"),
        (["--concurrency", "2", "--trace", "mooncake", "--output-len", "fixed:9"],
         "--output-len applies to synthetic load"),
        (["--prefill-tp", "2"], "--prefill-tp applies to --disaggregate"),
        (["--decode-budget", "64"], "--decode-budget applies to --disaggregate"),
        (["--interconnect", "nvlink"], "--interconnect applies to --disaggregate"),
        (["--link-latency", "5"], "--link-latency applies to --disaggregate"),
        (["--disaggregate", "1:1", "--link-bandwidth", "-5"], "--link-bandwidth -5: must be a number of GB/s > 0"),
        (["--disaggregate", "1:1", "--link-latency", "-1"], "--link-latency -1: must be a number of us >= 0"),
        (["--disaggregate", "1:1", "--kv-policy", "paged", "--enable-prefix-caching"],
         "--disaggregate does not take --enable-prefix-caching"),
        (["--disaggregate", "1:1", "--max-num-partial-prefills", "2", "--long-prefill-token-threshold", "100"],
         "--disaggregate does not take --max-num-partial-prefills"),
        (["--ep", "2"], "error: --ep 2: llama-3.3-70b has no experts; expert parallelism and data-parallel "
                        "attention are for MoE models"),
        (["--dp-attention", "2"], "error: --dp-attention 2: llama-3.3-70b has no experts"),
    ],
)
def test_simulate_usage_errors_name_the_flag_as_typed(argv, needle, capsys, tmp_path):
    """Contradictory, out-of-range or ignored flags: exit 2, one line naming the flag (values as typed), and
    nothing written, not even the --out directory."""
    out = tmp_path / "out"
    try:
        code = main([*_SIM, *argv, "--out", str(out)])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not out.exists()


def test_disaggregate_search_with_out_creates_nothing(capsys, tmp_path):
    """--disaggregate search refuses --out before creating the directory."""
    out = tmp_path / "out"
    assert main([*_SIM, "--disaggregate", "search", "--replicas", "2", "--out", str(out)]) == 2
    assert "--records and --out write one run" in capsys.readouterr().err
    assert not out.exists()


def test_unknown_model_is_a_usage_error_naming_it(capsys):
    """A model name typo is an option's value: exit 2 with the name, as `stallfree budget` answers it."""
    assert main(["simulate", "--num-requests", "5", "--model", "llama-3.3-70", "--kernels", "none"]) == 2
    assert "'llama-3.3-70'" in capsys.readouterr().err
    assert main(["budget", "--model", "llama-3.3-70"]) == 2


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"arrival_time,prompt_len,output_len\n0,abc,5\n", "prompt_len"),
        (b"arrival_time,prompt_len,output_len\n0,-3,5\n", "prompt_len"),
        (b"arrival_time,prompt_len,output_len\nnan,10,5\n", "arrival_time"),
        (b"", "t.csv"),
        (b"arrival_time,prompt_len,output_len\n0,10,5\xff\xfe\n", "cannot read trace"),
    ],
    ids=["abc", "negative", "nan", "empty", "not-utf8"],
)
def test_malformed_trace_contents_exit_2(tmp_path, capsys, body, said):
    """Bad contents of a trace that exists are an input error: one line, exit 2 (the commands' rule: 2 for
    any input error, 1 for a failure while running; docs/simulator.md)."""
    path = tmp_path / "t.csv"
    path.write_bytes(body)
    assert main(["simulate", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert said in err


def test_prefix_block_size_at_odds_with_the_trace_is_usage(capsys):
    """--block-size 7 does not divide Mooncake's 512-token hash blocks: a flag conflict, exit 2, before
    any run (with --compare-caching too, not after the caching-off run)."""
    for caching in ("--enable-prefix-caching", "--compare-caching"):
        argv = ["simulate", "--trace", "mooncake", "--kv-policy", "paged", caching, "--block-size", "7",
                "--num-requests", "10", "--kernels", "none"]
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.strip() == ("stallfree simulate: error: --block-size 7 must divide the trace's "
                                        "prefix block of 512 tokens (its hash_ids; a power of two up to 512)")


@pytest.mark.parametrize("flag", ["--slo-ttft", "--slo-tpot"])
@pytest.mark.parametrize("value", ["0", "0ms", "-1"])
def test_zero_or_negative_slo_is_refused(capsys, flag, value):
    """An SLO of 0 (nothing can meet it) or below is a usage error, one line, before any search."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", flag + "=" + value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


def test_tiny_slo_warns_how_it_was_read():
    """--slo-ttft 1 is 1 ms (bare = ms): kept, with one warning saying how to write seconds; 10 ms and
    1 ms (the thresholds), 1s, and any value written with its unit pass silently."""
    import contextlib
    import io

    from stallfree.sim.commands.common import slo_tpot, slo_ttft

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert slo_ttft("1") == pytest.approx(0.001)
        assert slo_tpot("0.5") == pytest.approx(0.0005)
    assert err.getvalue().splitlines() == [
        "warning: --slo-ttft 1 is read as 1 ms (a bare number is ms); write 1s for seconds",
        "warning: --slo-tpot 0.5 is read as 0.5 ms (a bare number is ms); write 0.5s for seconds",
    ]
    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet):
        assert slo_ttft("10") == pytest.approx(0.010)
        assert slo_tpot("1ms") == pytest.approx(0.001)
        assert slo_ttft("1s") == 1.0
        assert slo_ttft("1ms") == pytest.approx(0.001)  # a unit given: read as written, no warning
        assert slo_tpot("0.5ms") == pytest.approx(0.0005)
    assert quiet.getvalue() == ""


def test_out_dir_is_not_left_behind_by_a_failed_or_interrupted_run(tmp_path, capsys, monkeypatch):
    """simulate --out DIR creates DIR only when it writes the first file: a bad trace (exit 2) or a
    Ctrl-C during the run (exit 130) leaves no empty DIR, nor the missing parents it checked."""
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    out = tmp_path / "new" / "o1"
    assert main(["simulate", "--trace", str(bad), "--out", str(out)]) == 2
    assert "unrecognised header" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()

    import stallfree.sim.commands.simulate as simulate_cmd

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate_cmd, "run_experiment", interrupted)
    assert main([*_SIM, "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert not (tmp_path / "new").exists()


def test_out_dir_check_keeps_an_existing_dir_and_refuses_a_file(tmp_path):
    """The --out check leaves a directory that was there (and its files) and names a file in the way."""
    from stallfree.sim.commands.common import CliError, ensure_writable_dir

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "x").write_text("1")
    ensure_writable_dir(kept, "--out")
    assert sorted(p.name for p in kept.iterdir()) == ["x"]
    with pytest.raises(CliError, match=r"--out .*x/y: cannot write there"):
        ensure_writable_dir(kept / "x" / "y", "--out")
    assert sorted(p.name for p in kept.iterdir()) == ["x"]


def test_sweep_refuses_a_value_given_twice(capsys):
    """sweep --budgets 1k,1000 would run the same budget twice (two spellings of one value; the same text
    twice is refused as it is parsed): refused naming the value, exit 2."""
    assert main(["sweep", "--budgets", "1k,1000", "--num-requests", "10", "--kernels", "none"]) == 2
    assert capsys.readouterr().err == ("stallfree sweep: error: --budgets 1000,1000: 1000 is given twice; "
                                       "give each value once\n")


def test_sweep_error_has_no_blank_line_before_it(capsys, monkeypatch):
    """An error raised while the progress bar runs is the first line on stderr (the bar is off when
    stderr is not a terminal, so it leaves no blank line)."""
    import stallfree.sim.commands.sweep as sweep_cmd

    def failing(*_a: object, **_k: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(sweep_cmd, "sweep", failing)
    assert main(["sweep", "--budgets", "512", "--num-requests", "10", "--kernels", "none"]) == 1
    assert capsys.readouterr().err == "stallfree sweep: error: boom\n"


def test_plan_answer_line_counts_one_replica_in_the_singular():
    """The answer line says "1 replica reaches", not "1 replicas reach"."""
    from types import SimpleNamespace

    from stallfree.sim.commands.plan import answer_line

    row = {"kind": "aggregated", "replicas": 2, "num_gpus": 8, "attainment": 0.9991, "router": "least-outstanding"}
    below = {"kind": "aggregated", "replicas": 1, "num_gpus": 4, "attainment": 0.7542, "router": "none"}
    result = SimpleNamespace(attainment=0.99, replicas=2, rows=[row, below], answer_row=row,
                             router="least-outstanding", disagg_tried=True, disaggregated=None, gpus_per_replica=4)
    line = answer_line(result, SimpleNamespace(slo_ttft=1.0, slo_tpot=0.05))  # type: ignore[arg-type]
    assert "; 1 replica reaches 75.42% (none). " in line
    assert line.endswith("Disaggregation cannot beat it on fewer GPUs: 1 replica cannot be split into prefill "
                         "and decode.")


def test_sweep_table_explains_a_budget_use_above_100_percent(capsys):
    """A prefill-first row using 115% of its budget gets the caption that says why; 60% gets none."""
    from stallfree.sim.commands.sweep import print_rows

    row = {"batching": "prefill-first", "rate_scale": 1.0, "token_budget": 256, "budget_utilization": 1.15}
    print_rows([row])
    out = capsys.readouterr().out
    assert "115%" in out and "budget use: mean tokens per step / budget; above 100% where prefill-first" in out
    print_rows([{**row, "budget_utilization": 0.6}])
    assert "budget use:" not in capsys.readouterr().out


def test_tables_write_a_light_load_with_two_significant_digits(capsys):
    """sweep's table and simulate's write requests/s and goodput as the reports do (wording.rate_text): 0.0035
    req/s keeps two significant digits where two decimals said 0.00; 6.6 stays 6.60."""
    from stallfree.sim.commands.sweep import print_rows
    from stallfree.sim.outputs.table import print_table

    row = {"batching": "chunked", "rate_scale": 1.0, "token_budget": 512, "request_throughput": 0.00351,
           "request_goodput": 0.00349, "budget_utilization": 0.03}
    print_rows([row, {**row, "batching": "no-chunk", "request_throughput": 6.6, "request_goodput": 6.6}])
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in capsys.readouterr().out.splitlines()
             if line.startswith("│")]
    assert [c[3:5] for c in cells] == [["0.0035", "0.0035"], ["6.60", "6.60"]]
    print_table([{"label": "light", "request_throughput": 0.00351, "request_goodput": 0.00349,
                  "slo_attainment": 1.0}])
    rows = {c[0]: c[1] for c in ([x.strip() for x in line.split("│")[1:-1]]
                                 for line in capsys.readouterr().out.splitlines() if line.startswith("│"))}
    assert (rows["requests/s"], rows["goodput (req/s)"]) == ("0.0035", "0.0035")


@pytest.mark.parametrize("command", [
    ["sweep", "--budgets", "512", "--jobs", "1"],
    ["tune", "--slo-ttft", "1s", "--slo-tpot", "50ms"],
    ["plan", "--slo-ttft", "1s"],
])
@pytest.mark.parametrize("flag", [["--prompt-len", "fixed:abc"], ["--output-len", "fixed:5"], ["--rate", "5"],
                                  ["--burstiness", "0.5"]])
def test_synthetic_flags_on_a_trace_replay_are_refused(command, flag, capsys):
    """sweep, tune and plan share the workload flags: a synthetic-only one on a trace replay, where it would
    be ignored, exits 2 naming it, before anything runs."""
    assert main([*command, "--num-requests", "10", "--linear-cost", "5,50", *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag[0]} applies to " in err[0] and "--synthetic" in err[0]


def test_num_requests_still_cuts_a_trace(capsys):
    """--num-requests is not synthetic-only: it keeps the first N requests of a trace."""
    assert main(["simulate", "--num-requests", "7", "--linear-cost", "5,50", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["header"]["requests"] == 7


_TRACE = "arrival_time,prompt_len,output_len\n0,10,5\n0.1,20,3\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["simulate", "--trace", "{t}", "--records", "{t}"], "--records {t}: is the --trace file"),
        (["simulate", "--trace", "{t}", "--records", "{d}/sub/../trace.csv"], "is the --trace file"),
        (["simulate", "--trace", "{d}/steps-x.csv", "--out", "{d}"], "would overwrite the --trace file"),
        (["sweep", "--trace", "{d}/sweep.csv", "--budgets", "512", "--jobs", "1", "--out", "{d}"],
         "would overwrite the --trace file"),
        (["tune", "--trace", "{d}/tune.json", "--trace-format", "csv", "--slo-ttft", "1s", "--slo-tpot", "50ms",
          "--out", "{d}"], "would overwrite the --trace file"),
    ],
    ids=["records", "records-other-spelling", "simulate-out", "sweep-out", "tune-out"],
)
def test_an_output_path_that_is_the_trace_is_refused(argv, needle, tmp_path, capsys):
    """An output flag that resolves to the --trace file exits 2 naming the flag, and the trace is left as it was."""
    for name in ("trace.csv", "steps-x.csv", "sweep.csv", "tune.json"):
        (tmp_path / name).write_text(_TRACE)
    fill = {"t": str(tmp_path / "trace.csv"), "d": str(tmp_path)}
    assert main([a.format(**fill) for a in argv] + ["--linear-cost", "5,50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.format(**fill) in err[0]
    assert all((tmp_path / n).read_text() == _TRACE for n in ("trace.csv", "steps-x.csv", "sweep.csv", "tune.json"))


def test_out_beside_the_trace_is_allowed(tmp_path, capsys):
    """A trace in the --out directory under a name the command does not write is kept and read."""
    trace = tmp_path / "trace.csv"
    trace.write_text(_TRACE)
    assert main(["simulate", "--trace", str(trace), "--out", str(tmp_path), "--linear-cost", "5,50"]) == 0
    assert trace.read_text() == _TRACE and (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("r.csv.gz", "the file name must end in .csv or .json (the format it is written in), got '.gz'"),
        ("r.txt", "got '.txt'"),
        ("r", "got 'no suffix'"),
        ("a" * 300 + ".csv", "cannot be written (File name too long)"),
        ("missing/r.csv", "the directory"),
    ],
    ids=["gz", "txt", "no-suffix", "too-long", "no-dir"],
)
def test_records_path_is_checked_before_the_run(name, needle, tmp_path, capsys):
    """--records is refused before anything runs (exit 2, one line naming the flag) when its name does not
    end in the format it is written in or the file cannot be opened; the check leaves no file behind."""
    argv = ["simulate", "--num-requests", "5", "--linear-cost", "5,50", "--records", str(tmp_path / name)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--records" in err and needle in err
    assert list(tmp_path.iterdir()) == []


def test_records_check_leaves_an_existing_file_as_it_was(tmp_path):
    """The writability check opens an existing file for appending and writes nothing: it stays byte for byte
    (and a new name is not left behind)."""
    from stallfree.sim.commands.common import ensure_writable_file

    rec = tmp_path / "r.csv"
    rec.write_text("kept\n")
    ensure_writable_file(rec, "--records")
    ensure_writable_file(tmp_path / "new.json", "--records")
    assert rec.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--trace", "{t}", "--start", "5", "--end", "1"],
         "--start 5 and --end 1: a time window needs 0 <= start < end"),
        (["--trace", "{t}", "--start", "-1"], "--start -1 and --end inf: a time window needs"),
        (["--trace", "{t}", "--start", "nan"], "--start nan"),
        (["--trace", "{t}", "--start", "100"], "no request arrives in the window --start 100 to --end inf s "
                                               "(the trace's arrivals: 0 to 0.1 s)"),
        (["--synthetic", "poisson", "--start", "5", "--end", "6"],
         "--start and --end cut a trace's time window; --synthetic poisson draws its own arrivals"),
        (["--synthetic", "shared-prefix", "--shared-prefix", "0,3,100,50"], "--shared-prefix '0,3,100,50': needs"),
        (["--synthetic", "shared-prefix", "--shared-prefix", "a,b"], "--shared-prefix wants GROUPS,PROMPTS"),
    ],
    ids=["reversed", "negative", "nan", "past-the-trace", "synthetic", "shared-prefix-zero", "shared-prefix-text"],
)
def test_workload_flag_errors_are_usage_errors(flags, needle, tmp_path, capsys):
    """A time window that is empty or reversed, one given to a synthetic workload (which has no trace time),
    and a malformed --shared-prefix are input errors: exit 2, one line naming the flags, nothing run."""
    trace = tmp_path / "t.csv"
    trace.write_text(_TRACE)
    argv = ["simulate", "--linear-cost", "5,50", *(f.format(t=trace) for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--synthetic", "poisson", "--prompt-len", "trace:{d}/missing.csv"],
         "--prompt-len trace:{d}/missing.csv: trace file not found"),
        (["--synthetic", "poisson", "--output-len", "trace:{d}"], "--output-len trace:{d}: trace {d} is a directory"),
        (["--trace", "/dev/null"], "--trace: trace /dev/null is not a regular file (a device, pipe or socket)"),
        (["--trace", ""], "--trace '': give a trace file, or leave it out"),
        (["--trace", "{t}", "--trace-format", "mooncake"], "{t}:1: not a mooncake trace (one JSON object per line"),
        (["--trace", "{t}", "--trace-format", "sessions"], "{t}:1: not a session trace (one JSON object per line"),
    ],
    ids=["prompt-len-trace-missing", "output-len-trace-dir", "dev-null", "empty", "mooncake-on-csv",
         "sessions-on-csv"],
)
def test_trace_file_errors_name_the_right_flag(flags, needle, tmp_path, capsys):
    """A length trace (trace:PATH) that cannot be read is named as its flag, not as --trace; a path that is
    not a regular file is not called missing; an empty --trace is refused (not the bundled trace); a CSV
    read as a JSONL format says which format it is not. All exit 2 in one line."""
    trace = tmp_path / "t.csv"
    trace.write_text(_TRACE)
    fill = {"t": str(trace), "d": str(tmp_path)}
    assert main(["simulate", "--linear-cost", "5,50", *(f.format(**fill) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle.format(**fill) in err, err


def test_budget_use_above_100_percent_is_explained(tmp_path, capsys):
    """no-chunk runs a 40-token prompt whole under a 16-token budget: the step holds 40 tokens, 250% of the
    budget (then 1-token decodes), and the header line says why it passes 100%; chunked never does."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,40,1\n")
    base = ["simulate", "--trace", str(trace), "--linear-cost", "5,50", "--max-num-batched-tokens", "16"]
    assert main([*base, "--batching", "no-chunk"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "token budget used" in ln)
    assert line.endswith("250% of the token budget used (above 100%: this batching runs a whole prompt longer "
                         "than the budget in one step)")
    assert main(base) == 0
    assert "above 100%" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--seed", "4"], "--seed applies to what a run draws: synthetic load (add --synthetic or --concurrency N) "
                          "or --loras' adapters, or drop --seed (a trace replay has its own arrivals and lengths)"),
        (["--max-num-partial-prefills", "4", "--batching", "no-chunk"],
         "--max-num-partial-prefills applies to chunked batching (a prompt prefilled in chunks); --batching "
         "no-chunk prefills whole prompts"),
    ],
    ids=["seed-on-a-trace", "partial-prefills-whole-prompts"],
)
def test_flags_that_would_be_ignored_are_refused(flags, needle, capsys):
    """A flag nothing in the run would read is refused in one line (exit 2), never silently ignored."""
    assert main(["simulate", "--num-requests", "5", "--linear-cost", "5,50", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_seed_is_taken_where_something_is_drawn(capsys):
    """--seed with synthetic load, or with --loras on a trace (the adapters are drawn), runs."""
    assert main(["simulate", "--num-requests", "5", "--linear-cost", "5,50", "--seed", "4", "--synthetic",
                 "poisson", "--json"]) == 0
    assert main(["simulate", "--num-requests", "5", "--linear-cost", "5,50", "--seed", "4", "--loras", "2",
                 "--json"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["sweep", "--budgets", "512,,1024"], "argument --budgets: an empty item in '512,,1024'"),
        (["sweep", "--rate-scales", "1,"], "argument --rate-scales: an empty item in '1,'"),
        (["tune", "--budgets", "512,512", "--slo-ttft", "1s"], "argument --budgets: '512' is given twice"),
        (["tune", "--max-seqs-candidates", "128,128", "--slo-ttft", "1s"],
         "argument --max-seqs-candidates: '128' is given twice"),
        (["sweep", "--batching", "chunked,chunked"], "argument --batching: 'chunked' is given twice"),
        (["plan", "--routers", "round-robin,round-robin", "--slo-ttft", "1s"],
         "--routers: 'round-robin' is given twice in 'round-robin,round-robin'"),
        (["plan", "--gpu", "h100,,h200", "--slo-ttft", "1s"], "--gpu: an empty item in 'h100,,h200'"),
    ],
    ids=["sweep-empty", "sweep-trailing", "tune-budgets-twice", "tune-seqs-twice", "sweep-batching-twice",
         "plan-routers-twice", "plan-gpu-empty"],
)
def test_list_flags_refuse_empty_and_repeated_items(argv, needle, capsys):
    """Every comma-separated list flag reads its items one way: an empty item or one given twice is refused in
    one line (exit 2), not dropped or run twice."""
    code = None
    try:
        code = main([*argv, "--linear-cost", "5,50", "--num-requests", "5"])
    except SystemExit as exc:  # argparse's own error for a type that refuses the value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_jobs_above_one_with_the_serial_executor_is_refused(capsys):
    """--executor serial runs every simulation in this process, so --jobs 4 would be read by nothing: refused in
    one line (exit 2); --jobs 1 with it is what it does anyway, and runs."""
    base = ["sweep", "--executor", "serial", "--linear-cost", "5,50", "--num-requests", "5", "--budgets", "512"]
    assert main([*base, "--jobs", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--jobs 4 sizes a pool of worker processes; --executor serial" in err
    assert main([*base, "--jobs", "1"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--router", "random"], "--router random: a router chooses between replicas and --replicas 1 runs one "
                                 "replica: add --replicas N (N >= 2) or drop --router"),
        (["--router", "random", "--router-seed", "3"], "--router random: a router chooses between replicas"),
        (["--router", "prefix-affinity", "--prefix-affinity-threshold", "64"],
         "--router prefix-affinity: a router chooses between replicas"),
        (["--autoscale", "0:1", "--router", "round-robin"],
         "--router round-robin: a router chooses between replicas and --autoscale 0:1 runs at most one replica: "
         "raise its MAX or drop --router"),
    ],
    ids=["replicas-1", "with-router-seed", "with-affinity-flag", "autoscale-max-1"],
)
def test_a_router_with_one_replica_is_refused(flags, needle, capsys):
    """A router named for a run of one replica would route every request to it, reading nothing (it only
    relabelled the run "x1 random"): refused in one line (exit 2), as the router's own flags are."""
    assert main(["simulate", "--num-requests", "5", "--linear-cost", "5,50", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_router_with_several_replicas_and_plan_routers_with_one(capsys, tmp_path):
    """--router with two replicas still runs (5 requests served, labelled by the router); plan refuses a
    --routers list when --max-replicas 1 tries one replica, and plans that replica without it."""
    assert main(["simulate", "--num-requests", "5", "--linear-cost", "5,50", "--replicas", "2", "--router",
                 "random", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["completed"] == 5 and run["label"].endswith("x2 random")
    plan = ["plan", "--num-requests", "5", "--linear-cost", "5,50", "--slo-ttft", "1s", "--executor", "serial",
            "--max-replicas", "1"]
    assert main([*plan, "--routers", "random,round-robin"]) == 2
    assert capsys.readouterr().err.strip() == (
        "stallfree plan: error: --routers 'random,round-robin': a router chooses between replicas and "
        "--max-replicas 1 tries one replica: raise --max-replicas or drop --routers")
    assert main([*plan, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["answer"]["replicas"] == 1


def test_simulate_header_writes_a_light_rate_with_two_significant_digits(tmp_path, capsys):
    """Three requests 600 s apart are offered 2 / 1,200 = 0.0017 req/s, not "0.00"; in a closed loop of
    one client thinking 1,000 s after each one-second answer, they finish at 1, 1,002 and 2,003 s: achieved
    3 / 2,003 = 0.0015 req/s. Rates of 0.1 req/s and above keep two decimals (test_fleet)."""
    trace = tmp_path / "light.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n600,10,1\n1200,10,1\n")
    assert main(["simulate", "--trace", str(trace), "--linear-cost", "1000,0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "light.csv: 3 requests, rate scale 1 (0.0017 req/s offered)"
    assert main(["simulate", "--trace", str(trace), "--linear-cost", "1000,0", "--concurrency", "1",
                 "--think-time", "1000s"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.startswith("chunked/2048: achieved 0.0015 req/s; utilization")


def test_simulate_header_writes_a_share_that_rounds_to_0_as_under_1_percent(tmp_path, capsys):
    """Three requests 600 s apart offer 0.0017 req/s to a replica that sustains about 200 req/s saturated, and
    each one-second step holds one 10-token prompt of the 2,048-token budget (0.49%): the header says "under 1%"
    for both, as plan's why line does (it said 0%), and no request ever waits, which stays 0%."""
    trace = tmp_path / "light.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n600,10,1\n1200,10,1\n")
    assert main(["simulate", "--trace", str(trace), "--linear-cost", "1000,0"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.startswith("chunked/2048: utilization under 1% of capacity (~")
    assert line.endswith(" req/s when saturated); requests were left waiting after 0% of the steps; under 1% of the "
                         "token budget used")
