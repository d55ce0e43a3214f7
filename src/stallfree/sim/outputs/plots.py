"""PNG plots of simulations: TTFT/TPOT CDFs, KV utilisation and load over time, and the sweep's
p99 TPOT against p99 TTFT trade-off, and the tune's goodput and p99 TPOT against the budget.

Imports allowed: the standard library, stallfree.sim, numpy and matplotlib (imported inside the
functions, with the non-interactive Agg backend).

Why one module of a little over 400 lines: every figure shares the same title, legend and layout
helpers (plot_context, _title, _layout), which keep the figures alike; the functions themselves
stay short.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.outputs.plot_parts import (
    _LABEL_DIRECTIONS,
    _LABEL_RADII,
    _axis_label,
    _budget_lines,
    _cdf,
    _layout,
    _legend_y,
    _line_boxes,
    _overlap,
    _plain_ticks,
    _pyplot,
    _spread,
    _timeline_series,
    _title,
    _top,
    _tradeoff_lines,
)
from stallfree.sim.outputs.report import latency_arrays
from stallfree.sim.outputs.study_plots import chosen_label, plot_kv_sweep, plot_plan_costs, plot_tune
from stallfree.sim.outputs.wording import rate_text
from stallfree.sim.run.result import SimResult

__all__ = [
    "axis_scale",
    "chosen_label",
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


def plot_context(header: dict[str, Any], budgets: str | None = None) -> str:
    """The line that names a figure's workload and replica, from a report header.

    "azure-conv-2023, 19,366 requests at rate x3 (16.59 req/s); llama-3.3-70b, 4 x h100-sxm, fp8;
    KV 657,180 tokens; budget 2,048". `budgets` replaces the header's own budget text (a sweep's list).
    """
    rate = header.get("offered_rate")
    offered = f"{rate_text(rate)} req/s" if isinstance(rate, int | float) and math.isfinite(rate) else "all at once"
    parts = [
        f"{header['workload']}, {header['requests']:,} requests at rate x{header['rate_scale']:g} ({offered})",
        str(header["hardware"]),
        f"KV {header['kv_tokens']:,} tokens",
    ]
    if budgets is not None:
        parts.append(budgets)
    elif header.get("step_time_target_s") is not None:
        parts.append(f"step time target {header['step_time_target_s'] * 1e3:g} ms")
    elif header.get("token_budget") is not None:
        parts.append(f"budget {header['token_budget']:,}")
    return "; ".join(parts)


#: A latency axis goes logarithmic when its largest value is at least this many times its smallest:
#: then a run 10x slower than another still shows the faster one's spread; under it a log axis only
#: relabels a narrow range (13,000 to 15,000 ms) without showing more.
LOG_SPAN = 10.0


def axis_scale(values: Sequence[float] | Any) -> str:
    """'log' when the positive finite values span at least LOG_SPAN (max / min), else 'linear'."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return "log" if vals and max(vals) >= LOG_SPAN * min(vals) else "linear"


def plot_cdfs(results: Sequence[SimResult], path: Path, context: str | None = None) -> None:
    """Write CDFs of TTFT (log scale) and TPOT, one line per run, to `path` (PNG).

    Args:
        results: the runs (a line each).
        path: the PNG to write.
        context: the workload and replica line of the title (plot_context), or None.

    Raises:
        OSError: the file cannot be written.
    """

    series = []
    for res in results:
        lat = latency_arrays(res)
        series.append((res.label, lat["ttft"] * 1e3, lat["tpot"] * 1e3))
    what = "TTFT and TPOT per request, CDF over every completed request of each run"
    _plot_cdf_panels([(None, series)], path, what, context)


def plot_cdf_series(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], path: Path,
                    context: str | None = None) -> None:
    """Write CDFs of TTFT (log scale) and TPOT as plot_cdfs does, from ready latencies: one line per
    (label, TTFT ms per request, TPOT ms per request); for runs that are not one SimResult (a
    disaggregated run's joined timelines).

    Raises:
        OSError: the file cannot be written.
    """
    import numpy as np

    rows = [(label, np.asarray(ttft, dtype=np.float64), np.asarray(tpot, dtype=np.float64))
            for label, ttft, tpot in series]
    what = "TTFT and TPOT per request, CDF over every completed request of each run"
    _plot_cdf_panels([(None, rows)], path, what, context)


def _plot_cdf_panels(
    columns: list[tuple[str | None, list[tuple[str, Any, Any]]]],
    path: Path,
    what: str = "",
    context: str | None = None,
) -> None:
    """Columns of (title, [(label, ttft_ms, tpot_ms)]); one legend for the figure, under the title.

    A label "A | B" gets a colour by A and a line style by B (in order of first appearance), so
    that budgets and rate scales stay apart. The TTFT row shares its axis. Each axis is logarithmic
    when its curves span LOG_SPAN or more (axis_scale over their p0.5 to p99.5), so that a baseline
    whose TPOT is ten times the chunked runs' does not squeeze their curves against zero; a linear
    TPOT axis is cut at its curves' largest p99.5.
    """

    plt = _pyplot()
    ncol = len(columns)
    width = 7.0 if ncol == 1 else 4.8 * ncol
    fig, axes = plt.subplots(2, ncol, figsize=(width, 8.3), squeeze=False)
    for j in range(1, ncol):
        axes[0][j].sharex(axes[0][0])
    labels = [label for _, series in columns for label, _, _ in series]
    colours = list(dict.fromkeys(label.partition(" | ")[0] for label in labels))  # first-seen order
    dashes = list(dict.fromkeys(label.partition(" | ")[2] for label in labels))
    cmap = plt.get_cmap("viridis", max(len(colours), 2))
    handles: dict[str, Any] = {}
    ttft_scale = axis_scale(sum(_spread([t for _, series in columns for _, t, _ in series]), []))
    for j, (title, series) in enumerate(columns):
        for label, ttft_ms, tpot_ms in series:
            head, _, tail = label.partition(" | ")
            k = colours.index(head)
            style = {
                "color": cmap(k) if len(colours) > 3 else f"C{k}",
                "linestyle": ["-", "--", ":", "-."][dashes.index(tail) % 4],
            }
            _cdf(axes[0][j], ttft_ms, label, **style)
            _cdf(axes[1][j], tpot_ms, label, **style)
        _cdf_axes(axes[0][j], axes[1][j], series, ttft_scale)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.01)
            ax.grid(True, alpha=0.3)
            for line in ax.get_lines():
                handles.setdefault(str(line.get_label()), line)
        if title:
            axes[0][j].set_title(title)
    lines = _title(fig, what, context)
    ncols = max(min(len(handles), 6), 1)
    height = fig.get_figheight()
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="upper center", ncol=ncols,
               bbox_to_anchor=(0.5, _legend_y(lines, height)), frameon=False)
    rows = -(-len(handles) // ncols)
    _layout(fig, _top(lines, rows, height), axes_titles=any(t for t, _ in columns))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf_axes(ax_ttft: Any, ax_tpot: Any, series: Sequence[tuple[str, Any, Any]], ttft_scale: str) -> None:
    """Scale and label one column's TTFT axis (`ttft_scale`, shared by every column) and its TPOT axis
    (axis_scale over the bulk of its own curves)."""
    ax_ttft.set_xscale(ttft_scale)
    _plain_ticks(ax_ttft.xaxis, ttft_scale)
    ax_ttft.set_xlabel(_axis_label("TTFT", ttft_scale))
    lo, hi = _spread([t for _, _, t in series])
    scale = axis_scale(lo + hi)
    ax_tpot.set_xscale(scale)
    _plain_ticks(ax_tpot.xaxis, scale)
    if not hi:
        ax_tpot.set_xlabel(_axis_label("TPOT", scale))
    elif scale == "log":
        # TPOT tails run far out (a few requests stalled behind whole prompts): cut at the bulk.
        ax_tpot.set_xlim(min(lo) / 1.3, max(hi) * 1.3)
        ax_tpot.set_xlabel(_axis_label("TPOT", scale, "p0.5 to p99.5 of every curve shown"))
    else:
        ax_tpot.set_xlim(0, 1.1 * max(hi))
        ax_tpot.set_xlabel(_axis_label("TPOT", scale, "axis cut at the largest p99.5"))


def plot_replica_timeline(
    replicas: Sequence[SimResult], path: Path, context: str | None = None, labels: Sequence[str] | None = None
) -> None:
    """plot_timeline of a cluster: one line per replica (its own KV, tokens per step and waiting
    requests; a cluster's merged result would bin every replica's steps together and show their
    mean step, hiding an idle or an overloaded replica).

    Args:
        replicas: each replica's SimResult, index order (ClusterResult.replicas, or a disaggregated
            run's prefill then decode results).
        path, context: as plot_timeline.
        labels: one legend entry per replica (default "replica 0", "replica 1", ...).

    Raises:
        ValueError: len(labels) != len(replicas).
        OSError: the file cannot be written.
    """
    names = list(labels) if labels is not None else [f"replica {k}" for k in range(len(replicas))]
    if len(names) != len(replicas):
        raise ValueError(f"{len(names)} labels for {len(replicas)} replicas")
    plot_timeline(replicas, path, context, labels=names,
                  what=f"KV, tokens per step and queue over time, per replica ({len(replicas)})")


def plot_timeline(
    results: Sequence[SimResult],
    path: Path,
    context: str | None = None,
    *,
    labels: Sequence[str] | None = None,
    what: str = "KV, tokens per step and queue over time",
) -> None:
    """Write KV utilisation, tokens per step and waiting requests over simulated time to `path`.

    Each series is averaged over time bins (step-duration weighted), one line per run. The KV panel
    says "reserved" (the reservation scheduler holds prompt + max_new from admission) or "used"
    (the paged scheduler holds blocks as tokens are computed), after the runs' KV policy.

    Args:
        results: the runs (a line each).
        path: the PNG to write.
        context: the workload and replica line of the title (plot_context), or None.
        labels: the legend entry of each run (default: each result's label).
        what: the first line of the title.

    Raises:
        OSError: the file cannot be written.
    """

    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.6), sharex=True)
    bin_s = _timeline_series(axes, results, labels)
    _budget_lines(axes[1], results)
    policies = {res.config.get("kv", "reserve") for res in results}
    kv_word = "used" if policies == {"paged"} else "reserved" if "paged" not in policies else "reserved or used"
    axes[0].set_ylabel(f"KV {kv_word} (% of capacity)")
    axes[1].set_ylabel("tokens per step")
    axes[2].set_ylabel("waiting requests")
    axes[2].set_xlabel(f"simulated time (s); each point: the step-time-weighted mean over a {bin_s:,.2g} s bin")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    lines = _title(fig, what, context)
    height = fig.get_figheight()
    fig.legend(handles, names, fontsize=8, loc="upper center", ncol=max(min(len(names), 8), 1),
               bbox_to_anchor=(0.5, _legend_y(lines, height)), frameon=False)
    _layout(fig, _top(lines, max(1, -(-len(names) // 8)), height))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path, context: str | None = None) -> None:
    """Write p99 TPOT against p99 TTFT: a point per token budget, a line per batching mode (and
    rate scale), each point labelled with its budget.

    Each axis is logarithmic only when its points span LOG_SPAN or more (axis_scale), and says so.
    Labels are placed by place_labels: inside the axes, overlapping no other label and no marker,
    with a leader line when set away from their point; budgets whose points coincide (within 3%)
    share a label.

    Args:
        rows: sweep summaries with batching, rate_scale, token_budget, p99_ttft_ms, p99_tpot_ms.
        path: the PNG to write.
        context: the workload and replica line of the title (plot_context), or None.

    Raises:
        OSError: the file cannot be written.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6.2))
    labels = _tradeoff_lines(ax, rows)
    for axis, values, name in ((ax.xaxis, [x for x, _, _, _ in labels], "p99 TTFT"),
                               (ax.yaxis, [y for _, y, _, _ in labels], "p99 TPOT")):
        scale = axis_scale(values)
        (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)(scale)
        _plain_ticks(axis, scale)
        (ax.set_xlabel if axis is ax.xaxis else ax.set_ylabel)(_axis_label(name, scale))
    ax.margins(0.1)  # room for the labels of the outermost points
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    lines = _title(
        fig,
        "Token budget trade-off: each point is one simulation, its p99 over every completed request "
        "(labels: token budget)",
        context,
    )
    _layout(fig, _top(lines, 0, fig.get_figheight()))
    place_labels(fig, ax, labels)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def place_labels(fig: Any, ax: Any, labels: Sequence[tuple[float, float, str, str]]) -> list[Any]:
    """Annotate each (x, y, text, colour) in data coordinates at the first candidate place (the
    directions of _LABEL_DIRECTIONS at each distance of _LABEL_RADII, nearest first) whose box lies
    inside the axes and overlaps no label placed yet, no marker and no line; a label set beyond the
    first distance gets a thin leader line to its point. Where no place is free, the one
    overlapping the least is taken. Returns the annotations, in the order given.

    Call after the layout is final (the boxes are measured in display space, pixels).
    """
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    px_per_pt = fig.dpi / 72
    taken = []
    for x, y, _, _ in labels:
        px, py = ax.transData.transform((x, y))
        taken.append((px - 4, py - 4, px + 4, py + 4))  # the marker itself
    lines = _line_boxes(ax)
    placed = []
    for x, y, text, color in labels:
        probe = ax.text(0, 0, text, fontsize=7, transform=None)
        box = probe.get_window_extent(renderer)
        w, h = box.width, box.height
        probe.remove()
        px, py = ax.transData.transform((x, y))
        best: tuple[float, float, float, tuple[float, float, float, float]] | None = None
        for r in _LABEL_RADII:
            for dx, dy in _LABEL_DIRECTIONS:
                ox, oy = dx * r * px_per_pt, dy * r * px_per_pt
                x0 = px + ox if dx > 0 else px + ox - w
                rect = (x0, py + oy, x0 + w, py + oy + h)
                inside = frame.x0 <= rect[0] and rect[2] <= frame.x1 and frame.y0 <= rect[1] and rect[3] <= frame.y1
                cost = sum(_overlap(rect, t) for t in taken) + 0.2 * sum(_overlap(rect, t) for t in lines)
                cost += 0.0 if inside else 1e9
                if best is None or cost < best[0]:
                    best = (cost, dx * r, dy * r, rect)
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        _, ox, oy, rect = best
        far = math.hypot(ox, oy) > _LABEL_RADII[0] * 1.5
        placed.append(ax.annotate(
            text, (x, y), textcoords="offset points", xytext=(ox, oy), fontsize=7, color=color,
            ha="left" if ox > 0 else "right", va="bottom", annotation_clip=False,
            arrowprops={"arrowstyle": "-", "color": color, "lw": 0.5, "alpha": 0.6} if far else None))
        taken.append(rect)
    return placed


def plot_sweep_cdfs(curves: Sequence[dict[str, Any]], path: Path, context: str | None = None) -> None:
    """Write TTFT and TPOT CDFs of a sweep: a column per batching mode, a line per budget (and scale).

    Args:
        curves: dicts with batching, rate_scale, token_budget, ttft_ms and tpot_ms (arrays).
        path: the PNG to write.
        context: the workload and replica line of the title (plot_context), or None.

    Raises:
        OSError: the file cannot be written.
    """
    modes: dict[str, list[tuple[str, Any, Any]]] = {}
    multi_scale = len({c["rate_scale"] for c in curves}) > 1
    for c in sorted(curves, key=lambda c: (c["rate_scale"], c["token_budget"])):
        label = f"budget {c['token_budget']:,}" + (f" | rate x{c['rate_scale']:g}" if multi_scale else "")
        modes.setdefault(c["batching"], []).append((label, c["ttft_ms"], c["tpot_ms"]))
    what = "TTFT and TPOT per request by batching mode, CDF over every completed request of each run"
    _plot_cdf_panels(list(modes.items()), path, what, context)


