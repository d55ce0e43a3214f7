"""What prices a simulated step: the cost model built from the hardware options (measured kernel tables,
a calibration, the roofline floor or a linear model), with the engine's profile on top, and the model's
context length.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from stallfree._files import read_json
from stallfree.costmodel import CostModelError
from stallfree.costmodel.choice import choose_cost_model
from stallfree.costmodel.model import get_model
from stallfree.costmodel.names import gpu_match, resolve_model
from stallfree.costmodel.roofline import moe_split_problem
from stallfree.sim.inputs.engine_profile import (
    EngineProfileError,
    ProfiledCostModel,
    default_profile,
    load_profile,
)
from stallfree.sim.inputs.options import HardwareOptions, SetupError
from stallfree.sim.run.costs import LinearCostModel, StepCostModel

__all__ = [
    "build_cost_model",
    "build_priced",
    "context_length",
    "default_cost_model",
    "option_words",
    "parse_linear_cost",
]


def option_words(exc: Exception) -> str:
    """An error's message for a SetupError: a cost-model error's fields named as the options, in backticks
    (`tp` 3, `gpu_memory_utilization`), which the commands word as their flags; any other message as it is."""
    return exc.named(lambda field: f"`{field}`") if isinstance(exc, CostModelError) else str(exc)


def parse_linear_cost(text: str) -> LinearCostModel:
    """Return the linear cost model of "BASE_MS,PER_TOKEN_US[,PER_CTX_NS]".

    Raises:
        SetupError: not two or three finite numbers (usage).
    """
    try:
        nums = [float(x) for x in text.split(",")]
        if len(nums) not in (2, 3) or not all(math.isfinite(x) for x in nums):
            raise ValueError("each must be a finite number" if len(nums) in (2, 3) else "")
        return LinearCostModel(nums[0] * 1e-3, nums[1] * 1e-6, (nums[2] if len(nums) == 3 else 0.0) * 1e-9)
    except ValueError as exc:
        detail = f": {exc}" if str(exc) else ""
        raise SetupError(
            f"`linear_cost` wants BASE_MS,PER_TOKEN_US[,PER_CTX_NS], got {text!r}{detail}", usage=True
        ) from None


def build_cost_model(opts: HardwareOptions) -> tuple[StepCostModel, int, str]:
    """Return the cost model, the KV capacity (tokens) and a one-line description of the hardware.

    The KV capacity comes from stallfree.costmodel (model, GPU, TP, dtypes and
    gpu_memory_utilization) unless kv_tokens overrides it; linear_cost replaces the step pricing only.

    Raises:
        SetupError: an unknown model, GPU or dtype, a bad linear_cost, linear_cost with kernels (usage),
            or kernels that cannot be honoured (the message says why).
    """
    cost, kv, hw, _ = build_priced(opts)
    return cost, kv, hw


def build_priced(opts: HardwareOptions) -> tuple[StepCostModel, int, str, dict[str, Any]]:
    """Return build_cost_model's three values and what priced the steps: a dict with `cost_model`
    (a short name: 'kernels', 'calibrated', 'floor' or 'linear') and `cost_model_source` (structured:
    stallfree.costmodel.choice.ChosenCostModel.source).

    Raises:
        SetupError: as build_cost_model.
    """
    if opts.linear_cost and opts.kernels not in (None, "none"):
        raise SetupError(f"`linear_cost` and `kernels`={opts.kernels!r} are exclusive (both price the steps)",
                         usage=True)
    model, gpu, named = _preset_names(opts)
    try:
        # Named as the options (`ep` 3), which the commands word as their flags (--ep 3).
        problem = moe_split_problem(get_model(model), opts.tp, 1, opts.ep, opts.dp_attention, name=lambda f: f"`{f}`")
        if problem is not None:
            raise CostModelError(problem)
        # A linear cost replaces the pricing; the KV capacity still comes from today's cost model.
        kernels = "none" if opts.linear_cost else opts.kernels
        chosen = choose_cost_model(
            model, gpu, tp=opts.tp, dtype=opts.dtype, kv_dtype=opts.kv_dtype, kernels=kernels,
            config=_user_config(model), ep=opts.ep, dp_attention=opts.dp_attention,
        )
        real = chosen.cost_model
        kv = opts.kv_tokens or real.kv_capacity_tokens(gpu_memory_utilization=opts.gpu_memory_utilization)
    except (CostModelError, ValueError) as exc:
        # An unknown model, GPU, dtype or kernel engine/version, or a pricing the tables cannot give:
        # each is an option's value (exit 2, as `stallfree budget` answers the same values); so is a
        # malformed or oversized spec file named by --model or --gpu (docs/install.md, "Exit codes").
        raise SetupError(option_words(exc), usage=True) from None
    hw = f"{opts.model}, {opts.tp} x {opts.gpu}, {opts.dtype}" + (f", KV {opts.kv_dtype}" if opts.kv_dtype else "")
    hw += "".join(f" ({n})" for n in named)
    if opts.ep > 1 or opts.dp_attention > 1:
        hw += f", ep {opts.ep}, dp-attention {opts.dp_attention} ({opts.tp * opts.dp_attention} GPUs)"
    hw += f"; {chosen.line}"
    real, hw, profile = _with_profile(real, hw, opts, chosen.source)
    if opts.linear_cost:
        linear = {"kind": "linear", "chosen_by": "--linear-cost", "formula": opts.linear_cost}
        return (
            parse_linear_cost(opts.linear_cost),
            int(kv),
            f"linear cost {opts.linear_cost} (ms, us/token, ns/context token)",
            {"cost_model": "linear", "cost_model_source": linear,
             "engine_profile": {"name": "none", "chosen_by": "--linear-cost"}},
        )
    return real, int(kv), hw, {"cost_model": chosen.name, "cost_model_source": chosen.source,
                               "engine_profile": profile}


def _with_profile(
    cost: Any, hw: str, opts: HardwareOptions, source: dict[str, Any]
) -> tuple[Any, str, dict[str, Any]]:
    """Wrap `cost` in the options' engine profile, with a note for the header and the profile's record
    for --json (`engine_profile`: name, chosen_by, and the terms in ms / us).

    Without --engine-profile the profile is the one fitted on the engine whose kernel tables priced the
    steps, whether --kernels named it or the default chose it (`source`: the cost model's
    cost_model_source); none under today's pricing.

    Raises:
        SetupError: an unknown profile name.
    """
    try:
        if opts.engine_profile:
            prof, chosen_by = load_profile(opts.engine_profile), "--engine-profile"
        else:
            engine = source.get("engine") if source.get("kind") == "kernels" else None
            prof, chosen_by = default_profile(engine), "default"
    except EngineProfileError as exc:
        raise SetupError(str(exc), usage=True) from None
    record: dict[str, Any] = {"name": prof.name, "chosen_by": chosen_by} | prof.to_json()
    if prof.is_empty:
        if chosen_by == "default" and source.get("kind") == "kernels":
            # Said, so that runs priced by two engines' tables are not compared as if both had one.
            hw += f"; no engine profile fitted for {source.get('engine')} (kernel time only)"
        return cost, hw, record
    note = prof.describe() + (" (the front end added to TTFT and E2E)" if prof.frontend_s else "")
    return ProfiledCostModel(cost, prof), f"{hw}; {note}", record


def _preset_names(opts: HardwareOptions) -> tuple[str, str, list[str]]:
    """The options' model and GPU as our presets (stallfree.costmodel.names: a Hugging Face id such as
    meta-llama/Llama-3.1-8B-Instruct, a device name such as "NVIDIA H100 80GB HBM3"), and a note for each
    name that was mapped ("model meta-llama/... as llama-3.1-8b", with the GPU's nearest-preset note)."""
    model, _ = resolve_model(str(opts.model))
    gpu, gpu_note = gpu_match(str(opts.gpu))
    named = []
    if model != opts.model:
        shown = Path(model).parent.name if model.endswith(".json") else model
        named.append(f"model {opts.model} as {shown}")
    if gpu != opts.gpu:
        named.append(f"GPU {opts.gpu} as {gpu}" + (f": {gpu_note}" if gpu_note else ""))
    return model, gpu, named


def _user_config(model: str) -> dict[str, Any] | None:
    """The user's config.json (a Hugging Face config) to hand to the kernel tables, or None for a
    preset (or a file in our own format, which the tables get written from the ModelSpec)."""
    if not str(model).endswith(".json"):
        return None
    try:
        data = read_json(model)
    except (OSError, ValueError):  # FileLimitError is a ValueError
        return None  # get_model reports the unreadable file with its own message
    if isinstance(data, dict) and "num_hidden_layers" in data and "architectures" in data:
        return data
    return None


def context_length(opts: HardwareOptions) -> tuple[int | None, str]:
    """Return the context length that requests are checked against, tokens, and where it comes from.

    max_model_len when given (as vLLM's --max-model-len), else the model's own (its preset's or its
    config.json's max_position_embeddings); None when the model does not say.

    Raises:
        SetupError: max_model_len < 1, or an unknown model.
    """
    if opts.max_model_len is not None:
        if isinstance(opts.max_model_len, bool) or opts.max_model_len < 1:
            raise SetupError(f"`max_model_len` must be >= 1 token, got {opts.max_model_len!r}", usage=True)
        return opts.max_model_len, "--max-model-len"
    try:
        spec = get_model(_preset_names(opts)[0])
    except CostModelError as exc:
        raise SetupError(str(exc), usage=True) from None  # an unknown model name, as build_priced's
    return spec.context_length, spec.context_length_source


def default_cost_model() -> tuple[StepCostModel, int]:
    """Return the default replica's cost model and KV capacity (tokens): Llama 3.3 70B, 4 x H100 SXM, FP8."""
    cost, kv, _ = build_cost_model(HardwareOptions())
    return cost, kv
