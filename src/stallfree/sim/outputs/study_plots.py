"""PNG plots of studies: hit rate and TTFT against KV size, tuning's candidates against the SLOs, and the
plan's fleets by cost. stallfree.sim.outputs.plots re-exports them.

Imports allowed: the standard library and stallfree.sim; numpy and matplotlib only lazily.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.outputs.plot_parts import (
    _kv_hit_panel,
    _layout,
    _legend_y,
    _plain_ticks,
    _pyplot,
    _title,
    _tokens_label,
    _top,
    _tune_lines,
    _two_five_label,
)

__all__ = [
    "chosen_label",
    "plot_kv_sweep",
    "plot_tune",
]


def plot_kv_sweep(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Write a PNG: TTFT p50/p99 against KV capacity, and with caching on the hit rate (with the
    infinite-cache bound) beside it. Sizes whose figures are missing (every request rejected) are left
    out; points whose hit rate preemption inflates are ringed and the panel says so.

    Args:
        rows: kv_sweep's rows.
        path: the PNG to write.
        title: the figure's title (kv_sweep.kv_sweep_title: workload, budget, model and GPUs).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    caching = any(r.get("prefix_cache_hit_rate") is not None for r in rows)
    if caching:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
        axes: tuple[Any, ...] = (ax1, ax2)
    else:
        fig, ax2 = plt.subplots(1, 1, figsize=(6.5, 4.6))
        axes = (ax2,)
    if caching:
        _kv_hit_panel(ax1, rows)
    p50 = [(r["kv_tokens"], r["median_ttft_ms"] / 1e3) for r in rows if r.get("median_ttft_ms") is not None]
    p99 = [(r["kv_tokens"], r["p99_ttft_ms"] / 1e3) for r in rows if r.get("p99_ttft_ms") is not None]
    ax2.plot([p[0] for p in p50], [p[1] for p in p50], "o-", label="TTFT p50")
    ax2.plot([p[0] for p in p99], [p[1] for p in p99], "s-", label="TTFT p99")
    ax2.set(xscale="log", yscale="log", xlabel="KV capacity (tokens)", ylabel="TTFT (s)")
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda y, _p: f"{y:g}"))
    ax2.yaxis.set_minor_formatter(NullFormatter())
    if p50 or p99:
        ys = [p[1] for p in p50 + p99]
        lo, hi = min(ys) / 1.5, max(ys) * 4  # headroom above the markers for the legend
        ax2.set_ylim(lo, hi)
        if hi / lo < 300:  # under ~2 decades: label the 2s and 5s too, plainly
            ax2.yaxis.set_minor_formatter(FuncFormatter(_two_five_label))
        ax2.legend(loc="upper right", fontsize="small", framealpha=0.9)
    for ax in axes:
        ax.xaxis.set_major_locator(LogLocator(base=10))
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
        ax.xaxis.set_minor_formatter(NullFormatter())
        kv = [r["kv_tokens"] for r in rows]
        if kv:
            ax.set_xlim(min(kv) / 1.5, max(kv) * 1.5)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chosen_label(best: dict[str, Any]) -> str:
    """The legend entry of tune's choice, each number named: "chosen: budget 320, max_seqs 256"."""
    text = f"chosen: budget {best['token_budget']:,}, max_seqs {best['max_seqs']}"
    pp = best.get("partial_prefills")
    return text + (f", K/L/T {pp[0]}/{pp[1]}/{pp[2]}" if pp else "")


def plot_tune(
    rows: Sequence[dict[str, Any]],
    path: Path,
    *,
    best: dict[str, Any],
    slo_ttft: float,
    slo_tpot: float,
    bound_budget: int | None = None,
    context: str | None = None,
) -> None:
    """Write goodput and p99 TPOT against the token budget (a line per max_seqs) to `path` (PNG).

    Args:
        rows: one dict per simulated candidate (tune's TuneResult.rows: token_budget, max_seqs,
            request_goodput, p99_tpot_ms, partial_prefills).
        path: the PNG to write.
        best: the chosen row (TuneResult.best).
        slo_ttft, slo_tpot: the objectives, s.
        bound_budget: the cost-model bound's token budget (TuneResult.bound.token_budget), or None.
        context: the workload and replica line of the title (plot_context), or None.

    Raises:
        OSError: the file cannot be written.
    """
    plt = _pyplot()
    fig, (ax_g, ax_t) = plt.subplots(2, 1, figsize=(8.5, 7.5), sharex=True)
    _tune_lines(ax_g, ax_t, rows)
    # A hollow ring under the markers: the candidates at the chosen budget stay visible.
    for ax, y in ((ax_g, best.get("request_goodput") or 0), (ax_t, best.get("p99_tpot_ms") or math.nan)):
        ax.plot([best["token_budget"]], [y], "o", ms=20, mfc="none", mec="black", mew=1.6, zorder=1.5,
                label=chosen_label(best))
    ax_t.axhline(slo_tpot * 1e3, ls="--", color="gray", label="TPOT SLO")
    if bound_budget is not None:
        for ax in (ax_g, ax_t):
            ax.axvline(bound_budget, ls=":", color="tab:red")
        ax_g.plot([], [], ls=":", color="tab:red", label=f"cost-model bound {bound_budget:,}")
    ax_g.set_ylabel("goodput (req/s within both SLOs)")
    ax_t.set_ylabel("p99 TPOT (ms)")
    ax_t.set_xlabel("token budget (tokens per step)")
    ax_t.set_xscale("log")
    _plain_ticks(ax_t.xaxis, "log")
    what = (
        f"tune: TTFT <= {slo_ttft * 1e3:g} ms, TPOT <= {slo_tpot * 1e3:g} ms; each point is one "
        "simulation (goodput over the run, p99 over its completed requests)"
    )
    lines = _title(fig, what, context)
    handles: dict[str, Any] = {}
    for ax in (ax_g, ax_t):
        ax.grid(True, alpha=0.3)
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    ncols = min(len(handles), 4)
    height = fig.get_figheight()
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="upper center",
               ncol=ncols, bbox_to_anchor=(0.5, _legend_y(lines, height)), frameon=False)
    _layout(fig, _top(lines, -(-len(handles) // ncols), height))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_plan_costs(rows: Sequence[dict[str, Any]], path: Path, attainment: float, answer: dict[str, Any] | None,
                    priced: bool, context: str | None = None) -> None:
    """Write the cost of every cluster `plan` simulated against its SLO attainment: a point per cluster,
    a marker per kind (aggregated, disaggregated) and a colour per shape (GPU x TP), the target as a
    vertical line and the answer ringed.

    Args:
        rows: plan rows with gpu, tp, kind, attainment and cost (US dollars per hour, or GPUs).
        path: the PNG to write.
        attainment: the target share, drawn as a line.
        answer: the answer's record (its row ringed), or None.
        priced: whether the cost is in dollars per hour (else GPUs).
        context: the workload and replica line of the title (plot_context), or None.

    Raises:
        OSError: the file cannot be written.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6.2))
    from stallfree.sim.studies.fleet import shape_text

    shapes = list(dict.fromkeys(shape_text(r) for r in rows))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, shape in enumerate(shapes):
        for kind, marker in (("aggregated", "o"), ("disaggregated", "s")):
            pts = [r for r in rows if shape_text(r) == shape and r["kind"] == kind]
            if pts:
                ax.scatter([100 * r["attainment"] for r in pts], [r["cost"] for r in pts], marker=marker,
                           color=colours[k % len(colours)], label=f"{shape}, {kind}", alpha=0.8)
    if answer is not None:
        row = answer["row"]
        ax.scatter([100 * row["attainment"]], [row["cost"]], s=260, facecolors="none", edgecolors="black",
                   linewidths=1.5, label=f"answer: {row['label']} on {shape_text(row)}")
    ax.axvline(100 * attainment, color="grey", linestyle="--", linewidth=1, label=f"target {attainment:.0%}")
    ax.set_xlabel("requests within both SLOs, % of all")
    ax.set_ylabel("fleet cost, US dollars per hour" if priced else "fleet size, GPUs (no prices given)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    lines = _title(fig, "Cost against SLO attainment: each point is one simulated cluster", context)
    _layout(fig, _top(lines, 0, fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
