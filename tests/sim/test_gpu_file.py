"""A GPU file given where a GPU name is expected (--gpu PATH.json) is read as that file by every command,
even when its name holds a preset's ("a100_floor.json"); a name still maps onto the presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallfree.cli import main
from stallfree.costmodel import CostModel, get_gpu
from stallfree.costmodel.hardware import gpu_to_dict
from stallfree.sim.inputs.engine_profile import EngineProfile
from stallfree.sim.inputs.options import HardwareOptions
from stallfree.sim.inputs.pricing import build_priced
from stallfree.validate.against import replay_run
from stallfree.validate.runs import read_run_folder

RUN = Path(__file__).parents[1] / "validate" / "data" / "run_small"


@pytest.fixture
def a100_file(tmp_path: Path) -> Path:
    """The A100 preset without its calibration and at half its peaks and bandwidth, in a file whose name
    contains "a100" (as a preset-matching rule reads it)."""
    entry = gpu_to_dict(get_gpu("a100-sxm-80gb"))
    entry.pop("calibration", None)
    entry["key"] = "a100-floor"
    entry["peak_tflops"] = {k: (v / 2 if v else v) for k, v in entry["peak_tflops"].items()}
    entry["mem_bw_GBps"] /= 2
    path = tmp_path / "a100_floor.json"
    path.write_text(json.dumps(entry))
    return path


def test_simulate_prices_the_file_not_the_preset(a100_file):
    """simulate's pricing reads the file: its floor (no calibration) at its own peaks, and the header names
    the file, not "as a100-sxm-80gb"."""
    hw = dict(model="llama-3.1-8b", tp=1, dtype="bf16", kernels="none")
    cost, _, line, priced = build_priced(HardwareOptions(gpu=str(a100_file), **hw))
    assert priced["cost_model"] == "floor" and "a100-floor" in line, line
    assert "as a100" not in line and f"1 x {a100_file}" in line, line
    own = CostModel.from_names("llama-3.1-8b", str(a100_file), tp=1, dtype="bf16")
    assert cost.decode_step_time(16, 1000) == own.decode_step_time(16, 1000)
    preset, _, _, preset_priced = build_priced(HardwareOptions(gpu="a100-sxm-80gb", **hw))
    assert preset_priced["cost_model"] == "calibrated"
    preset_floor = CostModel.from_names("llama-3.1-8b", "a100-sxm-80gb", tp=1, dtype="bf16")
    assert cost.decode_step_time(16, 1000) > 1.9 * preset_floor.decode_step_time(16, 1000)


def test_simulate_command_reads_the_file(a100_file, capsys):
    """The command's header says the file's floor priced the steps."""
    argv = ["simulate", "--gpu", str(a100_file), "--model", "llama-3.1-8b", "--tp", "1", "--dtype", "bf16",
            "--kernels", "none", "--num-requests", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no calibration for a100-floor" in out and "as a100-sxm-80gb" not in out, out


def test_validate_against_reads_the_file(a100_file):
    """validate --against's --gpu FILE overrides the run's GPU with the file, with no nearest-preset note."""
    res = replay_run(read_run_folder(RUN), EngineProfile("none"), gpu=str(a100_file), kernels="none")
    assert res["config"]["gpu"] == str(a100_file) and res["config"]["gpu_note"] is None
    assert "no calibration for a100-floor" in res["config"]["cost_model"], res["config"]


def test_plan_does_not_price_the_file_as_the_preset(a100_file, capsys):
    """plan prices GPUs by preset name: a file is not priced as the preset its name contains."""
    argv = ["plan", "--gpu", f"{a100_file},h100-sxm", "--tp", "1", "--model", "llama-3.1-8b", "--kernels", "none",
            "--num-requests", "20", "--slo-ttft", "2s", "--slo-tpot", "100ms",
            "--gpu-price", "a100-sxm-80gb=1,h100-sxm=2"]
    assert main(argv) == 2
    assert f"no price for {a100_file}" in capsys.readouterr().err
