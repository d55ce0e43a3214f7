"""Former path of `stallfree.sim.inputs.workload`, kept for one release: import from the new path.

Workloads for the simulator: real request traces (Azure LLM 2023, BurstGPT, generic CSV/JSONL), synthetic arrivals
(Poisson, Gamma) with length distributions, a shared-prefix synthetic workload, and rate/window/head transforms.
Every public name this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.synthetic import (
    MAX_LENGTH,
    LengthSpec,
    parse_length_spec,
    parse_shared_prefix,
    shared_prefix,
    synthetic,
)
from stallfree.sim.inputs.traces import (
    BUNDLED_TRACE,
    MOONCAKE_TRACE,
    TRACE_FORMATS,
    load_bundled,
    load_mooncake,
    load_trace,
)
from stallfree.sim.inputs.workload import (
    MAX_ARRIVAL_S,
    MAX_ARRIVAL_SPAN_S,
    MOONCAKE_BLOCK,
    TraceError,
    TraceFileError,
    Workload,
    check_block_size,
)

__all__ = [
    "BUNDLED_TRACE",
    "LengthSpec",
    "MAX_ARRIVAL_S",
    "MAX_ARRIVAL_SPAN_S",
    "MAX_LENGTH",
    "MOONCAKE_BLOCK",
    "MOONCAKE_TRACE",
    "TRACE_FORMATS",
    "TraceError",
    "TraceFileError",
    "Workload",
    "check_block_size",
    "load_bundled",
    "load_mooncake",
    "load_trace",
    "parse_length_spec",
    "parse_shared_prefix",
    "shared_prefix",
    "synthetic",
]
