"""How a measured run's names map onto the cost model's: Hugging Face model names and GPU names onto
our presets (tables, not string rewrites), the KV capacity of a run that does not give it, and the step
pricing with an engine profile.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from stallfree._files import read_json
from stallfree.costmodel import CostModelError
from stallfree.costmodel.choice import DEFAULT_ENGINE, choose_cost_model
from stallfree.costmodel.model import get_model
from stallfree.costmodel.names import GPU_NAMES, GPU_RULES, gpu_match, reduce_model_name, resolve_model
from stallfree.sim.inputs.engine_profile import EngineProfile, ProfiledCostModel, default_profile
from stallfree.sim.run.costs import StepCostModel

__all__ = [
    "ACTIVATION_RESERVE_BYTES",
    "GPU_NAMES",
    "MODEL_NAMES",
    "Pricing",
    "derived_kv_tokens",
    "describe_profile",
    "GPU_RULES",
    "gpu_match",
    "gpu_preset",
    "kv_dtype_of",
    "model_preset",
    "nearest_served_version",
    "pricing",
]

#: Hugging Face model names (lower case) -> (our model name, the weights' dtype when the name fixes it),
#: for names the rules of `model_preset` do not reduce to a preset key.
MODEL_NAMES: dict[str, tuple[str, str | None]] = {
    "nvidia/llama-3.1-8b-instruct-fp8": ("llama-3.1-8b", "fp8"),
    "qwen/qwen3-32b-fp8": ("qwen3-32b", "fp8"),
    "mistralai/mixtral-8x7b-v0.1": ("mixtral-8x7b", None),
    "mistralai/mixtral-8x7b-instruct-v0.1": ("mixtral-8x7b", None),
    "codellama/codellama-34b-hf": ("codellama-34b", None),
    "meta-llama/llama-2-70b-hf": ("llama-2-70b", None),
    # The checkpoints' own weight formats: DeepSeek's block FP8, gpt-oss's MXFP4 experts (whatever a row's
    # precision column calls them), Qwen3-235B-A22B-FP8's FP8.
    "deepseek-ai/deepseek-v3": ("deepseek-v3", "fp8"),
    "deepseek-ai/deepseek-r1": ("deepseek-v3", "fp8"),
    "qwen/qwen3-235b-a22b-fp8": ("qwen3-235b-a22b", "fp8"),
    "qwen/qwen3-235b-a22b": ("qwen3-235b-a22b", None),
    "qwen/qwen3-30b-a3b": ("qwen3-30b-a3b", None),
    "qwen/qwen3-8b": ("qwen3-8b", None),
    "openai/gpt-oss-120b": ("gpt-oss-120b", "mxfp4"),
    "openai/gpt-oss-20b": ("gpt-oss-20b", "mxfp4"),
    "moonshotai/kimi-k2-instruct": ("kimi-k2", "fp8"),
    # NVIDIA's NVFP4 quantizations of DeepSeek-R1 and -V3.1 (DeepSeek-V3's architecture).
    "nvidia/deepseek-r1-nvfp4": ("deepseek-v3", "nvfp4"),
    "nvidia/deepseek-v3.1-nvfp4": ("deepseek-v3", "nvfp4"),
}

#: GPU memory vLLM keeps off the KV cache beyond the weights, bytes per GPU: the forward pass's
#: activations at a 2,048-token budget, CUDA graphs and memory outside torch. Source: the one run folder
#: that gives its block count (RTX 4090, Llama-3.1-8B bf16, gpu_memory_utilization 0.9):
#: 25,250,627,584 B x 0.9 - 16,060,522,496 B of weights - 2,588 blocks x 16 tokens x 131,072 B = 1.238e9 B.
ACTIVATION_RESERVE_BYTES = 1.238e9

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16", "fp8": "fp8",
           "auto": "bf16"}


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "")


def model_preset(hf_name: str, dtype: str | None = None) -> tuple[str, str]:
    """Return (our model name or config path, weight dtype) for a run's model name.

    A Hugging Face id maps by MODEL_NAMES, else by reduction onto a preset key ("Qwen/Qwen2.5-7B-Instruct"
    -> "qwen2.5-7b", "meta-llama/Meta-Llama-3.1-70B-Instruct" -> "llama-3.1-70b", "mistralai/Mistral-7B-
    Instruct-v0.3" -> "mistral-7b", "...-FP8" -> fp8 weights) where the reduced name is a preset (or a
    preset's alias); otherwise the name is returned as given (a preset name or a config.json path; the
    cost model then names what it does not know). The qwen3-32b preset is used when the cost model has
    one, else the bundled config (validate/data/qwen3-32b/config.json).

    Raises:
        ValueError: a dtype we do not know (named).
    """
    name, fixed = MODEL_NAMES.get(hf_name.lower(), (hf_name, None))
    if name == hf_name and not hf_name.endswith(".json"):
        name, fixed = resolve_model(hf_name)
        if name == hf_name:
            found = _config_for(hf_name, reduce_model_name(hf_name)[0])
            if found is not None:
                name, fixed = found, reduce_model_name(hf_name)[1]
    if name == "qwen3-32b":
        try:
            get_model("qwen3-32b")
        except CostModelError:
            name = str(resources.files("stallfree.validate").joinpath("data", "qwen3-32b", "config.json"))
    if fixed is not None:
        return name, fixed
    d = _DTYPES.get((dtype or "bf16").lower())
    if d is None:
        raise ValueError(f"dtype {dtype!r}: not one of {', '.join(sorted(_DTYPES))}")
    return name, d


def _config_for(hf_name: str, reduced: str) -> str | None:
    """The copy of a model's config.json that aiconfigurator-core bundles (model_configs/<org>--<name>
    _config.json, the name with or without its suffixes), for a model with neither a preset nor one of
    our configs (stallfree.costmodel.names.resolve_model); None when there is none."""
    try:
        import aiconfigurator_core
    except ImportError:
        return None
    folder = Path(aiconfigurator_core.__file__).parent / "model_configs"
    if not folder.is_dir():
        return None
    wanted = {hf_name.lower().replace("/", "--"), reduced}
    for f in sorted(folder.glob("*_config.json")):
        stem = f.name.removesuffix("_config.json").lower()
        if stem in wanted or stem.split("--", 1)[-1] in wanted:
            return str(f)
    return None


def kv_dtype_of(kv_cache_dtype: str) -> str | None:
    """Our KV dtype for vLLM's --kv-cache-dtype ("auto" -> None: the weights'; "fp8", "fp8_e4m3",
    "fp8_e5m2" -> "fp8"; "bfloat16", "half", ... as the weights' dtypes).

    Raises:
        ValueError: a value we do not know (named).
    """
    k = kv_cache_dtype.lower()
    if k == "auto":
        return None
    if k.startswith("fp8"):
        return "fp8"
    d = _DTYPES.get(k)
    if d is None:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: not auto, fp8* or one of {', '.join(sorted(_DTYPES))}")
    return d


def gpu_preset(device: str) -> str:
    """Return our GPU preset for a device name (gpu_match without the note)."""
    return gpu_match(device)[0]


def derived_kv_tokens(cost: Any, memory_bytes: float, utilization: float, block_size: int) -> int:
    """KV capacity of a run that does not give its block count, tokens (a multiple of block_size):
    (memory x utilization - weights per GPU - ACTIVATION_RESERVE_BYTES) / KV bytes per token per GPU.

    Raises:
        ValueError: no room for one block.
    """
    cost = getattr(cost, "roofline", cost)  # a kernel-priced model keeps its memory figures there
    free = memory_bytes * utilization - cost.weight_bytes_per_gpu - ACTIVATION_RESERVE_BYTES
    blocks = int(free // (cost.kv_bytes_per_token_per_gpu * block_size))
    if blocks < 1:
        raise ValueError(f"no room for KV: {memory_bytes / 1e9:.1f} GB x {utilization} leaves "
                         f"{max(free, 0.0) / 1e9:.2f} GB after the weights and the activation reserve")
    return blocks * block_size


@dataclass(frozen=True, slots=True)
class Pricing:
    """The step pricing of a replay.

    Attributes:
        cost_model: prices a StepPlan (the profile's step terms included).
        base: the cost model without the profile (for its KV figures).
        provenance: what priced the steps, in words.
        profile: the engine profile applied.
        version_note: for a measured run's engine version, which tables' versions priced it and why
            ("" when the run gives no version or today's pricing priced it).
    """

    cost_model: StepCostModel
    base: Any
    provenance: str
    profile: EngineProfile
    version_note: str = ""


def _config(model: str) -> dict[str, Any] | None:
    if not model.endswith(".json"):
        return None
    try:
        data = read_json(model)
    except (OSError, ValueError):  # FileLimitError is a ValueError
        return None  # get_model reports the unreadable file
    if not isinstance(data, dict):
        return None
    # A multimodal checkpoint nests its language model under text_config (Kimi-K2.5, Llama 4): the package's
    # model classes read it there, so the file is handed over whole.
    text = data.get("text_config")
    return data if "num_hidden_layers" in data or (isinstance(text, dict) and "num_hidden_layers" in text) else None


def pricing(model: str, gpu: str, tp: int, dtype: str, profile: EngineProfile | None,
            kernels: str | None = "none", engine_version: str | None = None,
            kv_dtype: str | None = None, ep: int = 1, dp_attention: int = 1) -> Pricing:
    """Return the pricing of `model` on `tp` x `gpu` in `dtype` with `profile`'s terms.

    kernels: "none" (today's pricing: calibrated where the GPU has a calibration, else the floor),
    ENGINE[:VERSION] for the measured kernel tables (stallfree.costmodel.choice.choose_cost_model; a
    config.json model is handed to the tables as is), or None for the commands' default (vLLM's `current`
    tables where the package has the GPU, else today's pricing).
    ep: the run's expert parallelism (a row's moe_ep_size; CostModel's ep).
    dp_attention: the run's data-parallel attention ranks (a row's attention_dp_size; CostModel's dp_attention).
    profile: the engine profile, or None for the one fitted on the engine whose tables priced the steps
    (stallfree.sim.inputs.engine_profile.default_profile; none under today's pricing), as the commands' default.
    engine_version: the measured run's engine version, or None: kernel tables then price its all-reduces
    from the package's table of that version where the system has one (choose_cost_model).
    kv_dtype: the KV cache's dtype, or None for the weights' (choose_cost_model's kv_dtype).

    Raises:
        CostModelError: an unknown model, GPU or dtype, or kernels that cannot be honoured (the reason).
    """
    asked, note = kernels, ""
    if kernels is None and engine_version:
        nearest, note = nearest_served_version(gpu, DEFAULT_ENGINE, engine_version)
        if nearest is not None:
            asked = f"{DEFAULT_ENGINE}:{nearest}"
    try:
        chosen = choose_cost_model(model, gpu, tp=tp, dtype=dtype, kv_dtype=kv_dtype, kernels=asked,
                                   config=_config(model), engine_version=engine_version, ep=ep,
                                   dp_attention=dp_attention)
    except CostModelError as exc:
        if asked == kernels:
            raise
        note += f"; those tables cannot price it ({exc}), so the current ones do"
        chosen = choose_cost_model(model, gpu, tp=tp, dtype=dtype, kv_dtype=kv_dtype, kernels=kernels,
                                   config=_config(model), engine_version=engine_version, ep=ep,
                                   dp_attention=dp_attention)
    base = chosen.cost_model
    if chosen.source.get("kind") == "kernels" and engine_version:
        ar = chosen.source.get("allreduce_version")
        if ar == "nccl":
            ar_line = "all-reduce from NCCL's table"
        elif ar is not None:
            ar_line = f"all-reduce from its {ar} table (the newest at or below {engine_version})"
        else:
            ar_line = "all-reduce from the same tables" if tp > 1 else "no all-reduce (TP 1)"
        note = (note or f"vLLM {engine_version}") + f"; {ar_line}"
    else:
        note = ""
    if profile is None:
        src = chosen.source
        profile = default_profile(src.get("engine") if src.get("kind") == "kernels" else None)
    cm: StepCostModel = base
    if not profile.is_empty:
        cm = ProfiledCostModel(base, profile)
    return Pricing(cm, base, chosen.line.removeprefix("steps priced by ").removeprefix("the "), profile, note)


def nearest_served_version(gpu: str, engine: str, version: str) -> tuple[str | None, str]:
    """For a measured run of `engine` `version` on our GPU preset `gpu`: (the literal version of the
    package's kernel tables to price it with, or None for the `current` slot; the line that says so).

    The package serves GEMM and attention tables of a few versions per system (its version slots:
    `current`, sometimes `next`); a run of another version is priced by the served version nearest to
    it (by release number; `current` on a tie), and the line names both. None and "" when the GPU has
    no tables or the package is missing (today's pricing, which the header names).
    """
    from stallfree.costmodel.kernel_maps import SYSTEMS

    system = SYSTEMS.get(gpu)
    if system is None or not re.search(r"\d", version):
        return None, ""
    try:
        from aiconfigurator_core.sdk import perf_database

        slots = dict(perf_database.get_version_slots(system, engine) or {})
    except Exception:  # noqa: BLE001 - the package missing or its index unreadable: no choice to make
        return None, ""
    if not slots:
        return None, ""

    def num(v: str) -> float:
        parts = [int(n) for n in re.findall(r"\d+", v)[:3]] + [0, 0, 0]
        return parts[0] * 1e6 + parts[1] * 1e3 + parts[2]

    current = str(slots.get("current", next(iter(slots.values()))))
    served = sorted({str(v) for v in slots.values()}, key=num)
    best = min(served, key=lambda v: (abs(num(v) - num(version)), v != current))
    listed = ", ".join(f"{k} {v}" for k, v in slots.items())
    if best == version:
        line = f"vLLM {version}: kernel tables of that version"
    else:
        line = (f"vLLM {version}: no {engine} {version} kernel tables on {system} (served: {listed}); GEMM "
                f"and attention from {best}, the nearest")
    return (None if best == current else best), line


def describe_profile(profile: EngineProfile | None) -> str:
    """The profile's line for a report, or what the default (None) applies."""
    if profile is not None:
        return profile.describe()
    named, _, terms = default_profile(DEFAULT_ENGINE).describe().removeprefix("engine profile ").partition(": ")
    return (f"engine profile: the default: {named} ({terms}) where {DEFAULT_ENGINE}'s kernel tables price a replay, "
            "none where today's pricing does")
