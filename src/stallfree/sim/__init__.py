"""The trace-driven simulator, in sub-packages by job: inputs (workloads, trace readers, the Setup and the
pricing of steps), run (the event loop, replicas, routers; one replica, a cluster, disaggregated prefill and
decode), studies (experiments, sweeps, tuning, capacity and fleet planning) and outputs (summaries, records,
tables, plots, the files under --out); commands holds the CLI over them.

Imports allowed: the standard library, stallfree.core and stallfree.costmodel; numpy, matplotlib
and rich only lazily, inside report and plot functions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.sim.inputs.synthetic import LengthSpec, parse_length_spec, synthetic
    from stallfree.sim.inputs.traces import load_bundled, load_trace
    from stallfree.sim.inputs.workload import TraceError, Workload
    from stallfree.sim.run.baselines import NoChunkScheduler, PrefillFirstScheduler
    from stallfree.sim.run.config import BATCHING_MODES, ReplicaConfig
    from stallfree.sim.run.costs import LinearCostModel, StepCostModel
    from stallfree.sim.run.result import SchedulerLike, SimResult, SimulationError
    from stallfree.sim.run.simulator import simulate

# Each public name and the module it lives in: resolved on first use (PEP 562), so that `stallfree simulate
# --help` (which imports stallfree.sim.commands, so this package first) does not import the simulator.
_HOME = {
    "LengthSpec": "inputs.synthetic",
    "parse_length_spec": "inputs.synthetic",
    "synthetic": "inputs.synthetic",
    "load_bundled": "inputs.traces",
    "load_trace": "inputs.traces",
    "TraceError": "inputs.workload",
    "Workload": "inputs.workload",
    "NoChunkScheduler": "run.baselines",
    "PrefillFirstScheduler": "run.baselines",
    "BATCHING_MODES": "run.config",
    "ReplicaConfig": "run.config",
    "LinearCostModel": "run.costs",
    "StepCostModel": "run.costs",
    "SchedulerLike": "run.result",
    "SimResult": "run.result",
    "SimulationError": "run.result",
    "simulate": "run.simulator",
}

__all__ = [
    "BATCHING_MODES",
    "LengthSpec",
    "LinearCostModel",
    "NoChunkScheduler",
    "PrefillFirstScheduler",
    "ReplicaConfig",
    "SchedulerLike",
    "SimResult",
    "SimulationError",
    "StepCostModel",
    "TraceError",
    "Workload",
    "load_bundled",
    "load_trace",
    "parse_length_spec",
    "simulate",
    "synthetic",
]


def __getattr__(name: str) -> object:
    """`stallfree.sim.SchedulerConfig`, the former name of the replica record: a function with its old
    arguments that returns a ReplicaConfig (legacy_scheduler_config), warning once. Removed in the next
    release; the core's configuration is stallfree.SchedulerConfig."""
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
        globals()[name] = value
        return value
    if name == "SchedulerConfig":
        from stallfree.sim.run.config import legacy_scheduler_config, warn_deprecated

        warn_deprecated("stallfree.sim.SchedulerConfig",
                        "stallfree.sim.ReplicaConfig (holding a stallfree.SchedulerConfig)")
        return legacy_scheduler_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
