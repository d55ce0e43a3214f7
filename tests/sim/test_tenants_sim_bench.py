"""benchmarks/tenants_sim.py: a readable table by default (rounded, with units and what priced the steps),
the unrounded figures behind --json; the figures are docs/scheduling.md's and README.md's."""

from __future__ import annotations

import json

import pytest

from factories import load_benchmark


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return load_benchmark("tenants_sim")


def test_default_prints_a_table_of_the_documented_figures(bench, capsys):  # type: ignore[no-untyped-def]
    """Seed 0 (the default), as docs/scheduling.md's table: each run's row rounded with its units, the
    goal's ratios, and the line saying the roofline floor priced the steps."""
    bench.main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("two tenants, seed 0: 1,006 requests arriving over 120 s")
    assert lines[1].startswith("llama-3.3-70b, 4 x h100-sxm, fp8; steps priced by the floor (efficiency 1.0")
    assert lines[1].endswith("; budget 2,048 tokens, synchronous scheduling")
    rows = {line.split("  ")[0].strip(): " ".join(line.split()) for line in lines[4:9]}
    assert rows == {
        "run": "run light TTFT p50 / p99 light TPOT p99 flood TTFT p50 total tokens/s output tokens/s",
        "light alone": "light alone 17.9 ms / 35.6 ms 5.9 ms - 1,475 356",
        "fcfs": "fcfs 96.6 s / 165.7 s 62.7 ms 85.7 s 32,899 675",
        "vtc": "vtc 93.2 ms / 173.0 ms 62.2 ms 88.1 s 32,928 676",
        "vtc+isolation": "vtc+isolation 28.4 ms / 48.1 ms 23.5 ms 88.5 s 32,888 675",
    }
    assert "light p99 TTFT over alone: fcfs 4,655x, vtc 4.86x, vtc+isolation 1.35x (goal: within 2x)" in lines
    assert "total throughput over fcfs: vtc 1.0009, vtc+isolation 0.9997 (goal: within 5%)" in lines
    assert not any(line.lstrip().startswith("{") for line in lines)


def test_json_keeps_the_unrounded_figures(bench, capsys):  # type: ignore[no-untyped-def]
    """--json prints the report as before: the runs' figures unrounded, the verdict's ratios."""
    bench.main(["--json", "--duration", "30"])
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"requests", "isolation", "async_scheduling", "runs", "verdict"}
    assert list(report["runs"]) == ["light alone", "fcfs", "vtc", "vtc+isolation"]
    alone = report["runs"]["light alone"]
    assert alone["flood_p50_ttft_ms"] is None and alone["light_p99_ttft_ms"] > 0
    assert report["verdict"]["light_p99_ttft_vtc_over_alone"] == pytest.approx(
        report["runs"]["vtc"]["light_p99_ttft_ms"] / alone["light_p99_ttft_ms"], rel=1e-12)
