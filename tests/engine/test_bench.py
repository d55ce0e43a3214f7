"""The benchmark's least-squares fit and CSV, on step records with known coefficients."""

from __future__ import annotations

import csv

import pytest

from stallfree.engine.bench import CSV_COLUMNS, StepRecord, _percentile, fit_step_time, write_csv


def _records():
    """Steps timed exactly as 2 ms + 0.1 ms/prefill token + 0.5 ms/decode + 1 us/decode context
    token + 3 us/prefill start token."""
    rows = []
    for i, (p, d, dc, pc) in enumerate([(0, 4, 400, 0), (100, 2, 50, 0), (50, 8, 900, 100),
                                        (200, 0, 0, 400), (10, 16, 3000, 20), (120, 5, 500, 900),
                                        (0, 1, 10, 0), (64, 3, 333, 64)]):
        s = 0.002 + 1e-4 * p + 5e-4 * d + 1e-6 * dc + 3e-6 * pc
        rows.append(StepRecord(i, p, d, dc, pc, p + d, s))
    return rows


def test_fit_recovers_known_coefficients():
    """An exact linear step time is recovered with zero error."""
    fit = fit_step_time(_records())
    c = fit["coef"]
    assert c["intercept_s"] == pytest.approx(0.002, abs=1e-9)
    assert c["num_prefill_tokens_s"] == pytest.approx(1e-4, abs=1e-10)
    assert c["num_decodes_s"] == pytest.approx(5e-4, abs=1e-10)
    assert c["decode_context_sum_s"] == pytest.approx(1e-6, abs=1e-11)
    assert c["prefill_context_sum_s"] == pytest.approx(3e-6, abs=1e-11)
    assert fit["mape"] < 1e-9 and fit["r2"] == pytest.approx(1.0) and fit["n"] == 8


def test_fit_needs_enough_rows():
    """Fewer rows than parameters is refused with the counts."""
    with pytest.raises(ValueError, match="at least 5 steps to fit, got 2"):
        fit_step_time(_records()[:2])


def test_csv_has_the_calibration_columns(tmp_path):
    """The CSV's header is the calibration's column list and each row round-trips."""
    path = tmp_path / "s.csv"
    write_csv(_records(), path)
    rows = list(csv.reader(path.read_text().splitlines()))
    assert tuple(rows[0]) == CSV_COLUMNS == ("step", "num_prefill_tokens", "num_decodes",
                                             "decode_context_sum", "prefill_context_sum",
                                             "num_tokens", "seconds")
    assert rows[2] == ["1", "100", "2", "50", "0", "102", "0.013050"]


def test_percentile_interpolates():
    """p50 of 1..4 is 2.5; p99 of 1..101 is 100."""
    assert _percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert _percentile([float(x) for x in range(1, 102)], 99) == 100.0


def test_cost_model_calibration_reads_the_engine_csv(tmp_path):
    """The engine's step CSV is what stallfree.costmodel's calibration reads: every row comes back with
    its counts and its time."""
    from stallfree.costmodel.calibrate import read_steps_csv

    path = tmp_path / "engine_steps.csv"
    write_csv(_records(), path)
    steps = read_steps_csv(path)
    assert [(s.num_prefill_tokens, s.num_decodes, s.decode_context_sum, s.prefill_context_sum) for s in steps] == [
        (r.num_prefill_tokens, r.num_decodes, r.decode_context_sum, r.prefill_context_sum) for r in _records()
    ]
    assert [s.seconds for s in steps] == pytest.approx([r.seconds for r in _records()], abs=1e-6)
