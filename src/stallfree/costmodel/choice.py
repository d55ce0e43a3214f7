"""Which cost model prices a command's steps (choose_cost_model): the measured kernel tables of an
engine (`--kernels ENGINE[:VERSION]`), today's pricing (`--kernels none`: calibrated where the GPU has
a calibration, else the floor), or, when `--kernels` is not given, the engine's `current` tables
where the package is installed and has the GPU, else today's pricing with the reason.

Imports allowed: the standard library and stallfree.costmodel.

The library's default_cost_model keeps its behaviour; only the commands call this.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from stallfree.costmodel.defaults import default_cost_model
from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.hardware import GPUSpec, get_gpu
from stallfree.costmodel.kernel_maps import parse_kernels
from stallfree.costmodel.model import ModelSpec, get_model

__all__ = ["DEFAULT_ENGINE", "ChosenCostModel", "choose_cost_model"]

#: The engine whose tables price the steps when --kernels is not given.
DEFAULT_ENGINE = "vllm"


@dataclass(frozen=True, slots=True)
class ChosenCostModel:
    """A cost model chosen for a command, with what it is and why.

    Attributes:
        cost_model: a KernelCostModel or a roofline CostModel (both have step_time and
            kv_capacity_tokens).
        name: short, for --json's `cost_model`: 'kernels', 'calibrated' or 'floor'.
        source: structured, for --json's `cost_model_source`: kind, chosen_by ('--kernels' or
            'default'), and for kernels engine, version, requested_version, system, package and
            package_version; for the others calibrated (bool) and, when the default fell back from the
            kernels, fallback_reason.
        line: one line for a report header saying what priced the steps.
    """

    cost_model: Any
    name: str
    source: dict[str, Any]
    line: str


def _package_version() -> str | None:
    try:
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return None


def _today(
    spec: ModelSpec, gpu: GPUSpec, tp: int, dtype: str, kv_dtype: str | None, chosen_by: str, reason: str | None,
    ep: int = 1, dp_attention: int = 1,
) -> ChosenCostModel:
    d = default_cost_model(spec, gpu, tp=tp, dtype=dtype, kv_dtype=kv_dtype, ep=ep, dp_attention=dp_attention)
    name = "calibrated" if d.calibrated else "floor"
    source: dict[str, Any] = {"kind": name, "chosen_by": chosen_by, "calibrated": d.calibrated,
                              "provenance": d.provenance}
    line = f"steps priced by the {d.provenance}"
    if reason is not None:
        source["fallback_reason"] = reason
        line += f" (no measured kernels: {reason})"
    return ChosenCostModel(d.cost_model, name, source, line)


def choose_cost_model(
    model: str | ModelSpec,
    gpu: str | GPUSpec,
    tp: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    kernels: str | None = None,
    config: dict[str, Any] | None = None,
    engine_version: str | None = None,
    ep: int = 1,
    dp_attention: int = 1,
) -> ChosenCostModel:
    """Return the cost model a command prices its steps with.

    Args:
        model, gpu, tp, dtype, kv_dtype: the replica (as default_cost_model).
        kernels: 'vllm', 'sglang', 'trtllm' with an optional ':VERSION' (a slot or a literal
            version), 'none' for today's pricing, or None for the default (DEFAULT_ENGINE's
            `current` tables where they exist, else today's pricing, with the reason in `line`).
        config: the model's config.json (a user's file) to hand to the package, or None to write one
            from the preset.
        engine_version: the engine version of a measured run being replayed, or None; the kernel
            tables then price its all-reduces from the package's table of that version where the
            system has one (KernelCostModel's comm_version).
        ep, dp_attention: expert parallelism and data-parallel attention ranks of an MoE model
            (CostModel's; the kernel tables price both: KernelCostModel's module docstring).

    Raises:
        CostModelError: a bad `kernels` value; `kernels` given (not 'none') and it cannot be
            honoured (KernelsUnavailable: no package, no tables for the GPU or engine, a version not
            served, with the reason); or any error of the cost models (unknown names, tp, memory).
    """
    spec, g = get_model(model), get_gpu(gpu)
    chosen_by = "default" if kernels is None else "--kernels"
    engine, ver = parse_kernels(kernels) if kernels is not None else (DEFAULT_ENGINE, "current")
    if engine == "none":
        return _today(spec, g, tp, dtype, kv_dtype, chosen_by, None, ep, dp_attention)
    from stallfree.costmodel.kernels import KernelCostModel, kernels_installed

    if kernels is None and not kernels_installed():
        reason = "the optional package aiconfigurator-core is not installed"
        return _today(spec, g, tp, dtype, kv_dtype, chosen_by, reason, ep, dp_attention)
    try:
        km = KernelCostModel(spec, g, tp, dtype, kv_dtype, engine, ver, config, engine_version, ep=ep,
                             dp_attention=dp_attention)
    except CostModelError as exc:
        if kernels is not None:
            raise
        return _today(spec, g, tp, dtype, kv_dtype, chosen_by, str(exc), ep, dp_attention)
    source = {
        "kind": "kernels", "chosen_by": chosen_by, "engine": engine, "version": km.version,
        "requested_version": ver, "system": km.tables.system, "package": "aiconfigurator-core",
        "package_version": _package_version(),
    }
    if km.comm_table is not None:
        source["allreduce_version"] = km.comm_table
    return ChosenCostModel(km, "kernels", source, f"steps priced by {km.description}")
