"""Workloads: trace formats, bad rows, the bundled trace, transforms and synthetic arrivals."""

from __future__ import annotations

import gzip
import json
import statistics

import pytest

from stallfree.sim.inputs.synthetic import parse_length_spec, synthetic
from stallfree.sim.inputs.traces import load_bundled, load_trace
from stallfree.sim.inputs.workload import TraceError, TraceFileError

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:50.9951690,879,55
"""


def test_azure_trace_times_are_relative_seconds(tmp_path):
    """Azure timestamps (7 fractional digits) become seconds from the first request."""
    p = tmp_path / "conv.csv"
    p.write_text(AZURE)
    w = load_trace(p)
    assert w.arrivals[0] == 0.0
    assert w.arrivals[1] == pytest.approx(4.314579)
    assert w.arrivals[2] == w.arrivals[1]
    assert w.prompt_lens == (374, 396, 879)
    assert w.output_lens == (44, 109, 55)


def test_azure_trace_across_midnight(tmp_path):
    """A trace crossing midnight keeps counting seconds."""
    p = tmp_path / "t.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:59.5,1,1\n2023-11-17 00:00:00.5,1,1\n"
    )
    assert load_trace(p).arrivals == (0.0, 1.0)


def test_burstgpt_excludes_failed_rows_and_says_so(tmp_path):
    """BurstGPT rows with 0 response tokens are failures in the trace: excluded, counted, noted."""
    p = tmp_path / "burst.csv"
    p.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "7.5,GPT-4,1000,0,1000,Conversation log\n"
        "9,ChatGPT,20,300,320,API log\n"
    )
    w = load_trace(p)
    assert w.arrivals == (0.0, 4.0)
    assert w.prompt_lens == (472, 20)
    assert w.output_lens == (18, 300)
    assert "excluded 1 rows with 0 output tokens" in w.notes[0]


def test_generic_csv_jsonl_and_gzip(tmp_path):
    """The generic CSV and JSONL formats load, also gzip-compressed, and are sorted by arrival stably."""
    rows = [(0.5, 10, 3), (0.25, 20, 4), (0.5, 30, 5)]
    csv_text = "arrival_time,prompt_len,output_len\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows)
    (tmp_path / "w.csv").write_text(csv_text)
    jl = "".join(json.dumps({"arrival_time": a, "prompt_len": p, "output_len": o}) + "\n" for a, p, o in rows)
    with gzip.open(tmp_path / "w.jsonl.gz", "wt") as fh:
        fh.write(jl)
    for name in ("w.csv", "w.jsonl.gz"):
        w = load_trace(tmp_path / name)
        assert w.arrivals == (0.0, 0.25, 0.25)
        assert w.prompt_lens == (20, 10, 30)
        # 0.25 comes after 0.5: one row out of order, sorted and said (the later 0.5 ties, not backwards).
        assert w.notes == ("sorted by arrival time: 1 of 3 rows arrive earlier than a row above them in the file",)


def test_arrivals_in_order_leave_no_note(tmp_path):
    """A trace whose clock never goes backwards gets no sorting note; 1.0, 0.5, 0.75, 2 has two rows back."""
    p = tmp_path / "w.csv"
    p.write_text("arrival_time,prompt_len,output_len\n0,1,1\n0,2,1\n1,3,1\n")
    assert load_trace(p).notes == ()
    p.write_text("arrival_time,prompt_len,output_len\n1.0,1,1\n0.5,2,1\n0.75,3,1\n2,4,1\n")
    w = load_trace(p)
    assert w.arrivals == (0.0, 0.25, 0.5, 1.5) and w.prompt_lens == (2, 3, 1, 4)
    assert w.notes == ("sorted by arrival time: 2 of 4 rows arrive earlier than a row above them in the file",)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:15:50.99,abc,109", "ContextTokens 'abc' is not an integer"),
        ("2023-11-16 18:15:50.99,396", "expected 3 fields, got 2"),
        ("yesterday,396,109", "TIMESTAMP 'yesterday'"),
        ("2023-11-16 18:15:50.99,0,109", "ContextTokens '0' must be >= 1"),
    ],
    ids=["not-int", "short-row", "bad-time", "zero-prompt"],
)
def test_malformed_row_names_file_line_field_and_value(tmp_path, row, message):
    """A malformed row stops the load with path:line, the field and the value."""
    p = tmp_path / "bad.csv"
    p.write_text(AZURE + row + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert str(err.value).startswith(f"{p}:5: ")
    assert message in str(err.value)


def test_skip_bad_rows_skips_and_counts(tmp_path):
    """With skip_bad_rows the bad rows are skipped, counted and the first is quoted in a note."""
    p = tmp_path / "bad.csv"
    p.write_text(AZURE + "x,1,1\n2023-11-16 18:15:52.0,5,5\n2023-11-16 18:15:53.0,5,-1\n")
    w = load_trace(p, skip_bad_rows=True)
    assert len(w) == 4
    assert w.skipped_rows == 2
    assert f"{p}:5:" in w.notes[0]


def test_missing_file_and_unknown_header(tmp_path):
    """A missing file and an unrecognised header are TraceErrors with a clear message."""
    with pytest.raises(TraceFileError, match="trace file not found"):
        load_trace(tmp_path / "nope.csv")
    p = tmp_path / "odd.csv"
    p.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="unrecognised header"):
        load_trace(p)


def test_bundled_trace():
    """The bundled Azure conversation trace holds 19,366 requests over about an hour."""
    w = load_bundled()
    assert len(w) == 19_366
    assert (w.prompt_lens[0], w.output_lens[0]) == (374, 44)
    assert 3490 < w.duration < 3510
    assert sum(w.output_lens) == 4_088_665


def test_scale_window_head():
    """Rate scaling divides arrival times; a window shifts to its start; head takes the first n."""
    w = load_bundled().head(5)
    assert w.scale_rate(2.0).arrivals == tuple(t / 2 for t in w.arrivals)
    win = load_bundled().window(10.0, 20.0)
    assert all(0 <= t < 10 for t in win.arrivals)
    assert len(w) == 5
    with pytest.raises(ValueError, match="rate scale"):
        w.scale_rate(0)


def test_synthetic_is_seeded_and_has_its_rate():
    """The same seed draws the same workload, with the requested mean rate."""
    fixed = parse_length_spec("fixed:100")
    a = synthetic(4000, 10.0, fixed, parse_length_spec("uniform:1,9"), seed=1)
    assert a == synthetic(4000, 10.0, fixed, parse_length_spec("uniform:1,9"), seed=1)
    assert a.mean_rate == pytest.approx(10.0, rel=0.05)
    assert set(a.prompt_lens) == {100}
    assert set(a.output_lens) == set(range(1, 10))


def test_gamma_burstiness_sets_the_gap_variation():
    """Gamma gaps have squared coefficient of variation 1/burstiness."""
    fixed = parse_length_spec("fixed:1")
    w = synthetic(20_000, 5.0, fixed, fixed, arrival="gamma", burstiness=0.25, seed=2)
    gaps = [b - a for a, b in zip(w.arrivals, w.arrivals[1:], strict=False)]
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(4.0, rel=0.1)


def test_trace_resampling_keeps_pairs():
    """Resampling lengths from the bundled trace draws real (prompt, output) pairs together."""
    trace = parse_length_spec("trace")
    w = synthetic(200, 5.0, trace, trace, seed=3)
    pairs = set(zip(load_bundled().prompt_lens, load_bundled().output_lens, strict=True))
    assert all(p in pairs for p in zip(w.prompt_lens, w.output_lens, strict=True))


def test_length_spec_takes_token_suffixes_as_every_token_flag():
    """N, LO, HI and MEDIAN take vLLM's suffixes, with the values stallfree._argtypes.parse_token_count gives
    every token flag (k = 1,000, K = 1,024, m = 10^6, M = 2^20; g and G are past MAX_LENGTH); a lognormal's
    sigma stays a plain number."""
    from stallfree._argtypes import parse_token_count

    assert parse_length_spec("fixed:1k") == parse_length_spec("fixed:1000")
    assert parse_length_spec("uniform:1K,4K") == parse_length_spec("uniform:1024,4096")
    assert parse_length_spec("lognormal:1.5k,0.5") == parse_length_spec("lognormal:1500,0.5")
    for word in ("2k", "2K", "1.5k", "1m", "1M", "512"):
        spec = parse_length_spec(f"fixed:{word}")
        assert spec.lo == spec.hi == parse_token_count(word), word
    w = synthetic(50, 10.0, parse_length_spec("fixed:2K"), parse_length_spec("uniform:1k,1k"), seed=4)
    assert set(w.prompt_lens) == {2048} and set(w.output_lens) == {1000}


@pytest.mark.parametrize(
    "text",
    ["fixed:0", "uniform:5,2", "lognormal:x,1", "pareto:1", "fixed:1.0005k", "lognormal:100,1k", "fixed:2x"],
    ids=["zero", "reversed", "nan", "unknown", "fractional-tokens", "suffixed-sigma", "unknown-suffix"],
)
def test_bad_length_spec(text):
    """A bad length distribution raises ValueError quoting it."""
    with pytest.raises(ValueError, match="bad length distribution"):
        parse_length_spec(text)


@pytest.mark.parametrize(
    "flag,text,what,got",
    [
        ("--prompt-len", "fixed:1.9", "N of fixed:N must be a whole number", "1.9"),
        ("--output-len", "fixed:2.7", "N of fixed:N must be a whole number", "2.7"),
        ("--output-len", "uniform:1.5,3", "LO and HI of uniform:LO,HI must be whole numbers", "1.5"),
        ("--prompt-len", "uniform:2,3.5", "LO and HI of uniform:LO,HI must be whole numbers", "3.5"),
    ],
    ids=["fixed-prompt", "fixed-output", "uniform-lo", "uniform-hi"],
)
def test_length_count_with_a_fraction_is_a_usage_error(capsys, flag, text, what, got):
    """A fixed or uniform length with a fraction is refused naming the flag (was: run truncated, fixed:1.9
    as 1, while the header echoed 1.9); exit 2 before anything runs."""
    from stallfree.cli import main

    argv = ["simulate", "--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none",
            "--no-range", flag, text]
    assert main(argv) == 2
    assert capsys.readouterr() == ("", f"stallfree simulate: error: {flag}: bad length distribution {text!r}: "
                                       f"{what}, got {got}\n")


def test_whole_counts_written_with_a_point_or_suffix_still_parse():
    """fixed:2.0, 1e3 and 1.5k are whole counts and keep working; a lognormal median may have a fraction."""
    assert parse_length_spec("fixed:2.0") == parse_length_spec("fixed:2")
    assert parse_length_spec("uniform:1e3,1.5k") == parse_length_spec("uniform:1000,1500")
    assert parse_length_spec("lognormal:100.5,1").lo == 100.5
