"""Former path of `stallfree.sim.outputs.plots`, kept for one release: import from the new path.

PNG plots of simulations: TTFT/TPOT CDFs, KV utilisation and load over time, and the sweep's p99 TPOT against p99
TTFT trade-off, and the tune's goodput and p99 TPOT against the budget. Every public name this module had is re-
exported from where it lives now; the module goes in the next release.
"""

from stallfree.sim.outputs.plots import (
    LOG_SPAN,
    axis_scale,
    place_labels,
    plot_cdf_series,
    plot_cdfs,
    plot_context,
    plot_replica_timeline,
    plot_sweep_cdfs,
    plot_timeline,
    plot_tradeoff,
)
from stallfree.sim.outputs.report import latency_arrays
from stallfree.sim.outputs.study_plots import chosen_label, plot_kv_sweep, plot_plan_costs, plot_tune
from stallfree.sim.run.config import BATCHING_MODES
from stallfree.sim.run.result import SimResult

__all__ = [
    "BATCHING_MODES",
    "LOG_SPAN",
    "SimResult",
    "axis_scale",
    "chosen_label",
    "latency_arrays",
    "place_labels",
    "plot_cdf_series",
    "plot_cdfs",
    "plot_context",
    "plot_kv_sweep",
    "plot_plan_costs",
    "plot_replica_timeline",
    "plot_sweep_cdfs",
    "plot_timeline",
    "plot_tradeoff",
    "plot_tune",
]
