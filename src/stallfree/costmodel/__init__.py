"""The cost model: a step's time in seconds from its tokens, per model, GPU, dtype and tensor parallelism.

Imports allowed: the standard library and stallfree.core; nothing else from stallfree. The optional
package aiconfigurator-core only lazily, inside kernels.py (never at import).

Public names: CostModel (step_time, decode_step_time, prefill_step_time, kv_capacity_tokens,
max_tokens_within), default_cost_model (calibrated where the GPU has a calibration, else the floor,
with its provenance), the specs GPUSpec and ModelSpec with their presets (get_gpu, get_model, list_gpus,
list_models), the errors CostModelError and CostModelWarning, and calibration (calibrate.py).
Measured kernels: kernels.KernelCostModel (steps priced from aiconfigurator-core's tables),
kernel_maps (our names onto the package's), choice.choose_cost_model (what the commands price with).
"""

from stallfree.costmodel.defaults import DefaultCostModel, default_cost_model
from stallfree.costmodel.errors import (
    CostModelDataError,
    CostModelError,
    CostModelFileError,
    CostModelMemoryError,
    CostModelWarning,
)
from stallfree.costmodel.hardware import GPUSpec, get_gpu, list_gpus, load_gpu_file
from stallfree.costmodel.model import ModelSpec, get_model, list_models, load_model_file, model_from_hf_config
from stallfree.costmodel.roofline import CostModel, StepCost

__all__ = [
    "CostModel",
    "CostModelDataError",
    "CostModelError",
    "CostModelFileError",
    "CostModelMemoryError",
    "CostModelWarning",
    "DefaultCostModel",
    "GPUSpec",
    "ModelSpec",
    "StepCost",
    "default_cost_model",
    "get_gpu",
    "get_model",
    "list_gpus",
    "list_models",
    "load_gpu_file",
    "load_model_file",
    "model_from_hf_config",
]
