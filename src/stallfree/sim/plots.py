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
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.report import latency_arrays
from stallfree.sim.simulator import BATCHING_MODES, SimResult

__all__ = [
    "plot_cdf_series",
    "plot_cdfs",
    "plot_context",
    "plot_kv_sweep",
    "plot_replica_timeline",
    "plot_sweep_cdfs",
    "plot_timeline",
    "plot_tradeoff",
    "plot_tune",
    "place_labels",
    "axis_scale",
    "chosen_label",
]

# Time bins of the timeline plot: enough to show bursts, few enough to stay readable.
_TIMELINE_BINS = 600


def plot_context(header: dict[str, Any], budgets: str | None = None) -> str:
    """The line that names a figure's workload and replica, from a report header.

    "azure-conv-2023, 19,366 requests at rate x3 (16.59 req/s); llama-3.3-70b, 4 x h100-sxm, fp8;
    KV 657,180 tokens; budget 2,048". `budgets` replaces the header's own budget text (a sweep's list).
    """
    rate = header.get("offered_rate")
    offered = f"{rate:,.2f} req/s" if isinstance(rate, int | float) and math.isfinite(rate) else "all at once"
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


def _title(fig: Any, what: str, context: str | None) -> int:
    """Set the figure title: what is plotted, then the workload and replica, wrapped to the figure's
    width; return its number of lines."""
    width = max(60, int(fig.get_figwidth() * 13))  # about 13 characters per inch at 10 pt
    lines = textwrap.wrap(what, width) + (textwrap.wrap(context, width) if context else [])
    fig.suptitle("\n".join(lines), fontsize=10)
    return len(lines)


def _top(lines: int, legend_rows: int, height_in: float) -> float:
    """The top of the axes area (figure fraction) below a title of `lines` lines and a legend of
    `legend_rows` rows, at about 0.2 inch a line."""
    return 1 - (0.2 * lines + 0.2 * legend_rows + 0.15) / height_in


def _layout(fig: Any, top: float, axes_titles: bool = False) -> None:
    """tight_layout below `top`, then pin the axes' top there (tight_layout also makes room for the
    suptitle, which `top` already counts)."""
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.subplots_adjust(top=top - (0.3 if axes_titles else 0.05) / fig.get_figheight())


def _legend_y(lines: int, height_in: float) -> float:
    """Where a figure legend under the title starts (figure fraction)."""
    return 1 - (0.2 * lines + 0.08) / height_in


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: Any, label: str, **style: Any) -> None:
    import numpy as np

    if len(values_ms) == 0:
        return
    xs = np.sort(values_ms)
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.plot(xs, ys, label=label, **style)


#: A latency axis goes logarithmic when its largest value is at least this many times its smallest:
#: then a run 10x slower than another still shows the faster one's spread; under it a log axis only
#: relabels a narrow range (13,000 to 15,000 ms) without showing more.
LOG_SPAN = 10.0


def axis_scale(values: Sequence[float] | Any) -> str:
    """'log' when the positive finite values span at least LOG_SPAN (max / min), else 'linear'."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return "log" if vals and max(vals) >= LOG_SPAN * min(vals) else "linear"


def _axis_label(quantity: str, scale: str, note: str = "") -> str:
    """'p99 TTFT (ms, log scale)', 'TPOT (ms)': says 'log scale' only on a log axis."""
    parts = ["ms", *(["log scale"] if scale == "log" else []), *([note] if note else [])]
    return f"{quantity} ({', '.join(parts)})"


def _plain_ticks(axis: Any, scale: str) -> None:
    """Plain numbers with thousands separators ("40,000"); on a log axis at 1, 2 and 5 of each
    decade ("2,000", not "2x10^3")."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def plain(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:g}"

    if scale != "log":
        axis.set_major_formatter(FuncFormatter(lambda v, _: plain(v)))
        return

    def sparse(v: float, _pos: Any) -> str:
        # The 2s and 5s are labelled only while the axis has room for them: at most ~0.6 decade
        # per inch, else the labels of a 5-decade axis in a narrow panel run into each other.
        lo, hi = sorted(axis.get_view_interval())
        inches = axis.axes.get_position().width * axis.axes.figure.get_figwidth()
        if isinstance(axis, type(axis.axes.yaxis)):
            inches = axis.axes.get_position().height * axis.axes.figure.get_figheight()
        roomy = lo > 0 and math.log10(hi / lo) <= 0.6 * inches
        return plain(v) if roomy or f"{v:.0e}"[0] == "1" else ""

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(sparse))
    axis.set_minor_formatter(NullFormatter())


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


def _spread(arrays: Sequence[Any]) -> tuple[list[float], list[float]]:
    """The p0.5 and p99.5 of each non-empty array (ms): the bulk of each curve, not its far tail."""
    import numpy as np

    lo = [float(np.quantile(a, 0.005)) for a in arrays if len(a)]
    hi = [float(np.quantile(a, 0.995)) for a in arrays if len(a)]
    return lo, hi


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


def _timeline_series(axes: Any, results: Sequence[SimResult], labels: Sequence[str] | None) -> float:
    """Draw each run's KV %, tokens per step and waiting requests, binned over time (step-duration
    weighted means over _TIMELINE_BINS bins), on the three axes; return the widest bin, s."""
    import numpy as np

    bin_s = 0.0
    for k, res in enumerate(results):
        start = np.frombuffer(res.step_start, dtype=np.float64)
        end = np.frombuffer(res.step_end, dtype=np.float64)
        if len(end) == 0:
            continue
        t0 = res.arrival[0] if res.arrival else 0.0
        edges = np.linspace(t0, end[-1], _TIMELINE_BINS + 1)
        bin_s = max(bin_s, float(edges[1] - edges[0]))
        mid = (edges[:-1] + edges[1:]) / 2 - t0
        which = np.clip(np.searchsorted(edges, start, side="right") - 1, 0, _TIMELINE_BINS - 1)
        dur = end - start
        weight = np.bincount(which, weights=dur, minlength=_TIMELINE_BINS)
        busy = weight > 0
        series = (
            np.frombuffer(res.step_kv_used, dtype=np.int64) / max(res.kv_total, 1) * 100,
            np.frombuffer(res.step_tokens, dtype=np.int64).astype(np.float64),
            np.frombuffer(res.step_waiting, dtype=np.int64).astype(np.float64),
        )
        for ax, values in zip(axes, series, strict=True):
            sums = np.bincount(which, weights=values * dur, minlength=_TIMELINE_BINS)
            mean = np.where(busy, sums / np.where(busy, weight, 1), 0.0)
            ax.plot(mid, mean, label=res.label if labels is None else labels[k], color=f"C{k % 10}", lw=1)
    return bin_s


def _budget_lines(ax: Any, results: Sequence[SimResult]) -> None:
    """A dashed line at each run's token budget on the tokens-per-step panel, with a legend that says
    what it bounds: the baselines (prefill-first, no-chunk) take a whole prompt past it, and under a
    step time target it is each step's cap."""
    budgets = sorted({int(b) for r in results if (b := r.config.get("token_budget"))})
    if not budgets:
        return
    modes = {r.config.get("batching", "chunked") for r in results}
    timed = any(r.config.get("step_time_target_s") is not None for r in results)
    whole = sorted(m for m in modes if m in ("prefill-first", "no-chunk"))
    for b in budgets:
        text = f"token budget {b:,}" + (" (the cap of each step's)" if timed else "")
        if whole:
            text += f"; {' and '.join(whole)} steps run whole prompts past it"
        ax.axhline(b, ls="--", lw=0.8, color="gray", label=text)
    handles = [h for h in ax.get_lines() if str(h.get_label()).startswith("token budget")]
    ax.legend(handles=handles, fontsize=7, loc="upper right", framealpha=0.8)


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


def _tradeoff_lines(ax: Any, rows: Sequence[dict[str, Any]]) -> list[tuple[float, float, str, str]]:
    """Draw a line per (batching mode, rate scale) through its budgets' points; return the labels to
    place, (p99 TTFT ms, p99 TPOT ms, text, colour), one per group of coinciding points."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["batching"], row["rate_scale"]), []).append(row)
    modes = [m for m in BATCHING_MODES if any(g == m for g, _ in groups)]
    modes += sorted({m for m, _ in groups} - set(modes))
    scales = sorted({s for _, s in groups})
    labels: list[tuple[float, float, str, str]] = []
    for (mode, scale), grp in sorted(groups.items()):
        grp = sorted(grp, key=lambda r: r["token_budget"])
        pts = [(r["p99_ttft_ms"], r["p99_tpot_ms"], r["token_budget"]) for r in grp
               if r.get("p99_tpot_ms") and r.get("p99_ttft_ms")]
        if not pts:
            continue
        color = f"C{modes.index(mode)}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ["-", "--", ":", "-."][scales.index(scale) % 4],
                marker="o", color=color, label=mode if len(scales) == 1 else f"{mode}, rate x{scale:g}")
        merged: list[tuple[float, float, list[int]]] = []
        for x, y, b in pts:
            for mx, my, budgets in merged:
                if abs(x - mx) <= 0.03 * mx and abs(y - my) <= 0.03 * max(my, 1e-9):
                    budgets.append(b)
                    break
            else:
                merged.append((x, y, [b]))
        for x, y, budgets in merged:
            text = "every budget" if len(budgets) == len(pts) > 2 else _budget_span(budgets)
            labels.append((x, y, text, color))
    return labels


def _budget_span(budgets: list[int]) -> str:
    """"512" or "256/512"; three or more coinciding budgets as a range, "256 to 2,048", to stay short."""
    if len(budgets) <= 2:
        return "/".join(f"{b:,}" for b in budgets)
    return f"{min(budgets):,} to {max(budgets):,}"


# Directions tried for a label, right of the point first, at each distance of _LABEL_RADII (points).
_LABEL_DIRECTIONS = ((1, 0.4), (1, -1), (-1, 0.5), (-1, -1), (0.3, 1), (0.3, -1.6), (-0.3, 1), (-0.3, -1.6))
_LABEL_RADII = (7, 16, 28, 44, 64)


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


def _line_boxes(ax: Any, step_px: float = 5.0) -> list[tuple[float, float, float, float]]:
    """Small boxes every `step_px` pixels along the axes' lines (display space), so that a label is
    not set across a line."""
    boxes = []
    for line in ax.get_lines():
        xy = line.get_xydata()
        if len(xy) < 2:
            continue
        pts = ax.transData.transform(xy)
        for (x0, y0), (x1, y1) in zip(pts[:-1], pts[1:], strict=True):
            n = max(1, int(math.hypot(x1 - x0, y1 - y0) / step_px))
            for k in range(n + 1):
                x, y = x0 + (x1 - x0) * k / n, y0 + (y1 - y0) * k / n
                if math.isfinite(x) and math.isfinite(y):
                    boxes.append((x - 1.5, y - 1.5, x + 1.5, y + 1.5))
    return boxes


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """The area two (x0, y0, x1, y1) boxes share, square pixels."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


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


def _tokens_label(x: float, _pos: Any = None) -> str:
    """10000 -> "10k", 1500000 -> "1.5M": plain labels for a log axis of token counts."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"


def _two_five_label(y: float, _pos: Any = None) -> str:
    """A minor tick's label on a log axis: plain ("20", "0.5") at the 2s and 5s of a decade, else none."""
    lead = f"{y:.0e}"[0]
    return f"{float(f'{y:.1g}'):g}" if lead in "25" else ""


def _inflated(row: dict[str, Any]) -> bool:
    """kv_sweep.preemption_inflated: the row's hit rate counts readmissions after preemption."""
    return bool(row.get("hit_rate_inflated_by_preemption"))


def _kv_hit_panel(ax1: Any, rows: Sequence[dict[str, Any]]) -> None:
    """plot_kv_sweep's left panel: the prefix cache hit rate against KV capacity, the infinite-cache
    bound, and (where preemption inflates the hit rate) the first admissions' rate and rings."""
    pts = [(r["kv_tokens"], r["prefix_cache_hit_rate"], _inflated(r)) for r in rows
           if r.get("prefix_cache_hit_rate") is not None]
    ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="achieved")
    bound = next((r["prefix_cache_hit_rate_bound"] for r in rows
                  if r.get("prefix_cache_hit_rate_bound") is not None), None)
    if bound is not None:
        ax1.axhline(bound, ls="--", color="gray", label=f"infinite cache ({bound:.1%})")
    first = [(r["kv_tokens"], r["prefix_cache_hit_rate_first_admission"]) for r in rows
             if r.get("prefix_cache_hit_rate_first_admission") is not None]
    if first and any(_inflated(r) for r in rows):
        ax1.plot([p[0] for p in first], [p[1] for p in first], "^:", color="tab:green",
                 label="first admissions only")
    inflated = [p for p in pts if p[2]]
    if inflated:
        ax1.plot([p[0] for p in inflated], [p[1] for p in inflated], "o", ms=12, mfc="none", color="tab:red",
                 label="preempted: readmission\nhits counted, can pass bound")
    top = max([p[1] for p in pts] + [bound or 0.0])
    ax1.set(xscale="log", xlabel="KV capacity (tokens)", ylabel="prefix cache hit rate",
            ylim=(0, min(1.0, top * 1.6 + 0.05)))
    ax1.legend(loc="upper left", fontsize="small", framealpha=0.9)


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


_TUNE_MARKERS = ("o", "s", "^", "D", "v")
_TUNE_DODGE = 1.04


def chosen_label(best: dict[str, Any]) -> str:
    """The legend entry of tune's choice, each number named: "chosen: budget 320, max_seqs 256"."""
    text = f"chosen: budget {best['token_budget']:,}, max_seqs {best['max_seqs']}"
    pp = best.get("partial_prefills")
    return text + (f", K/L/T {pp[0]}/{pp[1]}/{pp[2]}" if pp else "")


def _tune_lines(ax_g: Any, ax_t: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Goodput (ax_g) and p99 TPOT (ax_t) against the budget: a line per max_seqs (a single point
    hollow), and the partial prefill candidates (tune --search-partial-prefills) as crosses."""
    plain = [r for r in rows if not r.get("partial_prefills")]
    seqs = sorted({r["max_seqs"] for r in plain})
    for k, m in enumerate(seqs):
        line = sorted((r for r in plain if r["max_seqs"] == m), key=lambda r: r["token_budget"])
        # Each max_seqs its own marker, set a little aside (x 1.04 per line, centred): at the budget
        # where they all run, equal goodputs would otherwise stack one marker on another.
        nudge = _TUNE_DODGE ** (k - (len(seqs) - 1) / 2)
        xs = [r["token_budget"] * nudge for r in line]
        style = {"marker": _TUNE_MARKERS[k % len(_TUNE_MARKERS)], "ls": "-" if len(line) > 1 else "none",
                 "mfc": "none" if len(line) == 1 else None, "label": f"max_seqs {m}"}
        ax_g.plot(xs, [r.get("request_goodput") or 0 for r in line], **style)
        ax_t.plot(xs, [r.get("p99_tpot_ms") or math.nan for r in line], **style)
    pp_rows = [r for r in rows if r.get("partial_prefills")]
    if pp_rows:
        ax_g.plot([r["token_budget"] for r in pp_rows], [r.get("request_goodput") or 0 for r in pp_rows], "x",
                  label="with partial prefills (K/L/T)")
        ax_t.plot([r["token_budget"] for r in pp_rows], [r.get("p99_tpot_ms") or math.nan for r in pp_rows], "x")


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
    from stallfree.sim.fleet import shape_text

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
