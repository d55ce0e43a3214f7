"""The default replica that the commands price when no --model, --gpu, --tp or --dtype is given
(`simulate`, `sweep`, `tune`, `plan` and `budget`): Llama 3.3 70B on 4 x H100 SXM in FP8.

Imports allowed: none (a leaf that every subpackage's CLI may import, so that `budget`, in the cost
model, and the simulator's commands share one default without the cost model importing the simulator).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_REPLICA"]

#: The default replica: model, GPU, tensor-parallel GPUs and weight dtype.
DEFAULT_REPLICA: dict[str, Any] = {"model": "llama-3.3-70b", "gpu": "h100-sxm", "tp": 4, "dtype": "fp8"}
