"""The top-level command line: one-line usage errors, and a named extra when a dependency is missing."""

from __future__ import annotations

import logging
import sys

import pytest

from stallfree.cli import main


def test_unknown_command_is_one_line_exit_2(capsys):
    """An unknown command prints one error line naming it and exits 2."""
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nonsense" in err[0]


def test_missing_library_at_run_time_names_the_extra(monkeypatch, capsys):
    """`simulate` without numpy (the sim extra) says which extra to install instead of a traceback."""
    for name in [m for m in sys.modules if m == "numpy" or m.startswith("numpy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "numpy", None)
    assert main(["simulate", "--num-requests", "20"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'stallfree[sim]'" in err and "numpy" in err


def test_missing_library_at_import_keeps_the_command(monkeypatch, capsys):
    """Without fastapi (the server extra), `serve` still exists and explains what to install."""
    for name in [m for m in sys.modules if m.startswith(("stallfree.server", "fastapi"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    root = logging.getLogger()
    filters = [list(h.filters) for h in root.handlers]
    assert main(["serve", "--port", "1"]) == 1
    assert "pip install 'stallfree[server]'" in capsys.readouterr().err
    # A serve that cannot start leaves the process's logging as it was: a filter added here would read a second
    # copy of the request-id context (the server's modules are imported afresh above), and later server tests
    # in the process would log under it.
    assert [list(h.filters) for h in root.handlers] == filters


def test_every_input_error_exits_2_in_every_command(tmp_path, capsys):
    """One rule: a missing input file, malformed contents and a bad flag are all input errors, exit 2, one
    line, in calibrate and validate as in simulate (docs/install.md, "Exit codes")."""
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    missing = str(tmp_path / "missing.csv")
    cal = ["calibrate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--csv"]
    cases = [
        ([*cal, missing], 2, "No such file or directory"),
        ([*cal, str(bad)], 2, "missing column 'num_tokens'"),
        (["validate", "--against", missing], 2, "no such file or folder"),
        (["validate", "--against", str(bad)], 2, "not a run folder"),
        (["simulate", "--trace", missing], 2, "missing.csv"),
        (["simulate", "--trace", str(bad)], 2, "unrecognised header"),
        (["simulate", "--concurrency", "2", "--prompt-len", "fixed:abc", "--kernels", "none"], 2,
         "--prompt-len: bad length distribution 'fixed:abc'"),
    ]
    for argv, code, said in cases:
        assert main(argv) == code, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (argv, err)


def test_version_and_an_unknown_flag_named_by_its_subcommand(capsys):
    """`stallfree --version` prints the package version; an unknown flag of a subcommand points at that
    subcommand's --help."""
    import stallfree

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    from stallfree._native import compiled

    built = "yes" if compiled() else "no"
    assert capsys.readouterr().out == f"stallfree {stallfree.__version__} (compiled: {built})\n"
    with pytest.raises(SystemExit) as exc:
        main(["specs", "--bogus-flag"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("stallfree specs: error: unrecognized arguments: --bogus-flag "
                                       "(see stallfree specs --help)\n")


def test_a_closed_pipe_is_not_reported_as_an_error(capsys):
    """`stallfree simulate | head`: the reader going away is no failure of the command. The commands' guard
    passes BrokenPipeError on, silent, to main, which stops quietly."""
    import argparse

    from stallfree.sim.commands.common import guard

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        guard(closed)(argparse.Namespace(command="simulate"))
    assert capsys.readouterr().err == ""


# (command, flag, value typed, the range it misses): the error reads "argument FLAG: RANGE, got 'VALUE'".
@pytest.mark.parametrize(
    ("command", "flag", "value", "expected"),
    [
        ("budget", "--overhead-ms", "-1", "expected a number >= 0"),
        ("budget", "--allreduce-latency-us", "nan", "expected a finite number"),
        ("budget", "--per-token-us", "inf", "expected a finite number"),
        ("budget", "--mfu", "1.5", "expected a number in (0, 1]"),
        ("budget", "--link-util", "0", "expected a number in (0, 1]"),
        ("budget", "--tp", "0", "expected an integer >= 1"),
        ("budget", "--pp", "-2", "expected an integer >= 1"),
        ("budget", "--gpu-memory-utilization", "2", "expected a number in (0, 1]"),
        ("calibrate", "--kernel-launch-us", "-5", "expected a number >= 0"),
        ("simulate", "--gpu-memory-utilization", "1.5", "expected a number in (0, 1]"),
        ("sweep", "--gpu-memory-utilization", "1.01", "expected a number in (0, 1]"),
        ("validate", "--gpu-memory-utilization", "3", "expected a number in (0, 1]"),
        ("validate", "--num-requests", "3", "expected an integer >= 4"),
        ("validate", "--load", "200", "expected a number in (0, 100]"),
        ("validate", "--prompt-scale", "nan", "expected a finite number"),
        ("validate", "--output-scale", "-1", "expected a number in (0, 100]"),
        ("validate", "--threads", "0", "expected an integer >= 1"),
        ("validate", "--kv-tokens", "-1", "expected an integer >= 1"),
        ("validate", "--max-prompt", "0", "expected an integer >= 1"),
        ("validate", "--tp", "0", "expected an integer >= 1"),
        ("simulate", "--peak-ratio", "-1", "expected a number >= 1"),
        ("plan", "--peak-ratio", "0.50", "expected a number >= 1"),
        ("sweep", "--peak-ratio", "1e400", "expected a finite number"),
        ("tune", "--peak-hour", "25", "expected a number in [0, 24]"),
        ("simulate", "--peak-hour", "-0.5", "expected a number in [0, 24]"),
        # max_seqs counts sequences, not tokens; an SLO of 0 is refused as a negative one is (not ">= 0").
        ("tune", "--max-seqs-candidates", "0", "expected an integer >= 1"),
        ("tune", "--max-seqs-candidates", "1k", "expected an integer >= 1"),
        ("simulate", "--slo-ttft", "-1ms", "must be a duration > 0 (50ms, 1s; bare = ms)"),
        ("simulate", "--slo-tpot", "nan", "must be a duration > 0 (50ms, 1s; bare = ms)"),
        ("plan", "--slo-ttft", "0", "must be a duration > 0 (50ms, 1s; bare = ms)"),
        ("simulate", "--max-queue-time", "-5", "must be a duration > 0 (50ms, 1s; bare = ms)"),
        ("simulate", "--replicas", "100000", "expected an integer in [1, 4096]"),
        ("simulate", "--replicas", "0", "expected an integer in [1, 4096]"),
        ("plan", "--max-replicas", "4097", "expected an integer in [1, 4096]"),
        ("sweep", "--jobs", "100000", "expected an integer in [1, 1024]"),
        ("tune", "--jobs", "0", "expected an integer in [1, 1024]"),
        ("plan", "--jobs", "1025", "expected an integer in [1, 1024]"),
    ],
)
def test_a_bad_number_is_named_by_its_flag_while_parsing(command, flag, value, expected, capsys):
    """A number out of range is refused while the command line is parsed (exit 2, before a model is
    loaded or an engine started), in the flag's name and the words typed, not in the library's field name
    and a converted value ("overhead_s ... got -0.001")."""
    with pytest.raises(SystemExit) as exc:
        main([command, flag, value])
    assert exc.value.code == 2
    said = f"argument {flag}: {expected}, got '{value}'"
    assert capsys.readouterr().err == f"stallfree {command}: error: {said} (see stallfree {command} --help)\n"


@pytest.mark.parametrize(
    "command",
    [["simulate", "--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none", "--no-range"],
     ["sweep"], ["tune"], ["plan"], ["validate"], ["bench", "engine"]],
    ids=lambda c: c[0] if c[0] != "bench" else "bench-engine",
)
@pytest.mark.parametrize("value", ["", " "], ids=["empty", "blank"])
def test_an_empty_out_is_refused_and_writes_nothing(command, value, tmp_path, monkeypatch, capsys):
    """`--out ''` (an unset shell variable) is refused while parsing, exit 2, on every command that has
    --out; it was read as the current directory and a run wrote its files there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*command, "--out", value])
    assert exc.value.code == 2
    name = " ".join(command[:2] if command[0] == "bench" else command[:1])
    said = f"argument --out: expected a directory, got {value!r} (give . for the current directory)"
    assert capsys.readouterr().err == f"stallfree {name}: error: {said} (see stallfree {name} --help)\n"
    assert list(tmp_path.iterdir()) == []


A100_FP8 = ("a100-sxm-80gb has no fp8 units: fp8 weights are priced at the bf16 peak (dequantized to 16 bits "
            "before the GEMM)")


@pytest.mark.filterwarnings("default")  # as Python runs the command line (the tests make warnings errors)
def test_a_cost_model_warning_is_one_line_in_the_simulator(capsys):
    """`simulate --gpu a100` (fp8 weights on a GPU without fp8 units) warns in one 'warning: ...' line, like
    the command's other warnings: not Python's 'path:line: CostModelWarning: ...' and the source line."""
    assert main(["simulate", "--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none",
                 "--no-range", "--gpu", "a100"]) == 0
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if "fp8 units" in x] == [f"warning: {A100_FP8}"]
    assert "CostModelWarning" not in err and ".py:" not in err


def test_a_cost_model_command_says_each_warning_once(capsys):
    """`budget` records its warnings and says each once (it printed the fp8 one three times)."""
    assert main(["budget", "--gpu", "a100", "--model", "llama-3.1-8b"]) == 0
    assert [x for x in capsys.readouterr().err.splitlines() if "warning" in x] == [
        f"stallfree budget: warning: {A100_FP8}"]


@pytest.mark.filterwarnings("default")
def test_a_warning_from_outside_stallfree_keeps_pythons_form(capsys):
    """Another library's warning keeps Python's own lines (where it was raised helps its reader)."""
    import warnings

    from stallfree import cli

    cli._show_warning(UserWarning("elsewhere"), UserWarning, "/other/lib.py", 3)
    assert capsys.readouterr().err == "/other/lib.py:3: UserWarning: elsewhere\n"
    assert warnings.showwarning is not cli._show_warning


def test_the_bounds_themselves_are_accepted():
    """The ends of each range parse: a share of 1, a floor of 4 requests, a factor of 100, an overhead of 0."""
    from stallfree._argtypes import (
        float_at_least,
        float_between,
        int_at_least,
        int_between,
        non_negative_float,
        positive_float_at_most,
        positive_fraction,
    )
    from stallfree.cli import build_parser

    assert positive_fraction("1") == 1.0 and positive_fraction("0.05") == 0.05
    assert int_at_least(4)("4") == 4
    assert int_between(1, 4096)("1") == 1 and int_between(1, 4096)("4096") == 4096
    assert positive_float_at_most(100)("100") == 100.0
    assert float_at_least(1)("1") == 1.0 and float_between(0, 24)("0") == 0.0 and float_between(0, 24)("24") == 24.0
    assert non_negative_float("0") == 0.0
    args = build_parser("budget").parse_args(["budget", "--mfu", "1", "--overhead-ms", "0", "--tp", "2",
                                              "--gpu-memory-utilization", "0.95"])
    assert (args.mfu, args.overhead_ms, args.tp, args.gpu_memory_utilization) == (1.0, 0.0, 2, 0.95)
    assert build_parser("simulate").parse_args(["simulate", "--replicas", "4096"]).replicas == 4096
    assert build_parser("plan").parse_args(["plan", "--max-replicas", "4096"]).max_replicas == 4096


def test_length_flags_take_token_suffixes(capsys):
    """`--prompt-len fixed:1k --output-len uniform:1K,1K` draws 1,000-token prompts and 1,024-token outputs,
    as `--max-num-batched-tokens 1k` is 1,000 tokens."""
    import json

    argv = ["simulate", "--synthetic", "poisson", "--rate", "1", "--num-requests", "4", "--kernels", "none",
            "--no-range", "--no-records", "--json", "--prompt-len", "fixed:1k", "--output-len", "uniform:1K,1K"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["workload"] == "poisson(rate=1; prompt fixed:1000; output uniform:1024,1024; seed 0)"
    run = out["runs"][0]
    assert run["total_input_tokens"] == 4 * 1000 and run["total_output_tokens"] == 4 * 1024


@pytest.mark.parametrize(("argv", "hint"), [
    (["simulate", "--budgets", "512"], "; did you mean --budget?"),  # sweep's and budget's flag given to simulate
    (["simulate", "--bogus", "1"], ""),  # nothing close: no guess
])
def test_unknown_option_names_the_closest_one(argv, hint, capsys):
    """An unknown option's error line suggests this command's closest option, only when one is close."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"stallfree simulate: error: unrecognized arguments: {' '.join(argv[1:])}"
                                       f"{hint} (see stallfree simulate --help)\n")
