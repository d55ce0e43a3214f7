"""How a measured run's names map onto the cost model's: Hugging Face model names and GPU names onto
our presets (tables, not string rewrites), the KV capacity of a run that does not give it, and the step
pricing with an engine profile.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from stallfree.costmodel import CostModelError
from stallfree.costmodel.choice import DEFAULT_ENGINE, choose_cost_model
from stallfree.costmodel.model import get_model
from stallfree.sim.costs import StepCostModel
from stallfree.sim.engine_profile import EngineProfile, ProfiledCostModel, default_profile

__all__ = [
    "ACTIVATION_RESERVE_BYTES",
    "GPU_NAMES",
    "MODEL_NAMES",
    "Pricing",
    "derived_kv_tokens",
    "describe_profile",
    "gpu_preset",
    "model_preset",
    "pricing",
]

#: Hugging Face model names (lower case) -> (our model name, the weights' dtype when the name fixes it).
#: A name missing here is tried as our own model name or a config.json path.
MODEL_NAMES: dict[str, tuple[str, str | None]] = {
    "meta-llama/llama-3.1-8b": ("llama-3.1-8b", None),
    "meta-llama/llama-3.1-8b-instruct": ("llama-3.1-8b", None),
    "meta-llama/meta-llama-3.1-8b": ("llama-3.1-8b", None),
    "meta-llama/meta-llama-3.1-8b-instruct": ("llama-3.1-8b", None),
    "nvidia/llama-3.1-8b-instruct-fp8": ("llama-3.1-8b", "fp8"),
    "meta-llama/llama-3.1-70b": ("llama-3.1-70b", None),
    "meta-llama/llama-3.1-70b-instruct": ("llama-3.1-70b", None),
    "meta-llama/meta-llama-3.1-70b": ("llama-3.1-70b", None),
    "meta-llama/llama-3.3-70b-instruct": ("llama-3.3-70b", None),
    "qwen/qwen3-32b": ("qwen3-32b", None),
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
}

#: GPU names as runs and benchmark rows spell them (lower case, '-' and '_' alike, spaces removed) -> our preset.
GPU_NAMES: dict[str, str] = {
    "nvidiageforcertx4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "rtxpro6000": "rtx-pro-6000",
    "nvidiartxpro6000blackwellserveredition": "rtx-pro-6000",
    "nvidiartxpro6000blackwellworkstationedition": "rtx-pro-6000",
    "rtxpro6000server": "rtx-pro-6000",
    "h100sxm": "h100-sxm",
    "nvidiah10080gbhbm3": "h100-sxm",
    "h200sxm": "h200",
    "nvidiah200": "h200",
    "b200sxm": "b200",
    "a100sxm": "a100-sxm-80gb",
    "nvidiaa100sxm480gb": "a100-sxm-80gb",
    "l40s": "l40s",
    "nvidial40s": "l40s",
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

    The qwen3-32b preset is used when the cost model has one, else the bundled config
    (validate/data/qwen3-32b/config.json).

    Raises:
        ValueError: a dtype we do not know (named).
    """
    name, fixed = MODEL_NAMES.get(hf_name.lower(), (hf_name, None))
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


def gpu_preset(device: str) -> str:
    """Return our GPU preset for a device name ("NVIDIA GeForce RTX 4090", "RTXPRO6000", "h200_sxm", ...);
    a name missing from GPU_NAMES is returned as given (our own preset names pass through)."""
    return GPU_NAMES.get(_key(device).replace("-", ""), device)


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
    """

    cost_model: StepCostModel
    base: Any
    provenance: str
    profile: EngineProfile


def _config(model: str) -> dict[str, Any] | None:
    if not model.endswith(".json"):
        return None
    try:
        data = json.loads(Path(model).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # get_model reports the unreadable file
    return data if isinstance(data, dict) and "num_hidden_layers" in data else None


def pricing(model: str, gpu: str, tp: int, dtype: str, profile: EngineProfile | None,
            kernels: str | None = "none", engine_version: str | None = None, ep: int = 1) -> Pricing:
    """Return the pricing of `model` on `tp` x `gpu` in `dtype` with `profile`'s terms.

    kernels: "none" (today's pricing: calibrated where the GPU has a calibration, else the floor),
    ENGINE[:VERSION] for the measured kernel tables (stallfree.costmodel.choice.choose_cost_model; a
    config.json model is handed to the tables as is), or None for the commands' default (vLLM's `current`
    tables where the package has the GPU, else today's pricing).
    ep: the run's expert parallelism (a row's moe_ep_size; CostModel's ep).
    profile: the engine profile, or None for the one fitted on the engine whose tables priced the steps
    (stallfree.sim.engine_profile.default_profile; none under today's pricing), as the commands' default.
    engine_version: the measured run's engine version, or None: kernel tables then price its all-reduces
    from the package's table of that version where the system has one (choose_cost_model).

    Raises:
        CostModelError: an unknown model, GPU or dtype, or kernels that cannot be honoured (the reason).
    """
    chosen = choose_cost_model(model, gpu, tp=tp, dtype=dtype, kernels=kernels, config=_config(model),
                               engine_version=engine_version, ep=ep)
    base = chosen.cost_model
    if profile is None:
        src = chosen.source
        profile = default_profile(src.get("engine") if src.get("kind") == "kernels" else None)
    cm: StepCostModel = base
    if not profile.is_empty:
        cm = ProfiledCostModel(base, profile)
    return Pricing(cm, base, chosen.line.removeprefix("steps priced by ").removeprefix("the "), profile)


def describe_profile(profile: EngineProfile | None) -> str:
    """The profile's line for a report, or what the default (None) applies."""
    if profile is not None:
        return profile.describe()
    named, _, terms = default_profile(DEFAULT_ENGINE).describe().removeprefix("engine profile ").partition(": ")
    return (f"engine profile: the default: {named} ({terms}) where {DEFAULT_ENGINE}'s kernel tables price a replay, "
            "none where today's pricing does")
