"""Former path of `stallfree.sim.run.lora`, kept for one release: import from the new path.

LoRA adapters in the simulator: which adapter each request names (a trace's `lora` column, or drawn with Zipf
popularity), where each replica keeps its adapters (GPU slots and a CPU cache), what loading one costs, and the
report's figures. Every public name this module had is re-exported from where it lives now; the module goes in the
next release.
"""

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.lora import (
    DEFAULT_LORA_RANK,
    STORAGE_READ_BPS,
    AdapterCache,
    LoraCost,
    assign_loras,
    lora_summary,
    parse_popularity,
)
from stallfree.sim.run.result import SimResult

__all__ = [
    "AdapterCache",
    "DEFAULT_LORA_RANK",
    "LoraCost",
    "STORAGE_READ_BPS",
    "SimResult",
    "StepCostModel",
    "Workload",
    "assign_loras",
    "lora_summary",
    "parse_popularity",
]
