"""Tests of how `validate --against` maps the GPU and model names that vLLM, nvidia-smi and Hugging Face
print onto our presets, on run folders copied from tests/validate/data/run_small with their meta.json
rewritten, and of the note that says which kernel tables' version priced a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stallfree.sim.inputs.engine_profile import EngineProfile
from stallfree.validate.against import replay_run
from stallfree.validate.hardware import gpu_match, model_preset, nearest_served_version
from stallfree.validate.runs import read_run_folder

RUN = Path(__file__).parent / "data" / "run_small"


def _run(tmp_path: Path, model: str, device: str, memory: int, tp: int = 1, blocks: int | None = 1000) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(RUN, folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["model"] = model
    meta["engine_kwargs"]["tensor_parallel_size"] = tp
    meta["hardware"] = {"device_name": device, "device_total_memory_bytes": memory}
    if blocks is None:
        del meta["kv_cache"]["num_gpu_blocks"]
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize(("device", "preset", "noted"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", False),
    ("NVIDIA H100 PCIe", "h100-pcie", False),
    ("NVIDIA H100 NVL", "h100-sxm", True),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb", False),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-80gb", True),
    ("NVIDIA A100-PCIE-40GB", "a100-sxm-80gb", True),
    ("NVIDIA A100 80GB PCIe", "a100-sxm-80gb", True),
    ("NVIDIA L40S", "l40s", False),
    ("NVIDIA L40", "l40", False),
    ("NVIDIA L4", "l4", False),
    ("NVIDIA A10G", "a10g", False),
    ("NVIDIA A10", "a10g", True),
    ("NVIDIA H200", "h200", False),
    ("h200_sxm", "h200", False),
    ("b200_sxm", "b200", False),
    ("NVIDIA GeForce RTX 4090", "rtx-4090", False),
])
def test_gpu_names(device, preset, noted):
    """Each name maps onto its preset; the nearest-preset mappings carry a note saying why."""
    got, note = gpu_match(device)
    assert got == preset and (note is not None) == noted


def test_a100_note_names_what_differs():
    """An A100 whose name says neither 40 GB nor PCIe, with 40 GB of memory, is still noted as 40 GB."""
    assert gpu_match("NVIDIA A100-SXM4-80GB", 85e9)[1] is None
    note = gpu_match("NVIDIA A100-SXM4", 42.4e9)[1]
    assert note is not None and "40 GB" in note and "PCIe" not in note
    assert "PCIe, not NVLink" in (gpu_match("NVIDIA A100-PCIE-40GB")[1] or "")


@pytest.mark.parametrize("path", ["/tmp/a100_floor.json", "a100.json", "H100.JSON", "specs/h200-mine",
                                  "l4_tuned.json"])
def test_gpu_paths_pass_through(path):
    """A path is the user's GPU file, read as that file: never mapped onto the preset its name contains."""
    assert gpu_match(path) == (path, None)
    assert gpu_match(path, 40e9) == (path, None)


@pytest.mark.parametrize(("hf", "ours", "dtype"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", "bf16"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b", "bf16"),
    ("neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", "llama-3.1-70b", "fp8"),
    ("meta-llama/Llama-2-70b-chat-hf", "llama-2-70b", "bf16"),
    ("meta-llama/Llama-2-7b-hf", "llama-2-7b", "bf16"),
    ("codellama/CodeLlama-34b-Instruct-hf", "codellama-34b", "bf16"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b", "bf16"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b", "bf16"),
    ("mistralai/Mixtral-8x22B-Instruct-v0.1", "mixtral-8x22b", "bf16"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", "bf16"),
    ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b", "bf16"),
    ("Qwen/Qwen3-8B", "qwen3-8b", "bf16"),
    ("Qwen/Qwen3-14B", "qwen3-14b", "bf16"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b", "bf16"),
])
def test_model_names(hf, ours, dtype):
    """Hugging Face ids reduce onto preset keys; an -FP8 checkpoint fixes the weights' dtype."""
    assert model_preset(hf, "bfloat16") == (ours, dtype)


@pytest.mark.parametrize(("hf", "config"), [
    ("Qwen/Qwen2.5-14B-Instruct", "qwen2.5-14b/config.json"),
    ("Qwen/Qwen2.5-32B-Instruct", "qwen2.5-32b/config.json"),
    ("Qwen/Qwen3-4B-Instruct-2507", "qwen3-4b/config.json"),
])
def test_model_names_without_preset_use_a_bundled_config(hf, config):
    """Models with no preset are priced from the config.json bundled beside validate."""
    name, dtype = model_preset(hf, "bfloat16")
    assert name.replace("\\", "/").endswith(config) and dtype == "bf16"


@pytest.mark.parametrize(("model", "device", "memory", "tp", "preset", "name"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "NVIDIA A100-SXM4-80GB", 85_097_971_712, 1, "a100-sxm-80gb",
     "llama-3.1-8b"),
    ("Qwen/Qwen3-14B", "NVIDIA L40S", 47_697_362_944, 2, "l40s", "qwen3-14b"),
    ("meta-llama/Llama-2-70b-hf", "NVIDIA H100 80GB HBM3", 85_028_896_768, 4, "h100-sxm", "llama-2-70b"),
    ("Qwen/Qwen2.5-32B-Instruct", "NVIDIA H100 PCIe", 85_028_896_768, 2, "h100-pcie", "qwen2.5-32b"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "NVIDIA L4", 23_580_639_232, 1, "l4", "mistral-7b"),
])
def test_run_folders_of_unseen_hardware_replay(tmp_path, model, device, memory, tp, preset, name):
    """A copied run folder with another GPU and model in its meta.json replays on the right presets."""
    res = replay_run(read_run_folder(_run(tmp_path, model, device, memory, tp)), EngineProfile("none"))
    assert (res["config"]["gpu"], res["config"]["cost_model_name"], res["config"]["tp"]) == (preset, name, tp)
    assert res["requests"] == 3


def test_a100_40gb_run_derives_its_kv_from_its_own_memory(tmp_path):
    """Without num_gpu_blocks, a 40 GB A100's KV capacity comes from its 40 GB, not the preset's 80."""
    small = replay_run(read_run_folder(_run(tmp_path / "a", "meta-llama/Llama-3.1-8B", "NVIDIA A100-SXM4-40GB",
                                            42_505_273_344, blocks=None)), EngineProfile("none"))
    big = replay_run(read_run_folder(_run(tmp_path / "b", "meta-llama/Llama-3.1-8B", "NVIDIA A100-SXM4-80GB",
                                          85_097_971_712, blocks=None)), EngineProfile("none"))
    # (42.505e9 x 0.9 - 16.06e9 weights - 1.238e9 reserve) / 131,072 B per token ~ 159,900 tokens.
    assert 150_000 < small["config"]["kv_tokens"] < 170_000 < big["config"]["kv_tokens"]
    assert "40 GB" in small["config"]["gpu_note"] and big["config"]["gpu_note"] is None


def test_unknown_names_say_what_to_give(tmp_path):
    """A model with no preset nor config, and a GPU with no preset, are refused naming the flag to use."""
    with pytest.raises(ValueError, match=r"give --model PATH/config.json"):
        replay_run(read_run_folder(_run(tmp_path / "m", "acme/Unknown-13B", "NVIDIA H100 80GB HBM3", 85e9 // 1)),
                   EngineProfile("none"))
    with pytest.raises(ValueError, match=r"matches no GPU preset: give --gpu"):
        replay_run(read_run_folder(_run(tmp_path / "g", "meta-llama/Llama-3.1-8B", "Tesla T4", 16e9 // 1)),
                   EngineProfile("none"))


@pytest.mark.slow
def test_nearest_served_version():
    """A run's vLLM version picks the nearest served table version, `current` on a tie; none without tables
    (slow: the package's index imports in about 1 s)."""
    pytest.importorskip("aiconfigurator_core")
    v, line = nearest_served_version("h100-sxm", "vllm", "0.11.0")
    assert v is None and "GEMM and attention from 0.24.0, the nearest" in line and "0.11.0" in line
    v, line = nearest_served_version("h100-sxm", "vllm", "0.30.1")
    assert v == "0.27.0"
    assert nearest_served_version("rtx-4090", "vllm", "0.19.0") == (None, "")


def test_async_scheduling_taken_from_config_else_version(tmp_path):
    """The resolved configuration decides where meta.json has one; else the version's default."""
    from stallfree.validate.against import async_lag

    folder = _run(tmp_path / "a", "meta-llama/Llama-3.1-8B", "NVIDIA H100 80GB HBM3", 85_028_896_768)
    assert async_lag(read_run_folder(folder))[0] is True  # 0.19.0
    meta = json.loads((folder / "meta.json").read_text())
    meta["resolved_config"] = {"scheduler_config": {"async_scheduling": False}}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert async_lag(read_run_folder(folder)) == (False, "resolved_config.scheduler_config.async_scheduling = False")
    del meta["resolved_config"]
    meta["vllm_version"] = "0.10.2"
    (folder / "meta.json").write_text(json.dumps(meta))
    assert async_lag(read_run_folder(folder))[0] is False


def test_async_scheduling_default_from_0_14_0():
    """vLLM's default turned on in 0.14.0 (pull request 27614): 0.12.0 and 0.13.0 (the benchmark rows'
    versions) default off; no version given is taken as off."""
    from stallfree.validate.against import async_default

    assert [async_default(v)[0] for v in ("0.12.0", "0.13.0", "0.13.9", "0.14.0", "v0.14.1", "0.19.0", "0.24.0")] \
        == [False, False, False, True, True, True, True]
    assert async_default("") == (False, "no vLLM version given: taken as synchronous scheduling")
    assert async_default("0.13.0")[1] == "vLLM 0.13.0's default (off; on by default since 0.14.0)"


def test_async_run_is_replayed_with_the_in_loop_model(tmp_path):
    """A run whose engine scheduled asynchronously is replayed with SchedulerConfig.async_scheduling (the
    event loop's model, tests/sim/test_async_scheduling.py): its simulated TTFT is the synchronous
    replay's or more, never less, and the figures record it; forced off by the resolved configuration,
    the replay is synchronous. Requests r2 and r1 are moved to 1 and 2 ms after r0, into its first step
    (about 4.5 ms on the floor), so that the asynchronous replay takes them one step later."""
    folder = _run(tmp_path / "a", "meta-llama/Llama-3.1-8B", "NVIDIA H100 80GB HBM3", 85_028_896_768)
    lines = [json.loads(x) for x in (folder / "requests.jsonl").read_text().splitlines()]
    for rec in lines:
        rec["queued_ts"] = {"r0": 10.0, "r1": 10.002, "r2": 10.001}[rec["request_id"]]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    on = replay_run(read_run_folder(folder), EngineProfile("none"))
    meta = json.loads((folder / "meta.json").read_text())
    meta["resolved_config"] = {"scheduler_config": {"async_scheduling": False}}
    (folder / "meta.json").write_text(json.dumps(meta))
    off = replay_run(read_run_folder(folder), EngineProfile("none"))
    assert on["config"]["async_scheduling_lag"] is True and off["config"]["async_scheduling_lag"] is False
    pairs = [(a[2], b[2]) for a, b in zip(on["per_request"], off["per_request"], strict=True)]
    assert all(a >= b - 1e-9 for a, b in pairs)
    assert sum(a > b + 1e-6 for a, b in pairs) == 2  # r1 and r2 arrived while step 0 ran


def test_simulate_takes_hugging_face_and_device_names(capsys):
    """`simulate --model <HF id> --gpu <nvidia-smi name>` prices the presets and says how it read them."""
    from stallfree.cli import main

    rc = main(["simulate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA H100 80GB HBM3",
               "--tp", "1", "--kernels", "none", "--num-requests", "4"])
    out = capsys.readouterr().out
    assert rc in (0, None)
    assert "model meta-llama/Llama-3.1-8B-Instruct as llama-3.1-8b" in out
    assert "GPU NVIDIA H100 80GB HBM3 as h100-sxm" in out


def test_fp8_kv_cache_doubles_the_derived_kv(tmp_path):
    """engine_kwargs.kv_cache_dtype fp8 prices 1-byte KV: the derived capacity is twice bf16's (within a
    block); an unknown value skips the run naming it."""
    base = _run(tmp_path / "a", "meta-llama/Llama-3.1-8B", "NVIDIA H100 80GB HBM3", 85_028_896_768, blocks=None)
    fp8 = _run(tmp_path / "b", "meta-llama/Llama-3.1-8B", "NVIDIA H100 80GB HBM3", 85_028_896_768, blocks=None)
    meta = json.loads((fp8 / "meta.json").read_text())
    meta["engine_kwargs"]["kv_cache_dtype"] = "fp8_e4m3"
    (fp8 / "meta.json").write_text(json.dumps(meta))
    a = replay_run(read_run_folder(base), EngineProfile("none"))["config"]["kv_tokens"]
    b = replay_run(read_run_folder(fp8), EngineProfile("none"))["config"]["kv_tokens"]
    assert abs(b - 2 * a) <= 16
    meta["engine_kwargs"]["kv_cache_dtype"] = "int3"
    (fp8 / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int3'"):
        replay_run(read_run_folder(fp8), EngineProfile("none"))


def test_resolved_config_fills_what_engine_kwargs_leave_out(tmp_path):
    """A field the engine arguments omit comes from vLLM's resolved configuration, not our default."""
    folder = _run(tmp_path, "meta-llama/Llama-3.1-8B", "NVIDIA L40S", 47_697_362_944, blocks=None)
    meta = json.loads((folder / "meta.json").read_text())
    for k in ("max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
        meta["engine_kwargs"].pop(k)
    meta["resolved_config"] = {"scheduler_config": {"max_num_batched_tokens": 8192, "max_num_seqs": 64},
                               "parallel_config": {"tensor_parallel_size": 2},
                               "cache_config": {"num_gpu_blocks": 500, "cache_dtype": "fp8"}}
    (folder / "meta.json").write_text(json.dumps(meta))
    run = read_run_folder(folder)
    assert (run.max_num_batched_tokens, run.max_num_seqs, run.tp, run.num_gpu_blocks) == (8192, 64, 2, 500)
    assert run.kv_cache_dtype == "fp8"  # cache_config.cache_dtype, engine_kwargs giving none
