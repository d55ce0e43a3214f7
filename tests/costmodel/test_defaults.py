"""Tests of the default cost model: calibrated where the GPU carries a calibration, else the floor."""

from __future__ import annotations

import json

import pytest

from stallfree.costmodel import CostModel, default_cost_model, get_gpu, get_model
from stallfree.costmodel.calibrate import calibrate_profile
from stallfree.costmodel.cli import register
from stallfree.costmodel.hardware import gpu_to_dict, load_gpu_file


def test_floor_where_no_calibration():
    """H100 has no calibration: the default is the floor and says its latencies are lower bounds."""
    d = default_cost_model("llama-3.1-70b", "h100-sxm", tp=4, dtype="fp8")
    floor = CostModel.from_names("llama-3.1-70b", "h100-sxm", tp=4, dtype="fp8")
    assert not d.calibrated and "lower bounds" in d.provenance and "floor" in d.provenance
    assert d.cost_model.decode_step_time(64, 4096) == floor.decode_step_time(64, 4096)


def test_plain_cost_model_stays_the_floor_on_a_calibrated_gpu():
    """CostModel(model, gpu, tp, dtype) with no efficiency arguments ignores the GPU's calibration."""
    cm = CostModel(get_model("codellama-34b"), get_gpu("a100"), 2, "fp16")
    assert (cm.mfu, cm.mbu, cm.overhead_s, cm.kernel_launch_s, cm.per_token_s, cm.per_seq_s) == (1, 1, 0, 0, 0, 0)


def test_shipped_a100_calibration_is_the_fit():
    """The A100 preset's calibration equals a fresh calibrate_profile of the shipped tables."""
    cal, _, _ = calibrate_profile("a100-codellama34b-tp2")
    shipped = dict(get_gpu("a100").calibration.kwargs)
    assert shipped == pytest.approx(cal.kwargs(), rel=1e-9)
    d = default_cost_model("codellama-34b", "a100", tp=2, dtype="fp16")
    assert d.calibrated and "Vidur" in d.provenance
    assert d.cost_model.per_token_s == pytest.approx(cal.per_token_s, rel=1e-12)
    assert d.cost_model.decode_step_time(8, 1000) > 1.3 * CostModel.from_names(
        "codellama-34b", "a100", tp=2, dtype="fp16"
    ).decode_step_time(8, 1000)


def test_calibration_moves_per_token_by_flops():
    """On Llama 3.1 8B at tp 1, per_token_s scales by 2 x 6.98e9 / (2 x 33.22e9 / 2) linear FLOPs per token."""
    cal = get_gpu("a100").calibration
    d = default_cost_model("llama-3.1-8b", "a100", tp=1)
    scale = 2 * get_model("llama-3.1-8b").active_layer_params / cal.linear_flops_per_token_per_gpu
    assert d.cost_model.per_token_s == pytest.approx(dict(cal.kwargs)["per_token_s"] * scale, rel=1e-12)
    assert d.cost_model.kernel_launch_s == dict(cal.kwargs)["kernel_launch_s"]
    assert "per-token term x" in d.provenance


def test_gpu_file_round_trip_keeps_calibration(tmp_path):
    """A GPU written by gpu_to_dict reads back equal, calibration included."""
    path = tmp_path / "a100.json"
    path.write_text(json.dumps(gpu_to_dict(get_gpu("a100"))))
    g = load_gpu_file(path)
    assert g == get_gpu("a100") and g.calibration == get_gpu("a100").calibration


def test_calibrate_save_gpu_then_default(tmp_path, capsys):
    """`stallfree calibrate --csv ... --save-gpu F` writes a GPU whose calibration the default model uses."""
    import argparse

    steps = tmp_path / "steps.csv"
    rows = ["num_tokens,num_decodes,decode_context_sum,seconds"]
    truth = CostModel.from_names("llama-3.1-8b", "l4", tp=1, mfu=0.5, mbu=0.7, overhead_s=0.002)
    for i in range(1, 40):
        rows.append(f"{i * 8},{i * 8},{i * 8 * 300},{truth.decode_step_time(i * 8, 300)}")
    steps.write_text("\n".join(rows) + "\n")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    register(sub)
    out = tmp_path / "l4-mine.json"
    args = parser.parse_args(
        ["calibrate", "--csv", str(steps), "--model", "llama-3.1-8b", "--gpu", "l4", "--save-gpu", str(out)]
    )
    assert args.func(args) == 0
    d = default_cost_model("llama-3.1-8b", str(out))
    assert d.calibrated and "stallfree calibrate --csv" in d.provenance
    assert d.cost_model.decode_step_time(64, 300) == pytest.approx(truth.decode_step_time(64, 300), rel=1e-3)
