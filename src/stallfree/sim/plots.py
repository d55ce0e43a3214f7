"""PNG plots of simulations: TTFT/TPOT CDFs, KV utilisation and load over time, and the sweep's
p99 TPOT against p99 TTFT trade-off, and the tune's goodput and p99 TPOT against the budget.

Imports allowed: the standard library, stallfree.sim, numpy and matplotlib (imported inside the
functions, with the non-interactive Agg backend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.sim.simulator import BATCHING_MODES, SimResult

if TYPE_CHECKING:
    from stallfree.sim.tune import TuneResult

__all__ = ["plot_cdfs", "plot_sweep_cdfs", "plot_timeline", "plot_tradeoff", "plot_tune"]

# Time bins of the timeline plot: enough to show bursts, few enough to stay readable.
_TIMELINE_BINS = 600


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


def plot_cdfs(results: Sequence[SimResult], path: Path) -> None:
    """Write CDFs of TTFT (log scale) and TPOT, one line per run, to `path` (PNG).

    Raises:
        OSError: the file cannot be written.
    """
    from stallfree.sim.report import latency_arrays

    series = []
    for res in results:
        lat = latency_arrays(res)
        series.append((res.label, lat["ttft"] * 1e3, lat["tpot"] * 1e3))
    _plot_cdf_panels([(None, series)], path)


def _plot_cdf_panels(columns: list[tuple[str | None, list[tuple[str, Any, Any]]]], path: Path) -> None:
    """Columns of (title, [(label, ttft_ms, tpot_ms)]); one legend, in the last TPOT panel.

    A label "A | B" gets a colour by A and a line style by B (in order of first appearance), so
    that budgets and rate scales stay apart.
    """
    plt = _pyplot()
    ncol = len(columns)
    width = 6.0 if ncol == 1 else 4.8 * ncol
    # Rows share their x axis so that modes compare at a glance.
    fig, axes = plt.subplots(2, ncol, figsize=(width, 7.5), squeeze=False, sharex="row")
    labels = [label for _, series in columns for label, _, _ in series]
    colours = list(dict.fromkeys(label.partition(" | ")[0] for label in labels))  # first-seen order
    dashes = list(dict.fromkeys(label.partition(" | ")[2] for label in labels))
    cmap = plt.get_cmap("viridis", max(len(colours), 2))
    handles: dict[str, Any] = {}
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
        axes[0][j].set_xscale("log")
        axes[0][j].set_xlabel("TTFT (ms, log scale)")
        axes[1][j].set_xlabel("TPOT (ms)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.01)
            ax.grid(True, alpha=0.3)
            for line in ax.get_lines():
                handles.setdefault(str(line.get_label()), line)
        if title:
            axes[0][j].set_title(title)
    # TPOT tails run far out (a few requests stalled behind whole prompts): show up to the largest
    # p99.5 so that the bulk of every curve stays readable on the shared axis.
    import numpy as np

    tails = [float(np.quantile(t, 0.995)) for _, series in columns for _, _, t in series if len(t)]
    if tails:
        axes[1][0].set_xlim(0, 1.1 * max(tails))
        axes[1][0].set_xlabel("TPOT (ms; axis cut at the largest p99.5)")
    axes[1][-1].legend(list(handles.values()), list(handles), fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(results: Sequence[SimResult], path: Path) -> None:
    """Write KV utilisation, tokens per step and waiting requests over simulated time to `path`.

    Each series is averaged over time bins (step-duration weighted), one line per run.

    Raises:
        OSError: the file cannot be written.
    """
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for k, res in enumerate(results):
        start = np.frombuffer(res.step_start, dtype=np.float64)
        end = np.frombuffer(res.step_end, dtype=np.float64)
        if len(end) == 0:
            continue
        t0 = res.arrival[0] if res.arrival else 0.0
        edges = np.linspace(t0, end[-1], _TIMELINE_BINS + 1)
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
            ax.plot(mid, mean, label=res.label, color=f"C{k}", lw=1)
    axes[0].set_ylabel("KV reserved (% of capacity)")
    axes[1].set_ylabel("tokens per step")
    axes[2].set_ylabel("waiting requests")
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write p99 TPOT against p99 TTFT: a point per token budget, a line per batching mode (and
    rate scale), each point labelled with its budget.

    Args:
        rows: sweep summaries with batching, rate_scale, token_budget, p99_ttft_ms, p99_tpot_ms.

    Raises:
        OSError: the file cannot be written.
    """
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(8, 5.5))
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["batching"], row["rate_scale"]), []).append(row)
    modes = [m for m in BATCHING_MODES if any(g == m for g, _ in groups)]
    modes += sorted({m for m, _ in groups} - set(modes))
    scales = sorted({s for _, s in groups})
    styles = ["-", "--", ":", "-."]
    for (mode, scale), grp in sorted(groups.items()):
        grp = sorted(grp, key=lambda r: r["token_budget"])
        pts = [(r["p99_ttft_ms"], r["p99_tpot_ms"], r["token_budget"]) for r in grp if r.get("p99_tpot_ms")]
        if not pts:
            continue
        label = mode if len(scales) == 1 else f"{mode}, rate x{scale:g}"
        color = f"C{modes.index(mode)}"
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            styles[scales.index(scale) % 4],
            marker="o",
            color=color,
            label=label,
        )
        # Budgets whose points coincide (within 3%) share one label, and each mode's labels sit at their
        # own vertical offset, so that points of different modes in one place stay readable.
        merged: list[tuple[float, float, list[int]]] = []
        for x, y, b in pts:
            for mx, my, budgets in merged:
                if abs(x - mx) <= 0.03 * mx and abs(y - my) <= 0.03 * max(my, 1e-9):
                    budgets.append(b)
                    break
            else:
                merged.append((x, y, [b]))
        dy = 4 - 11 * modes.index(mode)
        for x, y, budgets in merged:
            text = "/".join(str(b) for b in budgets)
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, dy), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("p99 TTFT (ms, log scale)")
    ax.set_ylabel("p99 TPOT (ms)")
    ax.set_title("Token budget trade-off (labels: token budget)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep_cdfs(curves: Sequence[dict[str, Any]], path: Path) -> None:
    """Write TTFT and TPOT CDFs of a sweep: a column per batching mode, a line per budget (and scale).

    Args:
        curves: dicts with batching, rate_scale, token_budget, ttft_ms and tpot_ms (arrays).

    Raises:
        OSError: the file cannot be written.
    """
    modes: dict[str, list[tuple[str, Any, Any]]] = {}
    multi_scale = len({c["rate_scale"] for c in curves}) > 1
    for c in sorted(curves, key=lambda c: (c["rate_scale"], c["token_budget"])):
        label = f"budget {c['token_budget']}" + (f" | rate x{c['rate_scale']:g}" if multi_scale else "")
        modes.setdefault(c["batching"], []).append((label, c["ttft_ms"], c["tpot_ms"]))
    _plot_cdf_panels(list(modes.items()), path)


def plot_tune(result: TuneResult, path: Path) -> None:
    """Write goodput and p99 TPOT against the token budget (a line per max_seqs) to `path` (PNG).

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (ax_g, ax_t) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    for m in sorted({r["max_seqs"] for r in result.rows}):
        rows = sorted((r for r in result.rows if r["max_seqs"] == m), key=lambda r: r["token_budget"])
        xs = [r["token_budget"] for r in rows]
        style = "o-" if len(rows) > 1 else "s"
        ax_g.plot(xs, [r.get("request_goodput") or 0 for r in rows], style, label=f"max_seqs {m}")
        ax_t.plot(xs, [r.get("p99_tpot_ms") or math.nan for r in rows], style, label=f"max_seqs {m}")
    best = result.best
    ax_g.plot(
        [best["token_budget"]],
        [best.get("request_goodput") or 0],
        "*",
        ms=16,
        color="black",
        label=f"chosen: {best['token_budget']:,} / {best['max_seqs']}",
    )
    ax_t.axhline(result.slo_tpot * 1e3, ls="--", color="gray", label="TPOT SLO")
    if result.bound is not None:
        for ax in (ax_g, ax_t):
            ax.axvline(result.bound.token_budget, ls=":", color="tab:red")
        ax_g.plot([], [], ls=":", color="tab:red", label=f"cost-model bound {result.bound.token_budget:,}")
    ax_g.set_ylabel("goodput (req/s within both SLOs)")
    ax_t.set_ylabel("p99 TPOT (ms)")
    ax_t.set_xlabel("token budget (tokens per step)")
    ax_t.set_xscale("log")
    ax_t.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_t.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_t.xaxis.set_minor_formatter(NullFormatter())
    ax_g.set_title(f"tune: TTFT <= {result.slo_ttft * 1e3:g} ms, TPOT <= {result.slo_tpot * 1e3:g} ms")
    for ax in (ax_g, ax_t):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
