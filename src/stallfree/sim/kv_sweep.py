"""Former path of `stallfree.sim.studies.kv_sweep`, kept for one release: import from the new path.

A sweep over KV capacity: one simulation per KV size (prefix caching on or off, as the setup says), answering "how
large must the cache be": the prefix cache hit rate and TTFT p50/p99 against capacity. Every public name this module
had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.experiment import run_experiment
from stallfree.sim.studies.kv_sweep import KV_SWEEP_KEYS, kv_sweep, kv_sweep_lines, kv_sweep_title, preemption_inflated

__all__ = [
    "KV_SWEEP_KEYS",
    "Setup",
    "kv_sweep",
    "kv_sweep_lines",
    "kv_sweep_title",
    "preemption_inflated",
    "run_experiment",
]
