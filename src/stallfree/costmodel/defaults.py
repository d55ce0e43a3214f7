"""The default cost model for a model, GPU and parallelism: calibrated where the GPU carries a
calibration (the shipped A100 fit, or a user's GPU file written by `stallfree calibrate --save-gpu`),
else the roofline floor; with its provenance in words, for report headers.

Imports allowed: the standard library and stallfree.costmodel.

Moving a calibration to another model or tp on the same GPU: the efficiency factors, the all-reduce
latency, the cost per kernel launch (a step launches 10 x L + 1 kernels, so it follows the layers),
per sequence and per step carry over as they are; per_token_s, which on the A100 data stands for the
GEMMs' shortfall from peak, is scaled by the linear FLOPs per token per GPU (2 x N_act / tp) of the
target over those of the calibrated model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from stallfree.costmodel.errors import CostModelWarning
from stallfree.costmodel.hardware import GPUSpec, get_gpu
from stallfree.costmodel.model import ModelSpec, get_model
from stallfree.costmodel.roofline import CostModel

__all__ = ["DefaultCostModel", "default_cost_model"]


@dataclass(frozen=True, slots=True)
class DefaultCostModel:
    """A cost model with where its numbers come from.

    Attributes:
        cost_model: the CostModel.
        calibrated: True when fitted terms price the steps; False for the floor.
        provenance: one line for a report header: 'calibrated (...)' or 'floor (...): latencies are
            lower bounds'.
    """

    cost_model: CostModel
    calibrated: bool
    provenance: str


def default_cost_model(
    model: str | ModelSpec,
    gpu: str | GPUSpec,
    tp: int = 1,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    pp: int = 1,
    ep: int = 1,
    dp_attention: int = 1,
) -> DefaultCostModel:
    """Return the default cost model for (model, gpu, tp, dtype): calibrated if the GPU has a
    calibration, else the floor (efficiency 1.0, no overhead).

    `CostModel(model, gpu, tp, dtype)` itself stays the floor; this is what the simulator, sweep and
    tune use by default. `ep` and `dp_attention` are CostModel's (expert parallelism, data-parallel
    attention ranks of an MoE model).

    Raises:
        CostModelError: an unknown name, or any error of CostModel (tp that does not divide the heads,
            weights that do not fit, ...).
    """
    spec, g = get_model(model), get_gpu(gpu)
    floor = CostModel(spec, g, tp, dtype, kv_dtype, pp=pp, ep=ep, dp_attention=dp_attention)
    cal = g.calibration
    if cal is None:
        return DefaultCostModel(
            floor,
            False,
            f"floor (efficiency 1.0, no overheads; no calibration for {g.key}): latencies are lower bounds",
        )
    kwargs = dict(cal.kwargs)
    moved = []
    target_flops = 2.0 * spec.active_layer_params / tp
    if "per_token_s" in kwargs and cal.linear_flops_per_token_per_gpu > 0:
        scale = target_flops / cal.linear_flops_per_token_per_gpu
        if abs(scale - 1.0) > 1e-9:
            kwargs["per_token_s"] *= scale
            moved.append(f"per-token term x {scale:.3g} from {cal.model} tp {cal.tp}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostModelWarning)  # the floor above already warned
        cm = floor.replace(**kwargs)
    where = f"{cal.source}" + (f"; {'; '.join(moved)}" if moved else "")
    return DefaultCostModel(cm, True, f"calibrated ({where})")
