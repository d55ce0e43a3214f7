"""benchmarks/load.py's client-side figures, on the B25 timestamps worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "load_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "load.py"
)
load = importlib.util.module_from_spec(_SPEC)
sys.modules["load_bench"] = load  # dataclasses look their module up there
_SPEC.loader.exec_module(load)


def test_summarize_b25():
    """Tokens at 0.50/0.55/0.62/0.70 and one at 0.30: TTFT mean 400 ms, ITL 50/70/80 ms, no TTFT in ITL."""
    a = load.Result("short", 0.0, [0.50, 0.55, 0.62, 0.70], end=0.70, ok=True)
    b = load.Result("short", 0.0, [0.30], end=0.30, ok=True)
    s = load.summarize([a, b], wall_s=1.0)
    assert s["short_mean_ttft_ms"] == pytest.approx(400.0)
    assert s["short_mean_itl_ms"] == pytest.approx(200.0 / 3)
    assert s["short_median_itl_ms"] == pytest.approx(70.0)
    assert s["short_max_itl_ms"] == pytest.approx(80.0)
    assert s["short_mean_e2el_ms"] == pytest.approx(500.0)
    assert s["output_throughput"] == 5 and s["request_throughput"] == 2
    assert s["long_completed"] == 0


def test_percentile_interpolates():
    """p50 of 1..4 is 2.5, p99 of 0..100 is 99 (linear between order statistics), empty is nan."""
    assert load.percentile([4, 1, 3, 2], 50) == 2.5
    assert load.percentile([float(i) for i in range(101)], 99) == pytest.approx(99.0)
    assert load.percentile([], 50) != load.percentile([], 50)
