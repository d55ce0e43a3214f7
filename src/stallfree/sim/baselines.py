"""Former path of `stallfree.sim.run.baselines`, kept for one release: import from the new path.

Baseline schedulers without chunked prefill, to compare against the contract on the same workload. Every public name
this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.run.baselines import NoChunkScheduler, PrefillFirstScheduler

__all__ = [
    "NoChunkScheduler",
    "PrefillFirstScheduler",
]
