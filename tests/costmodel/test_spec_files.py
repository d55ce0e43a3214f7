"""Hostile spec and calibration files: a model spec that is /dev/zero or deeply nested JSON, a
calibration CSV with a field over the csv module's limit or a line over 1 MiB. Each is one
CostModelDataError (exit 2), not a MemoryError or a traceback."""

from __future__ import annotations

import os

import pytest

from stallfree import _files
from stallfree.cli import main
from stallfree.costmodel.errors import CostModelDataError
from stallfree.costmodel.hardware import read_json_object
from stallfree.costmodel.measured import read_rows


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_model_spec_that_never_ends_is_read_only_to_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(_files, "MAX_JSON_CHARS", 1 << 20)
    spec = tmp_path / "zero.json"
    spec.symlink_to("/dev/zero")
    with pytest.raises(CostModelDataError, match=r"zero\.json: more than 1,048,576 characters"):
        read_json_object(spec, "model")


def test_deeply_nested_spec(tmp_path):
    spec = tmp_path / "m.json"
    spec.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CostModelDataError, match="nested too deeply"):
        read_json_object(spec, "model")


def test_simulate_exits_2_for_a_deep_model_spec(tmp_path, capsys):
    spec = tmp_path / "m.json"
    spec.write_text("{" + '"a":{' * 5000 + "}" * 5001)
    assert main(["simulate", "--model", str(spec), "--num-requests", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nested too deeply" in err[0]


def test_calibration_csv_field_and_line_limits(tmp_path):
    p = tmp_path / "steps.csv"
    p.write_text("a,b\n" + '"' + "x" * 200_000 + '",1\n')
    with pytest.raises(CostModelDataError, match="field larger than field limit"):
        read_rows(p)
    p.write_text("a,b\n" + "1" * (2 << 20) + ",1\n")
    with pytest.raises(CostModelDataError, match=r"steps\.csv:2: a line longer than"):
        read_rows(p)
