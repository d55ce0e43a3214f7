"""Hostile trace files: past the size limits of stallfree._files, corrupt gzip, deep JSON, a CSV field
over the csv module's limit, absurd arrival times. Each ends in one TraceError (exit 2), not a
traceback or a MemoryError, and malformed rows are skipped with --skip-bad-rows."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from stallfree import _files
from stallfree.cli import main
from stallfree.sim.inputs.traces import load_trace
from stallfree.sim.inputs.workload import TraceError

HEADER = "arrival_time,prompt_len,output_len\n"


def _gz(path, chunks):
    with gzip.open(path, "wb") as g:
        for c in chunks:
            g.write(c)
    return path


def test_gz_line_past_the_line_limit_is_refused_without_reading_it_whole(tmp_path):
    """A small .gz holding one line over 1 MiB: refused at the limit, naming file, line and limit."""
    p = _gz(tmp_path / "t.csv.gz", [HEADER.encode(), b"1" * (2 << 20), b",1,1\n"])
    with pytest.raises(TraceError, match=r"t\.csv\.gz:2: a line longer than 1,048,576 characters"):
        load_trace(p)


def test_decompressed_size_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "MAX_FILE_CHARS", 10_000)
    p = _gz(tmp_path / "t.csv.gz", [HEADER.encode(), b"0,1,1\n" * 5000])
    with pytest.raises(TraceError, match=r"decompressed\), the limit for a file"):
        load_trace(p)


def test_sparse_file_past_the_file_limit_is_refused_from_its_size(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "0,1,1\n")
    os.truncate(p, _files.MAX_FILE_CHARS + 1)  # sparse: no disk, no reading
    with pytest.raises(TraceError, match=r"over the limit of 1 GiB for a file"):
        load_trace(p)


@pytest.mark.parametrize("kind", ["flipped", "truncated", "not-gzip"])
def test_corrupt_gzip_is_a_trace_error(tmp_path, kind):
    good = gzip.compress((HEADER + "0,1,1\n" * 5000).encode())
    data = {"flipped": good[:30] + bytes(b ^ 0xFF for b in good[30:40]) + good[40:],
            "truncated": good[: len(good) // 2], "not-gzip": b"plain text\n"}[kind]
    p = tmp_path / "t.csv.gz"
    p.write_bytes(data)
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(p)


def test_deeply_nested_json_row_is_a_malformed_row(tmp_path):
    ok = json.dumps({"arrival_time": 0, "prompt_len": 5, "output_len": 5})
    p = tmp_path / "t.jsonl"
    p.write_text(ok + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + ok + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: JSON nested too deeply"):
        load_trace(p)
    assert load_trace(p, skip_bad_rows=True).skipped_rows == 1


def test_csv_field_past_the_csv_limit_is_a_malformed_row(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "0,1,1\n" + '"' + "x" * 200_000 + '",1,1\n' + "1,2,2\n")
    with pytest.raises(TraceError, match=r"t\.csv:3: field larger than field limit"):
        load_trace(p)
    wl = load_trace(p, skip_bad_rows=True)
    assert (len(wl), wl.skipped_rows) == (2, 1)


@pytest.mark.parametrize(("value", "message"), [
    ("1e308", r"t\.csv:3: arrival_time '1e308' is past 1e\+12 s"),
    ("200000000", r"t\.csv:3: arrival_time '200000000' is 2e\+08 s from the first row's \(line 2\)"),
    ("nan", r"t\.csv:3: arrival_time 'nan' must be a finite number"),
    ("inf", r"t\.csv:3: arrival_time 'inf' must be a finite number"),
])
def test_absurd_arrival_times_are_refused_or_skipped(tmp_path, value, message):
    """1e308 used to load, giving a 6 ms TTFT and a TPOT of 0 for that request."""
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "0,10,10\n" + f"{value},10,10\n" + "1,10,10\n")
    with pytest.raises(TraceError, match=message):
        load_trace(p)
    wl = load_trace(p, skip_bad_rows=True)
    assert (len(wl), wl.skipped_rows, wl.arrivals) == (2, 1, (0.0, 1.0))


def test_mooncake_timestamp_past_the_bound_is_refused(tmp_path):
    row = {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(row) + "\n" + json.dumps({**row, "timestamp": 1e300}) + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: timestamp '1e\+300' is past"):
        load_trace(p)


def test_cli_exit_2_and_one_line_for_a_hostile_gz(tmp_path, capsys):
    p = _gz(tmp_path / "t.csv.gz", [HEADER.encode(), b"1" * (2 << 20), b",1,1\n"])
    assert main(["simulate", "--trace", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t.csv.gz:2: a line longer than" in err[0]


@pytest.mark.parametrize(
    "header",
    ["arrival_time,prompt_len,output_len,arrival_time", "arrival_time, prompt_len,output_len,prompt_len "],
    ids=["the-first-column-again", "spaces-around"],
)
def test_csv_trace_with_a_column_twice_is_refused(tmp_path, capsys, header):
    """A trace whose header gives a column twice is refused naming it (was: read silently with the first
    and the second ignored), exit 2, before anything runs."""
    p = tmp_path / "t.csv"
    p.write_text(f"{header}\n0,10,5,100\n1,10,5,0\n")
    cols = [h.strip() for h in header.split(",")]
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert str(info.value) == f"{p}:1: column {cols[-1]!r} appears twice in the header {cols}; give each column once"
    assert main(["simulate", "--trace", str(p), "--kernels", "none", "--no-range"]) == 2
    assert capsys.readouterr().err == f"stallfree simulate: error: {info.value}\n"
