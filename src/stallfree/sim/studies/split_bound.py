"""The capacity bound of disaggregated P:D splits: each side's saturated throughput, the fewest replicas
each side needs at the mean rate, and the splits of a replica count in the order plan tries them
(stallfree.sim.studies.capacity, step 4).

Imports allowed: the standard library and stallfree.sim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stallfree.sim.inputs.setup import Setup
from stallfree.sim.run.simulator import SATURATION_SAMPLE, saturated_throughput, saturation_sample

__all__ = ["SplitBound", "split_bound", "split_order"]


@dataclass(frozen=True, slots=True)
class SplitBound:
    """The capacity bound of P:D splits on a workload (module docstring, step 4).

    Attributes:
        prefill_capacity: mu_p, one prefill replica's saturated throughput, requests/s.
        decode_capacity: mu_d, one decode replica's, requests/s.
        offered_rate: the workload's mean arrival rate, requests/s.
    """

    prefill_capacity: float
    decode_capacity: float
    offered_rate: float

    @property
    def p_min(self) -> int:
        """The fewest prefill replicas whose capacity covers the mean rate: ceil(rate / mu_p), >= 1."""
        return _replicas_for(self.offered_rate, self.prefill_capacity)

    @property
    def d_min(self) -> int:
        """The fewest decode replicas whose capacity covers the mean rate: ceil(rate / mu_d), >= 1."""
        return _replicas_for(self.offered_rate, self.decode_capacity)

    @property
    def share(self) -> float:
        """The balanced prefill share P / N, both sides equally loaded: (1/mu_p) / (1/mu_p + 1/mu_d)."""
        wp = 1 / self.prefill_capacity if self.prefill_capacity > 0 else math.inf
        wd = 1 / self.decode_capacity if self.decode_capacity > 0 else math.inf
        if math.isinf(wp) or math.isinf(wd):
            return 0.5
        return wp / (wp + wd)


def _replicas_for(rate: float, capacity: float) -> int:
    """ceil(rate / capacity) replicas, at least 1 (1 when either figure is not finite and positive)."""
    if not (math.isfinite(rate) and math.isfinite(capacity) and capacity > 0 and rate > 0):
        return 1
    # 1e-9: a rate that is an exact multiple of the capacity needs that multiple, not one more.
    return max(1, math.ceil(rate / capacity - 1e-9))


def split_order(replicas: int, bound: SplitBound | None) -> list[int]:
    """The prefill counts P of the P:D splits of `replicas` that the bound allows (P >= p_min and
    replicas - P >= d_min), nearest the balanced share (bound.share x replicas) first, ties to the
    smaller P; every P in 1..replicas-1 without a bound; [] below 2 replicas."""
    if replicas < 2:
        return []
    lo, hi = (1, replicas - 1) if bound is None else (bound.p_min, replicas - bound.d_min)
    target = replicas * (0.5 if bound is None else bound.share)
    return sorted(range(max(1, lo), min(replicas - 1, hi) + 1), key=lambda p: (abs(p - target), p))


def split_bound(setup: Setup, budget: int, side_budgets: tuple[int, int] | None = None) -> SplitBound:
    """Each side's saturated throughput on the setup's workload (module docstring, step 4).

    The prefill side replays the prompts with one output token each; the decode side the outputs after
    the first (a 1-token prompt, target - 1 to generate) priced at their true context (prompt_len more),
    both as stallfree.sim.run.disagg builds its sides, all arriving at 0 s (simulator.saturated_throughput).
    Both are upper bounds of what a side sustains in the P:D simulation: the decode side's KV here counts
    a request's outputs only (the split's gate also holds its prompt's KV), so more requests batch; a
    bound that is high lowers P_min or D_min and costs simulations, never a split that could pass.

    Args:
        setup: a stallfree.sim.inputs.setup.Setup.
        budget: token budget per step on both sides, tokens.
        side_budgets: (prefill, decode) budgets instead, tokens, or None.

    Returns:
        A SplitBound.

    Raises:
        SetupError, SimulationError: as the simulations.
    """
    from stallfree.sim.inputs.workload import Workload
    from stallfree.sim.run.disagg import _ShiftedCost
    from stallfree.sim.studies.disagg_search import _sides

    # The requests saturated_throughput times, in its order: a workload of exactly SATURATION_SAMPLE
    # requests is timed whole, so rid i of each side's burst is request i of wl.
    wl = setup.workload.take(saturation_sample(len(setup.workload), SATURATION_SAMPLE))
    opts = setup.workload_options
    tp = setup.hardware_options.tp
    (pcost, pcfg, *_), (dcost, dcfg, *_) = _sides(setup, (tp, tp), side_budgets or (budget, budget))
    n = len(wl)
    target = [o if opts.max_tokens is None else min(o, opts.max_tokens) for o in wl.output_lens]
    prefill = Workload(wl.arrivals, wl.prompt_lens, (1,) * n, wl.name)
    decode = Workload(wl.arrivals, (1,) * n, tuple(max(t - 1, 1) for t in target), wl.name)
    offset: dict[Any, int] = dict(enumerate(wl.prompt_lens))
    mu_p = saturated_throughput(prefill, pcfg, pcost, None, max_model_len=setup.context_length,
                                cut_output_to_fit=opts.cut_output_to_fit)
    mu_d = saturated_throughput(decode, dcfg, _ShiftedCost(dcost, offset), None)
    return SplitBound(mu_p, mu_d, setup.workload.mean_rate)
