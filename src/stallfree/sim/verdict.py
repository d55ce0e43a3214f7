"""Former path of `stallfree.sim.outputs.verdict`, kept for one release: import from the new path.

Verdict lines: what a comparison bought or cost, by how much, and whether that exceeds the run's own noise. Every
public name this module had is re-exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.outputs.report import latency_arrays
from stallfree.sim.outputs.verdict import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    FIGURES,
    bootstrap_diff,
    compare_verdict,
    disagg_verdict,
    mean_error_interval,
    paired_figures,
    validate_verdict,
)

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "FIGURES",
    "bootstrap_diff",
    "compare_verdict",
    "disagg_verdict",
    "latency_arrays",
    "mean_error_interval",
    "paired_figures",
    "validate_verdict",
]
