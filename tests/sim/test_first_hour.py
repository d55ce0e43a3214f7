"""What a newcomer trips on first: rejections are loud, the header never prints nan or inf, a bad output
path fails before the simulation, and trace mistakes name what was expected."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main


@pytest.fixture
def trace(tmp_path):
    def make(rows: str, name: str = "t.csv"):
        path = tmp_path / name
        path.write_text("arrival_time,prompt_len,output_len\n" + rows)
        return path

    return make


def test_kv_rejections_print_one_warning_with_count_and_first_reason(trace, capsys):
    """A KV too small for some requests is not an error, but stderr names how many and why."""
    path = trace("0.0,100,10\n0.5,10,5\n1.0,200,10\n")
    assert main(["simulate", "--trace", str(path), "--kv-tokens", "100", "--linear-cost", "10,0"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("warning: chunked/2048: rejected 2 of 3 requests (2 never fit the KV cache (kv_capacity))")
    assert "first: request 0 can never fit" in err[0]


def test_no_warning_without_rejections(trace, capsys):
    """Nothing is printed on stderr when every request fits."""
    assert main(["simulate", "--trace", str(trace("0.0,10,5\n")), "--linear-cost", "10,0"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("rows", "kv"),
    [("0.0,100,10\n", "1000"), ("0.0,100,10\n1.0,100,10\n", "50")],
    ids=["one-request", "all-rejected"],
)
def test_header_never_prints_nan_or_inf(trace, rows, kv, capsys):
    """A one-request trace and a run that rejects everything print words, not nan% or inf req/s, and
    their JSON has no Infinity or NaN."""
    argv = ["simulate", "--trace", str(trace(rows)), "--kv-tokens", kv, "--linear-cost", "10,0"]
    code = 4 if kv == "50" else 0  # a run that served nothing exits 4, after its report
    assert main(argv) == code
    text = capsys.readouterr().out
    for bad in ("nan", "inf%", "inf req/s", "1 requests"):
        assert bad not in text
    assert main([*argv, "--json"]) == code
    raw = capsys.readouterr().out
    assert "Infinity" not in raw and "NaN" not in raw
    json.loads(raw)


def test_out_is_checked_before_simulating(tmp_path, monkeypatch, capsys):
    """--out naming a file fails at once, one line, exit 2 (an input error), before any simulation runs."""
    import stallfree.sim.commands.simulate as command

    def boom(*args, **kwargs):
        raise AssertionError("simulated before checking --out")

    monkeypatch.setattr(command, "run_experiment", boom)
    target = tmp_path / "file"
    target.write_text("")
    assert main(["simulate", "--num-requests", "5", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a directory" in err
    assert main(["simulate", "--num-requests", "5", "--records", str(tmp_path / "missing" / "r.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_trace_directory_is_named(tmp_path, capsys):
    """--trace DIR says it is a directory rather than 'not found'."""
    assert main(["simulate", "--trace", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_format_mismatch_names_the_expected_format(trace, tmp_path, capsys):
    """--trace-format jsonl on a CSV, and csv on a JSONL file, say which format was expected."""
    assert main(["simulate", "--trace", str(trace("0.0,10,5\n")), "--trace-format", "jsonl"]) == 2
    err = capsys.readouterr().err
    assert "not a jsonl trace" in err and "--trace-format csv" in err
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"arrival_time": 0, "prompt_len": 10, "output_len": 5}\n')
    assert main(["simulate", "--trace", str(jsonl), "--trace-format", "csv"]) == 2
    assert "use --trace-format jsonl" in capsys.readouterr().err


def test_negative_time_is_refused_as_negative(capsys):
    """--slo-ttft -1s is refused as a negative duration, not read as a missing argument."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--slo-ttft", "-1s"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err and "must be a duration > 0" in err and "-1s" in err
