"""Sweeps: one simulation per (batching mode, rate scale, token budget), run in worker processes,
reported as a table, CSV/JSON rows and plots.

Imports allowed: the standard library, stallfree.core and stallfree.sim; rich and numpy lazily.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.sim.costs import StepCostModel
from stallfree.sim.simulator import SchedulerConfig, simulate
from stallfree.sim.workload import Workload

__all__ = ["SweepPoint", "run_grid", "run_points"]

_ROW_KEYS = (
    "batching",
    "rate_scale",
    "token_budget",
    "completed",
    "rejected",
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
    """

    workload: Workload
    rate_scale: float
    config: SchedulerConfig
    cost_model: StepCostModel
    max_tokens: int | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None


def _run_point(point: SweepPoint) -> dict[str, Any]:
    """Worker: simulate one point; return its summary plus TTFT and TPOT samples (ms, numpy)."""
    from stallfree.sim.report import latency_arrays, summarize_result

    res = simulate(
        point.workload.scale_rate(point.rate_scale), point.config, point.cost_model, point.max_tokens
    )
    summary = summarize_result(res, point.slo_ttft, point.slo_tpot)
    summary["rate_scale"] = point.rate_scale
    lat = latency_arrays(res)
    summary["ttft_ms"] = lat["ttft"] * 1e3
    summary["tpot_ms"] = lat["tpot"] * 1e3
    return summary


def run_points(
    points: Sequence[SweepPoint], jobs: int = 1, progress: Callable[[int], None] | None = None
) -> list[dict[str, Any]]:
    """Simulate every point (in `jobs` processes when jobs > 1), in the order given.

    Args:
        points: the configurations.
        jobs: worker processes; 1 runs in this process.
        progress: called with the number of points finished so far, after each one.

    Returns:
        Per point, the summary of report.summarize_result plus rate_scale, ttft_ms and tpot_ms
        (numpy arrays of the per-request samples).
    """
    out: list[dict[str, Any] | None] = [None] * len(points)
    if jobs <= 1 or len(points) <= 1:
        for k, point in enumerate(points):
            out[k] = _run_point(point)
            if progress:
                progress(k + 1)
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(points))) as pool:
            futures = {pool.submit(_run_point, p): k for k, p in enumerate(points)}
            for done, fut in enumerate(as_completed(futures), start=1):
                out[futures[fut]] = fut.result()
                if progress:
                    progress(done)
    return [o for o in out if o is not None]


def run_grid(args: Any, setup: Any, scales: Sequence[float]) -> int:
    """`stallfree sweep`: the grid of the command line, with a progress bar; prints and writes reports."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    points = [
        SweepPoint(
            setup.base_workload,
            scale,
            setup.config(mode, budget),
            setup.cost_model,
            args.max_tokens,
            args.slo_ttft,
            args.slo_tpot,
        )
        for scale in scales
        for mode in args.batching
        for budget in args.budgets
    ]
    jobs = args.jobs or os.cpu_count() or 1
    console = Console(stderr=True)
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("sweep", total=len(points))
        rows = run_points(points, jobs, lambda k: bar.update(task, completed=k))
    table_rows = [{k: r.get(k) for k in _ROW_KEYS} for r in rows]
    header = setup.header()
    if args.json:
        print(json.dumps({"header": header, "rows": table_rows}, indent=1))
    else:
        print(
            f"{header['workload']}: {header['requests']:,} requests; {header['hardware']}; "
            f"KV {header['kv_tokens']:,} tokens; max_seqs {header['max_seqs']}"
        )
        _print_rows(table_rows)
    if args.out:
        _write(args.out, header, rows, table_rows)
    return 0


def _print_rows(rows: Sequence[dict[str, Any]]) -> None:
    from rich.table import Table

    from stallfree.sim.report import console

    cols = (
        ("batching", "batching", "{}"),
        ("rate_scale", "rate x", "{:g}"),
        ("token_budget", "budget", "{:,}"),
        ("request_throughput", "req/s", "{:.2f}"),
        ("request_goodput", "goodput", "{:.2f}"),
        ("median_ttft_ms", "TTFT p50", "{:,.0f}"),
        ("p99_ttft_ms", "TTFT p99", "{:,.0f}"),
        ("median_tpot_ms", "TPOT p50", "{:.1f}"),
        ("p99_tpot_ms", "TPOT p99", "{:.1f}"),
        ("p99_itl_ms", "ITL p99", "{:.1f}"),
        ("budget_utilization", "budget use", "{:.0%}"),
        ("rejected", "rejected", "{:,}"),
    )
    table = Table(title="sweep (latencies in ms)", title_justify="left")
    for _, name, _ in cols:
        table.add_column(name, justify="left" if name == "batching" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*("-" if row.get(k) is None else spec.format(row[k]) for k, _, spec in cols))
    console().print(table)


def _write(
    out: Path, header: dict[str, Any], rows: list[dict[str, Any]], table_rows: list[dict[str, Any]]
) -> None:
    from stallfree.sim.plots import plot_sweep_cdfs, plot_tradeoff

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(_ROW_KEYS))
        writer.writeheader()
        writer.writerows(table_rows)
    (out / "sweep.json").write_text(json.dumps({"header": header, "rows": table_rows}, indent=1) + "\n")
    plot_tradeoff(table_rows, out / "tradeoff.png")
    plot_sweep_cdfs(rows, out / "cdf.png")
    print(f"wrote {out}/sweep.csv, sweep.json, tradeoff.png, cdf.png")
