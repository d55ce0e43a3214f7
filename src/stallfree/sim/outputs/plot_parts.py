"""The drawing helpers the plots share: pyplot loaded lazily, titles, layout, axis scales and tick labels,
CDF points, and the label and marker tables.

Imports allowed: the standard library; numpy and matplotlib only lazily.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

from stallfree.sim.outputs.itl import step_starts
from stallfree.sim.run.config import BATCHING_MODES
from stallfree.sim.run.result import SimResult

# Time bins of the timeline plot: enough to show bursts, few enough to stay readable.
_TIMELINE_BINS = 600


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


def _spread(arrays: Sequence[Any]) -> tuple[list[float], list[float]]:
    """The p0.5 and p99.5 of each non-empty array (ms): the bulk of each curve, not its far tail."""
    import numpy as np

    lo = [float(np.quantile(a, 0.005)) for a in arrays if len(a)]
    hi = [float(np.quantile(a, 0.995)) for a in arrays if len(a)]
    return lo, hi


def _timeline_series(axes: Any, results: Sequence[SimResult], labels: Sequence[str] | None) -> float:
    """Draw each run's KV %, tokens per step and waiting requests, binned over time (step-duration
    weighted means over _TIMELINE_BINS bins), on the three axes; return the widest bin, s."""
    import numpy as np

    bin_s = 0.0
    for k, res in enumerate(results):
        start = step_starts(res, np.arange(res.num_steps))  # a plot holds every step's start
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
            np.asarray(res.step_kv_used) / max(res.kv_total, 1) * 100,
            np.asarray(res.step_tokens).astype(np.float64),
            np.asarray(res.step_waiting).astype(np.float64),
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


_TUNE_MARKERS = ("o", "s", "^", "D", "v")


_TUNE_DODGE = 1.04


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
