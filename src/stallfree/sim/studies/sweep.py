"""Sweeps: one simulation per (batching mode, rate scale, token budget), run in worker processes,
as rows (stallfree.sim.outputs.writers writes them as CSV, JSON and plots; the command,
stallfree.sim.commands.sweep, prints the table).

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim
(below stallfree.sim.outputs.writers and plots); numpy lazily (the summaries).

Example (two budgets, chunked batching only, on the first 500 requests of the bundled trace)::

    from stallfree.sim.inputs.setup import HardwareOptions, Setup, WorkloadOptions
    from stallfree.sim.studies.sweep import sweep

    setup = Setup(WorkloadOptions(num_requests=500), HardwareOptions())
    result = sweep(setup, [512, 2048], batching=["chunked"], slo_ttft=1.0, slo_tpot=0.05)
    for row in result.table_rows:
        print(row["token_budget"], row["p99_tpot_ms"], row["request_goodput"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

from stallfree.sim.inputs.options import scaled_workload
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import latency_arrays, summarize_result
from stallfree.sim.run.config import BATCHING_MODES, ReplicaConfig
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.simulator import simulate
from stallfree.sim.studies.executors import Executor
from stallfree.sim.studies.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, error_model, run_range

__all__ = ["ROW_KEYS", "SweepPoint", "SweepResult", "run_points", "sweep"]

ROW_KEYS = (
    "batching",
    "rate_scale",
    "token_budget",
    "completed",
    "rejected",
    "rejected_by_reason",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
    "p99_e2el_ms",
    "p99_queue_ms",
    "budget_utilization",
    "mean_kv_utilization",
    "num_steps",
    "sim_wall_s",
)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One configuration of a sweep; picklable, so that a worker process can run it.

    Args:
        workload: the requests at their own rate.
        rate_scale: replay speed-up (> 0).
        config: the scheduler.
        cost_model: prices each step, s.
        max_tokens: every request's max_new, or None for its output length.
        slo_ttft: TTFT objective, s, or None.
        slo_tpot: TPOT objective, s, or None.
        max_model_len: the context length requests are checked against, tokens, or None.
        cut_output_to_fit: cut max_new to fit the context length instead of refusing the request.
    """
    workload: Workload
    rate_scale: float
    config: ReplicaConfig
    cost_model: StepCostModel
    max_tokens: int | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    max_model_len: int | None = None
    cut_output_to_fit: bool = False


def _run_point(point: SweepPoint) -> dict[str, Any]:
    """Worker: simulate one point; return its summary plus TTFT and TPOT samples (ms, numpy)."""

    res = simulate(
        point.workload.scale_rate(point.rate_scale),
        point.config,
        point.cost_model,
        point.max_tokens,
        max_model_len=point.max_model_len,
        cut_output_to_fit=point.cut_output_to_fit,
    )
    summary = summarize_result(res, point.slo_ttft, point.slo_tpot)
    summary["rate_scale"] = point.rate_scale
    lat = latency_arrays(res)
    summary["ttft_ms"] = lat["ttft"] * 1e3
    summary["tpot_ms"] = lat["tpot"] * 1e3
    return summary


def run_points(
    points: Sequence[SweepPoint], jobs: int | Executor = 1, progress: Callable[[int], None] | None = None
) -> list[dict[str, Any]]:
    """Simulate every point (in `jobs` processes when jobs > 1), in the order given.

    Args:
        points: the configurations.
        jobs: worker processes (1 runs in this process), or a stallfree.sim.studies.executors executor
            (serial, process pool or Ray tasks).
        progress: called with the number of points finished so far, after each one.

    Returns:
        Per point, the summary of report.summarize_result plus rate_scale, ttft_ms and tpot_ms
        (numpy arrays of the per-request samples).
    """
    if not isinstance(jobs, int):
        return jobs.map(_run_point, points, progress)
    out: list[dict[str, Any] | None] = [None] * len(points)
    if jobs <= 1 or len(points) <= 1:
        for k, point in enumerate(points):
            out[k] = _run_point(point)
            if progress:
                progress(k + 1)
    else:
        # Imported here: multiprocessing costs tens of ms that a one-process run never needs.

        with ProcessPoolExecutor(max_workers=min(jobs, len(points))) as pool:
            futures = {pool.submit(_run_point, p): k for k, p in enumerate(points)}
            for done, fut in enumerate(as_completed(futures), start=1):
                out[futures[fut]] = fut.result()
                if progress:
                    progress(done)
    return [o for o in out if o is not None]


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What a sweep found.

    Attributes:
        header: the report's header (Setup.header).
        rows: per point, in grid order (rate scale, then batching mode, then budget), the summary
            of report.summarize_result plus rate_scale, ttft_ms and tpot_ms (numpy arrays of the
            per-request samples, ms).
        table_rows: the same points reduced to ROW_KEYS (JSON-ready, no arrays).
    """
    header: dict[str, Any]
    rows: list[dict[str, Any]]
    table_rows: list[dict[str, Any]]


def sweep(
    setup: Setup,
    budgets: Sequence[int],
    *,
    batching: Sequence[str] = BATCHING_MODES,
    rate_scales: Sequence[float] | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    jobs: int | Executor = 1,
    progress: Callable[[int, int], None] | None = None,
    ranges: bool = False,
) -> SweepResult:
    """Simulate every (rate scale, batching mode, token budget) of the grid on the setup's workload.

    Args:
        setup: the workload (its base rate is scaled by each rate scale), cost model and options.
        budgets: token budgets, tokens (each >= 1).
        batching: modes of BATCHING_MODES.
        rate_scales: replay speed-ups, or None for the setup's own.
        slo_ttft: TTFT objective for goodput, s, or None.
        slo_tpot: TPOT objective for goodput, s, or None.
        jobs: worker processes (1 runs in this process), or an executor (run_points).
        progress: called with (finished, total) points after each one.
        ranges: replay every point twice more with each step scaled by stallfree.sim.studies.ranges'
            STEP_TIME_LOW and STEP_TIME_HIGH, and give each row (and table row) its "range" (3x the work).

    Returns:
        A SweepResult, its rows in grid order.

    Raises:
        ValueError: an empty grid, a budget < 1 or an unknown batching mode.
        SetupError (usage): a rate scale past the bounds of one simulation (scaled_workload: the offered rate,
            the arrivals' span).
    """
    if not budgets or not batching:
        raise ValueError(
            f"a sweep needs at least one budget and one batching mode, got {list(budgets)}, {list(batching)}"
        )
    scales = list(rate_scales) if rate_scales else [setup.rate_scale]
    for scale in scales if rate_scales else ():  # each as bounded as the setup's own, before any point runs
        scaled_workload(setup.base_workload, scale, setup.workload_options, "rate_scales")
    points = [
        SweepPoint(
            setup.base_workload,
            scale,
            setup.config(mode, budget),
            setup.cost_model,
            setup.workload_options.max_tokens,
            slo_ttft,
            slo_tpot,
            setup.context_length,
            setup.workload_options.cut_output_to_fit,
        )
        for scale in scales
        for mode in batching
        for budget in budgets
    ]
    n = len(points)
    if ranges:
        points += [replace(p, cost_model=ScaledCost(p.cost_model, f)) for f in (STEP_TIME_LOW, STEP_TIME_HIGH)
                   for p in points[:n]]
    total = len(points)
    rows = run_points(points, jobs, (lambda k: progress(k, total)) if progress else None)
    header = setup.header()
    if ranges:
        low, high = rows[n:2 * n], rows[2 * n:]
        rows = rows[:n]
        for k, row in enumerate(rows):
            row["range"] = run_range(row, [low[k], high[k]])
        header["range_model"] = error_model()
    table_rows = [{k: r.get(k) for k in ROW_KEYS} | ({"range": r["range"]} if ranges else {}) for r in rows]
    return SweepResult(header, rows, table_rows)
