"""The simulator's commands priced by measured kernel tables (--kernels); skipped without the package."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.costmodel.kernels import kernels_installed

pytestmark = pytest.mark.skipif(
    not kernels_installed(), reason="the optional package aiconfigurator-core (extra 'kernels') is not installed"
)

_SMALL = ["--num-requests", "30", "--model", "llama-3.1-8b", "--tp", "1", "--dtype", "bf16", "--json"]


def test_default_is_vllm_current_where_the_gpu_has_tables(capsys):
    """No --kernels on an H100: vLLM's current tables price the steps, said in the header and --json."""
    assert main(["simulate", *_SMALL]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["cost_model"] == "kernels"
    src = header["cost_model_source"]
    assert (src["engine"], src["version"], src["system"], src["chosen_by"]) == ("vllm", "0.24.0", "h100_sxm", "default")
    line = "steps priced by measured vllm 0.24.0 kernels for h100-sxm (aiconfigurator-core, which calls it h100_sxm)"
    assert line in header["hardware"]


def test_default_falls_back_on_a_gpu_without_tables(capsys):
    """No --kernels on an L4: today's pricing, with the reason in the header."""
    assert main(["simulate", *_SMALL, "--gpu", "l4"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["cost_model"] in ("floor", "calibrated")
    assert "no measured kernels" in header["hardware"] and "'l4'" in header["cost_model_source"]["fallback_reason"]


def test_kernels_on_a_gpu_without_tables_is_an_error(capsys):
    """--kernels vllm on an L4 cannot be honoured: a usage error (exit 2, as budget's) naming the GPU."""
    assert main(["simulate", *_SMALL, "--gpu", "l4", "--kernels", "vllm"]) == 2
    assert "'l4'" in capsys.readouterr().err


def test_unknown_version_is_an_error_listing_the_slots(capsys):
    """--kernels vllm:9.9 names the versions the package serves (exit 2, as budget's)."""
    assert main(["simulate", *_SMALL, "--kernels", "vllm:9.9"]) == 2
    assert main(["budget", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--kernels", "vllm:9.9"]) == 2
    assert capsys.readouterr().err.count("current = 0.24.0") == 2


def test_kernels_price_slower_than_the_floor(capsys):
    """The measured kernels price the same run's TPOT above the floor's (the floor is a lower bound)."""
    assert main(["simulate", *_SMALL, "--kernels", "none"]) == 0
    floor = json.loads(capsys.readouterr().out)["runs"][0]["mean_tpot_ms"]
    assert main(["simulate", *_SMALL, "--kernels", "vllm:current"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["cost_model_source"]["requested_version"] == "current"
    assert out["runs"][0]["mean_tpot_ms"] > floor


def test_disaggregated_run_prices_both_sides_from_kernels(capsys):
    """A 1P:1D run prices both sides from the tables (each side's hardware line says so)."""
    assert main(["simulate", *_SMALL, "--disaggregate", "1:1", "--kernels", "vllm"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert "measured vllm" in header["prefill_hardware"] and "measured vllm" in header["decode_hardware"]


@pytest.mark.slow
def test_sweep_in_worker_processes(capsys):
    """A sweep over process workers prices every point from the tables (each worker loads them once)."""
    argv = ["sweep", *_SMALL, "--budgets", "256,512", "--jobs", "2", "--executor", "process", "--kernels", "vllm"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["cost_model"] == "kernels"


def test_an_engine_without_a_fitted_profile_says_so(capsys):
    """--kernels sglang has no engine profile fitted: the header says the steps are kernel time only, so a
    comparison with vLLM's profiled run is not taken for like with like."""
    assert main(["simulate", *_SMALL, "--kernels", "sglang"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert "no engine profile fitted for sglang (kernel time only)" in header["hardware"]
    assert header["engine_profile"]["name"] == "none"
