"""Former path of `stallfree.sim.studies.tier_sweep`, kept for one release: import from the new path.

A sweep over the size of a CPU KV tier (prefix caching on, the GPU cache fixed): one simulation per tier size,
answering "how much host memory is worth adding for KV": the hit rate by tier and TTFT p50/p99 against the tier's
tokens (and the host memory they take). Every public name this module had is re-exported from where it lives now;
the module goes in the next release.
"""

from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.experiment import run_experiment
from stallfree.sim.studies.tier_sweep import TIER_SWEEP_KEYS, plot_tier_sweep, tier_sweep, tier_sweep_lines

__all__ = [
    "Setup",
    "TIER_SWEEP_KEYS",
    "plot_tier_sweep",
    "run_experiment",
    "tier_sweep",
    "tier_sweep_lines",
]
