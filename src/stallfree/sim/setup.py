"""Former path of `stallfree.sim.inputs.setup`, kept for one release: import from the new path.

What a simulation is run on, built from typed options: the workload, the cost model, the KV capacity and the
scheduler configs. Every public name this module had is re-exported from where it lives now; the module goes in the
next release.
"""

from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQS, DEFAULT_RATE_SCALE, DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.engine_behaviour import BEHAVIOUR_FIELDS, behaviour_line, engine_defaults
from stallfree.sim.inputs.engine_profile import EngineProfileError, ProfiledCostModel, default_profile, load_profile
from stallfree.sim.inputs.options import (
    DEFAULTS,
    MAX_OFFERED_RATE,
    MAX_SYNTHETIC_REQUESTS,
    HardwareOptions,
    SetupError,
    WorkloadOptions,
    build_workload,
)
from stallfree.sim.inputs.pricing import (
    build_cost_model,
    build_priced,
    context_length,
    default_cost_model,
    parse_linear_cost,
)
from stallfree.sim.inputs.session_traces import is_session_trace, load_sessions
from stallfree.sim.inputs.sessions import SessionWorkload, parse_system_prompt, parse_think_spec, synthetic_sessions
from stallfree.sim.inputs.setup import TIME_BUDGET_CAP, Setup
from stallfree.sim.inputs.synthetic import LengthSpec, parse_length_spec, parse_shared_prefix, shared_prefix, synthetic
from stallfree.sim.inputs.traces import load_bundled, load_mooncake, load_trace
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig, warn_deprecated
from stallfree.sim.run.costs import LinearCostModel, StepCostModel
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.lora import DEFAULT_LORA_RANK, LoraCost, assign_loras, parse_popularity

__all__ = [
    "BEHAVIOUR_FIELDS",
    "ClosedLoop",
    "DEFAULTS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_LORA_RANK",
    "DEFAULT_MAX_SEQS",
    "DEFAULT_RATE_SCALE",
    "DEFAULT_TOKEN_BUDGET",
    "EngineProfileError",
    "HardwareOptions",
    "LengthSpec",
    "LinearCostModel",
    "LoraCost",
    "MAX_OFFERED_RATE",
    "MAX_SYNTHETIC_REQUESTS",
    "ProfiledCostModel",
    "ReplicaConfig",
    "SessionWorkload",
    "Setup",
    "SetupError",
    "StepCostModel",
    "TIME_BUDGET_CAP",
    "Workload",
    "WorkloadOptions",
    "assign_loras",
    "behaviour_line",
    "build_cost_model",
    "build_priced",
    "build_workload",
    "context_length",
    "default_cost_model",
    "default_profile",
    "engine_defaults",
    "is_session_trace",
    "load_bundled",
    "load_mooncake",
    "load_profile",
    "load_sessions",
    "load_trace",
    "parse_length_spec",
    "parse_linear_cost",
    "parse_popularity",
    "parse_shared_prefix",
    "parse_system_prompt",
    "parse_think_spec",
    "shared_prefix",
    "synthetic",
    "synthetic_sessions",
    "warn_deprecated",
]
