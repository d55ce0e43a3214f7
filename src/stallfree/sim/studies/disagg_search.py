"""Disaggregated runs as studies: a P:D run built from a Setup (each side's scheduler, behaviour and cost
model), and the search of P:D and each side's token budget for the GPUs at hand.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from stallfree.costmodel import CostModelError
from stallfree.costmodel import default_cost_model as priced_default
from stallfree.costmodel.hardware import DTYPE_BYTES
from stallfree.sim.defaults import (
    DEFAULT_AGGREGATED_BUDGETS,
    DEFAULT_DECODE_BUDGETS,
    DEFAULT_PREFILL_BUDGETS,
    DEFAULT_TOKEN_BUDGET,
)
from stallfree.sim.inputs.options import HardwareOptions, SetupError
from stallfree.sim.inputs.pricing import build_cost_model
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.outputs.disagg_report import disagg_summary
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.disagg import DisaggResult, simulate_disaggregated
from stallfree.sim.run.disagg_link import DEFAULT_INTERCONNECT, INTERCONNECTS, Interconnect
from stallfree.sim.run.result import ClusterError
from stallfree.sim.run.routers import make_router
from stallfree.sim.studies.cluster_study import run_cluster_experiment
from stallfree.sim.studies.experiment import study_header

__all__ = [
    "DEFAULT_AGGREGATED_BUDGETS",
    "DEFAULT_DECODE_BUDGETS",
    "DEFAULT_PREFILL_BUDGETS",
    "run_disagg_experiment",
    "search_plan",
]


def kv_bytes_per_token_of(hardware: HardwareOptions) -> int:
    """KV bytes per token of the model that `hardware` (a setup.HardwareOptions) names, in its KV
    dtype: 2 x layers x kv_heads x head_dim x bytes per element (the whole model, every TP shard).

    Raises:
        SetupError: an unknown model, GPU or dtype.
    """

    try:
        cm = priced_default(hardware.model, hardware.gpu, tp=hardware.tp, dtype=hardware.dtype,
                            kv_dtype=hardware.kv_dtype).cost_model
    except (CostModelError, ValueError) as exc:
        raise SetupError(str(exc)) from None
    return int(cm.model.kv_bytes_per_token(DTYPE_BYTES[cm.kv_dtype]))


def run_disagg_experiment(
    setup: Setup,
    *,
    prefill: int,
    decode: int,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    link: Interconnect | None = None,
    router: str = "least-outstanding",
    budget: int | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    prefill_budget: int | None = None,
    decode_budget: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], DisaggResult]:
    """`stallfree simulate --disaggregate P:D` on a Setup: each side is the setup's replica with its
    own tensor parallelism (KV capacity and step pricing rebuilt for it).

    Args:
        setup: a stallfree.sim.inputs.setup.Setup.
        prefill, decode: replicas on each side, >= 1.
        prefill_tp, decode_tp: GPUs per replica on each side (default: the setup's tp).
        link: the interconnect (default INTERCONNECTS[DEFAULT_INTERCONNECT]).
        router: the router on each side (a name of cluster.ROUTERS).
        budget: token budget per step on both sides (default 2048); check, slo_ttft, slo_tpot: as
            run_experiment.
        prefill_budget, decode_budget: one side's token budget per step (default: budget).

    Returns:
        (header, summary, result): the header (setup.header() plus the disaggregation), the
        disagg_summary (runs[0] of --json) and the DisaggResult.

    Raises:
        ClusterError, SetupError, SimulationError.
    """
    budget = budget or DEFAULT_TOKEN_BUDGET
    budgets = (prefill_budget or budget, decode_budget or budget)
    hw = setup.hardware_options
    sides = _sides(setup, (prefill_tp or hw.tp, decode_tp or hw.tp), budgets)
    link = link or INTERCONNECTS[DEFAULT_INTERCONNECT]
    kvb = kv_bytes_per_token_of(hw)
    res = simulate_disaggregated(
        setup.workload, sides[0][1], sides[1][1], sides[0][0], sides[1][0], prefill, decode, kvb, link,
        make_router(router), make_router(router), setup.workload_options.max_tokens, check, setup.context_length,
        setup.engine_closed_loop,
    )
    summary = disagg_summary(res, len(setup.workload), slo_ttft, slo_tpot)
    _describe_run(summary, setup, prefill, decode, router, budgets, sides)
    header = study_header(setup)
    header.update(
        token_budget=budget, prefill_budget=budgets[0], decode_budget=budgets[1], step_time_target_s=None,
        disaggregate=f"{prefill}:{decode}", router=router,
        prefill_hardware=sides[0][2], decode_hardware=sides[1][2], interconnect=link.name,
        link_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, link_latency_s=link.latency_s,
        kv_bytes_per_token=kvb,
    )
    header["behaviour"], header["disaggregation_not_modelled"] = sides_behaviour(setup)
    return header, summary, res


def sides_behaviour(setup: Setup) -> tuple[str, list[str]]:
    """How each side of a disaggregated run schedules, in words, and what of the setup's scheduling is
    not modelled under disaggregation and so left out on both sides (asynchronous scheduling, prefix
    caching, several partial prefills, a CPU KV tier), each named with where it came from (the pricing
    engine's default or the caller's)."""
    core = setup.scheduler_config
    kv = (f"paged KV in {core.block_size}-token blocks, watermark {core.watermark:g}" if core.kv_policy == "paged"
          else "KV reserved at admission")
    engine = getattr(setup, "engine_behaviour", {}) or {}
    left = []
    for name, on, what in (("async_scheduling", setup.async_scheduling, "asynchronous scheduling"),
                           ("enable_prefix_caching", core.enable_prefix_caching, "prefix caching"),
                           ("max_num_partial_prefills", core.max_num_partial_prefills > 1, "several partial prefills"),
                           ("cpu_kv_tokens", bool(core.cpu_kv_tokens), "a CPU KV tier")):
        if on:
            left.append(f"{what} ({engine[name]['source']})" if name in engine else what)
    text = f"each side: synchronous scheduling, {kv}, no prefix caching"
    if left:
        text += "; not modelled under disaggregation, left out: " + ", ".join(left)
    return text, left


def _describe_run(
    summary: dict[str, Any], setup: Setup, prefill: int, decode: int, router: str, budgets: tuple[int, int],
    sides: list[tuple[StepCostModel, ReplicaConfig, str, int, int]],
) -> None:
    """Add to a P:D run's summary its label, router, GPUs, each side's budget, tp and KV tokens, the
    goodput per GPU and, under closed-loop load, the achieved request rate (requests/s)."""
    closed = setup.closed_loop
    if closed is not None:
        # As a single closed-loop run reports it: requests sent per second over the run.
        dur = summary.get("duration_s")
        summary.update(concurrency=closed.concurrency, think_time_s=closed.think_time,
                       achieved_request_rate=len(setup.workload) / dur if dur else None)
    gpus = prefill * sides[0][3] + decode * sides[1][3]
    summary.update(
        label=f"disagg {prefill}P:{decode}D", router=router, num_gpus=gpus, prefill_budget=budgets[0],
        decode_budget=budgets[1], prefill_tp=sides[0][3],
        decode_tp=sides[1][3], prefill_kv_tokens=sides[0][4], decode_kv_tokens=sides[1][4],
        goodput_per_gpu=summary["request_goodput"] / gpus if summary.get("request_goodput") is not None else None,
    )


def _sides(
    setup: Setup, tps: tuple[int, int], budgets: tuple[int, int]
) -> list[tuple[StepCostModel, ReplicaConfig, str, int, int]]:
    """Per side (prefill, decode): (step pricing, scheduler config, hardware text, tp, KV tokens) of
    the setup's replica rebuilt at that side's tensor parallelism and token budget.

    Raises:
        ClusterError: a budget that is not an integer >= 1. SetupError: as build_cost_model.
    """
    for name, b in zip(("prefill budget", "decode budget"), budgets, strict=True):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ClusterError(f"{name} must be an integer >= 1 tokens, got {b!r}")
    sides = []
    for tp, side_budget in zip(tps, budgets, strict=True):
        cost, kv, desc = build_cost_model(replace(setup.hardware_options, tp=tp))
        core = setup.scheduler_config
        cfg = ReplicaConfig(core.replace(
            kv_tokens=kv, token_budget=side_budget, enable_prefix_caching=False, cpu_kv_tokens=0,
            max_num_partial_prefills=1, max_long_partial_prefills=None, long_prefill_token_threshold=None))
        sides.append((cost, cfg, desc, tp, kv))
    return sides


def _rank(s: dict[str, Any]) -> tuple[float, float]:
    """Goodput per GPU to 0.001 req/s/GPU (finer differences are the last request's finish time),
    then p99 TTFT."""
    return -round(s.get("goodput_per_gpu") or 0.0, 3), s.get("p99_ttft_ms") or math.inf


def _grid(name: str, values: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    out = tuple(default if values is None else values)
    if not out or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in out):
        raise ClusterError(f"{name} must be one or more integers >= 1 tokens, got {values!r}")
    return out


def search_plan(
    setup: Setup,
    replicas: int,
    *,
    slo_ttft: float | None,
    slo_tpot: float | None,
    link: Interconnect | None = None,
    router: str = "least-outstanding",
    aggregated_budgets: Any = None,
    prefill_budgets: Any = None,
    decode_budgets: Any = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """At equal GPU count: the aggregated cluster at each token budget of a small grid, against
    every P:D split (P + D = replicas, same tp on both sides) at each (prefill budget, decode
    budget) of a small grid; all on the setup's workload, one simulation per point, in this process.

    Args:
        setup: a stallfree.sim.inputs.setup.Setup.
        replicas: N >= 2 (each replica has the setup's tp GPUs).
        slo_ttft, slo_tpot: the SLOs goodput counts, s (at least one).
        link, router: as run_disagg_experiment.
        aggregated_budgets, prefill_budgets, decode_budgets: the grids, token budgets per step
            (defaults DEFAULT_AGGREGATED_BUDGETS, DEFAULT_PREFILL_BUDGETS, DEFAULT_DECODE_BUDGETS).

    Returns:
        (aggregated summaries, disaggregated summaries), each best first: the highest goodput per
        GPU (to 0.001 req/s/GPU), then the lower p99 TTFT. Every summary has num_gpus and
        goodput_per_gpu; aggregated ones token_budget, disaggregated ones prefill_budget and
        decode_budget; labels name them. len(aggregated) + (N - 1) * len(prefill) * len(decode)
        simulations.

    Raises:
        ClusterError: replicas < 2, no SLO given, or an empty grid or a budget < 1.
    """

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise ClusterError(f"the P:D search needs `replicas` >= 2 (the GPUs to split), got {replicas!r}")
    if slo_ttft is None and slo_tpot is None:
        raise ClusterError("the P:D search ranks by goodput: give `slo_ttft` and/or `slo_tpot`")
    agg_grid = _grid("aggregated budgets", aggregated_budgets, DEFAULT_AGGREGATED_BUDGETS)
    pre_grid = _grid("prefill budgets", prefill_budgets, DEFAULT_PREFILL_BUDGETS)
    dec_grid = _grid("decode budgets", decode_budgets, DEFAULT_DECODE_BUDGETS)
    aggs = [_aggregated(setup, replicas, router, b, slo_ttft, slo_tpot) for b in agg_grid]
    rows = []
    for p in range(1, replicas):
        for bp in pre_grid:
            for bd in dec_grid:
                _, s, _ = run_disagg_experiment(setup, prefill=p, decode=replicas - p, link=link, router=router,
                                                slo_ttft=slo_ttft, slo_tpot=slo_tpot, prefill_budget=bp,
                                                decode_budget=bd)
                s["label"] = f"disagg {p}P:{replicas - p}D b{bp}/{bd}"
                s["goodput_per_gpu"] = s["goodput_per_gpu"] or 0.0
                rows.append(s)
    aggs.sort(key=_rank)
    rows.sort(key=_rank)
    return aggs, rows


def _aggregated(
    setup: Setup, replicas: int, router: str, budget: int, slo_ttft: float | None, slo_tpot: float | None
) -> dict[str, Any]:
    """The summary of `replicas` aggregated replicas at `budget`, labelled, with its goodput per GPU."""
    gpus = replicas * setup.hardware_options.tp
    study = run_cluster_experiment(setup, replicas=replicas, router=router, budget=budget,
                                   slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    agg = study.summaries[0]
    agg.update(label=f"aggregated x{replicas} b{budget}", num_gpus=gpus, token_budget=budget,
               goodput_per_gpu=(agg.get("request_goodput") or 0) / gpus)
    return agg
