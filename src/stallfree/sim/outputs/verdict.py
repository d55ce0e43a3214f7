"""Verdict lines: what a comparison bought or cost, by how much, and whether that exceeds the run's own
noise. Used by `simulate --compare`, `--compare-caching`, `--disaggregate search` and `validate`.

Imports allowed: the standard library and stallfree.sim; numpy lazily.

How noise is judged (docs/simulator.md, "Verdicts"):

- Two simulations of the same workload (--compare, --compare-caching): a paired bootstrap over
  requests. The requests finished in both runs are resampled with replacement BOOTSTRAP_RESAMPLES
  times (seed BOOTSTRAP_SEED, the same indices for both runs), and each figure's difference is
  recomputed on every resample. A difference is beyond the noise when the central 95% of those
  resampled differences excludes 0; else it is within the noise: another sample of requests from the
  same trace could have shown it either way.
- The disaggregation search keeps summaries only: goodput per GPU is attainment x requests /
  duration / GPUs, so its noise is taken as binomial in the attainment p over n requests, a standard
  error of goodput x sqrt((1 - p) / (n p)) per configuration; a difference is beyond the noise when it
  exceeds 1.96 x the two errors combined (root of the sum of squares).
- validate: the simulator's error of each mean against the measurement, and its 95% bootstrap
  interval over requests where per-request pairs are kept (--against run folders: TTFT and E2E); an
  error is beyond the noise when that interval excludes 0. Where a mode keeps no per-request pairs the
  line says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from stallfree.sim.outputs.report import latency_arrays
from stallfree.sim.outputs.wording import rate_text

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "bootstrap_diff",
    "compare_verdict",
    "disagg_verdict",
    "mean_error_interval",
    "offered_load_note",
    "paired_figures",
    "served_everything",
    "validate_verdict",
]

BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_SEED = 0

#: (name, latency_arrays key, statistic) of the figures a comparison judges.
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("TTFT p50", "ttft", "p50"),
    ("TTFT p99", "ttft", "p99"),
    ("TPOT p99", "tpot", "p99"),
    ("E2E mean", "e2e", "mean"),
)


def _stat(name: str) -> Callable[[Any], Any]:
    import numpy as np

    if name == "mean":
        return lambda a: np.mean(a, axis=-1)
    q = float(name[1:])
    return lambda a: np.percentile(a, q, axis=-1)


def bootstrap_diff(base: Any, other: Any, stat: str, resamples: int = BOOTSTRAP_RESAMPLES,
                   seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float]:
    """The paired bootstrap of stat(other) - stat(base) over requests (module docstring).

    Args:
        base, other: per-request values of the same requests in the same order (numpy arrays [n]).
        stat: "mean" or "pQ" (a percentile, 0 <= Q <= 100).
        resamples: bootstrap resamples (>= 1); seed: their generator's seed.

    Returns:
        (the difference on all requests, the 2.5th and the 97.5th percentile of the resampled ones).

    Raises:
        ValueError: the arrays differ in length or are empty, or resamples < 1.
    """
    import numpy as np

    a, b = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if len(a) != len(b) or not len(a):
        raise ValueError(f"bootstrap_diff needs two non-empty arrays of one length, got {len(a)} and {len(b)}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples!r}")
    f = _stat(stat)
    rng = np.random.default_rng(seed)
    diffs = []
    chunk = max(1, 2_000_000 // len(a))  # at most ~16 MB of indices at once
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, len(a), size=(min(chunk, resamples - start), len(a)))
        diffs.append(f(b[idx]) - f(a[idx]))
    d = np.concatenate(diffs)
    return float(f(b) - f(a)), float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


def paired_figures(base_res: Any, other_res: Any) -> dict[str, tuple[float, float, float, float]]:
    """Per figure of FIGURES, (base value, other value, interval low, interval high) in ms over the
    requests finished in both runs (for TPOT, those with a TPOT in both); figures with no such request
    are left out."""
    import numpy as np

    la, lb = latency_arrays(base_res), latency_arrays(other_res)
    out = {}
    for name, key, stat in FIGURES:
        ra, rb = (la["tpot_rids"], lb["tpot_rids"]) if key == "tpot" else (la["rids"], lb["rids"])
        common, ia, ib = np.intersect1d(ra, rb, assume_unique=True, return_indices=True)
        if not len(common):
            continue
        a, b = la[key][ia] * 1e3, lb[key][ib] * 1e3
        _, lo, hi = bootstrap_diff(a, b, stat)
        f = _stat(stat)
        out[name] = (float(f(a)), float(f(b)), lo, hi)
    return out


def _ms(v: float) -> str:
    return f"{v / 1e3:,.1f} s" if abs(v) >= 10_000 else f"{v:,.1f} ms" if abs(v) < 100 else f"{v:,.0f} ms"


def _figure_text(name: str, a: float, b: float, lo: float, hi: float) -> str:
    rel = f"{(b - a) / a:+.0%}" if a else "n/a"
    noise = "beyond the noise" if lo > 0 or hi < 0 else "within the noise"
    return f"{name} {_ms(a)} -> {_ms(b)} ({rel}, {noise})"


def compare_verdict(results: Sequence[Any], labels: Sequence[str], what: str) -> tuple[str, dict[str, Any]]:
    """The verdict line of runs of one workload against the first (module docstring: paired bootstrap).

    Args:
        results: SimResults, the first the baseline.
        labels: their names for the line.
        what: the change judged, for the line ("prefix caching", "chunked prefill").

    Returns:
        (the line, {label: {figure: {"base_ms", "other_ms", "low_ms", "high_ms", "beyond_noise"}}}).
    """
    parts, data = [], {}
    for res, label in zip(results[1:], labels[1:], strict=True):
        figs = paired_figures(results[0], res)
        data[label] = {n: {"base_ms": a, "other_ms": b, "low_ms": lo, "high_ms": hi, "beyond_noise": lo > 0 or hi < 0}
                       for n, (a, b, lo, hi) in figs.items()}
        parts.append(f"{label} against {labels[0]}: " + ", ".join(_figure_text(n, *v) for n, v in figs.items()))
    line = (f"verdict ({what}): " + "; ".join(parts) + f" (noise: 95% paired bootstrap over requests, "
            f"{BOOTSTRAP_RESAMPLES} resamples)")
    return line, data


def disagg_verdict(agg: dict[str, Any], dis: dict[str, Any], requests: int) -> tuple[str, dict[str, Any]]:
    """The verdict of `--disaggregate search`: the best disaggregated against the best aggregated, in
    goodput per GPU (req/s/GPU), judged against a binomial noise (module docstring); no difference when
    both serve every request offered within the SLOs (served_everything): both then show the offered load.

    Returns:
        (the line, {"aggregated", "disaggregated" (req/s/GPU), "change" (relative, or None),
        "noise" (1.96 x the combined standard error, req/s/GPU), "beyond_noise", "pays"}).
    """
    ga, gd = float(agg.get("goodput_per_gpu") or 0.0), float(dis.get("goodput_per_gpu") or 0.0)

    def se(g: float, s: dict[str, Any]) -> float:
        p = float(s.get("slo_attainment") or 0.0)
        return g * math.sqrt((1 - p) / (requests * p)) if p > 0 and requests else 0.0

    noise = 1.96 * math.hypot(se(ga, agg), se(gd, dis))
    diff = gd - ga
    # Both serving every request: each goodput per GPU is the offered load per GPU, whatever is left
    # of a difference is when the last request ended, and the binomial noise at p = 1 is 0.
    both = served_everything(agg) and served_everything(dis)
    beyond = abs(diff) > noise and not both
    pays = diff > 0 and beyond
    change = diff / ga if ga else None
    if change is None:
        rel = "from 0"
    elif abs(change) < 0.005:
        rel = "under 1% apart"  # "+0%" or "-0%" would read as a finding
    else:
        rel = f"{change:+.0%}"
    if both:
        head = "no difference: both serve every request offered within the SLOs"
    elif pays:
        head = "disaggregation pays"
    elif beyond:
        head = "disaggregation does not pay"
    else:
        head = "no difference beyond the noise"
    # Serving everything, both figures are the offered load per GPU and the binomial noise is 0: no
    # interval to quote.
    why = ("both the offered load per GPU" if both
           else f"{rel}; noise +/-{rate_text(noise, 3)} req/s/GPU, binomial 95% on the attainment")
    line = (f"verdict: {head}: best disaggregated {_config(dis['label'], 'disagg')} {rate_text(gd, 3)} req/s/GPU "
            f"against best aggregated {_config(agg['label'], 'aggregated')} {rate_text(ga, 3)} ({why})")
    return line, {"aggregated": ga, "disaggregated": gd, "change": change, "noise": noise, "beyond_noise": beyond,
                  "pays": pays}


def _config(label: str, kind: str) -> str:
    """A search row's label without its kind word ("disagg 1P:3D b2048/128" -> "1P:3D b2048/128"): the
    verdict names the kind itself."""
    return label[len(kind) + 1:] if label.startswith(kind + " ") else label


def served_everything(summary: dict[str, Any]) -> bool:
    """Whether a run served every request it was offered within the SLOs (none refused, none missed)."""
    n = summary.get("num_requests")
    return (summary.get("slo_attainment") == 1.0 and not summary.get("rejected")
            and n is not None and summary.get("completed") == n)


def offered_load_note(aggs: Sequence[dict[str, Any]], best: dict[str, Any] | None, offered_rate: float) -> str | None:
    """The `--disaggregate search` line saying that goodput per GPU measures the offered load, not capacity,
    when every aggregated configuration (`aggs`) serves every request within the SLOs; `best` (the best
    split) is named when it does too. `offered_rate` in req/s; None when some aggregated run missed."""
    if not aggs or not all(served_everything(s) for s in aggs):
        return None
    gpus = int(aggs[0].get("num_gpus") or 0)
    on = f" on {gpus} GPUs" if gpus else ""
    split = ", and so does the best split" if best is not None and served_everything(best) else ""
    rate = rate_text(offered_rate)
    return (f"note: every aggregated configuration serves all {rate} req/s offered within the SLOs{split}: there "
            f"goodput per GPU measures the offered load ({rate} req/s{on}), a lower bound on capacity, not capacity; "
            "raise --rate-scale to compare capacities")


def mean_error_interval(measured: Sequence[float], simulated: Sequence[float]) -> tuple[float, float, float]:
    """The error of the simulated mean against the measured one, percent, and its 95% bootstrap
    interval over requests (pairs resampled together; seed BOOTSTRAP_SEED).

    Raises:
        ValueError: empty or unequal inputs, or a measured mean of 0.
    """
    import numpy as np

    m, s = np.asarray(measured, dtype=np.float64), np.asarray(simulated, dtype=np.float64)
    if len(m) != len(s) or not len(m):
        raise ValueError(f"mean_error_interval needs two non-empty arrays of one length, got {len(m)}, {len(s)}")
    if not m.mean() > 0:
        raise ValueError("mean_error_interval: the measured mean must be > 0")
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    idx = rng.integers(0, len(m), size=(BOOTSTRAP_RESAMPLES, len(m)))
    errs = (s[idx].mean(axis=1) - m[idx].mean(axis=1)) / m[idx].mean(axis=1) * 100.0
    return float((s.mean() - m.mean()) / m.mean() * 100.0), float(np.percentile(errs, 2.5)), \
        float(np.percentile(errs, 97.5))


def validate_verdict(errors: dict[str, float | None], goals: dict[str, float],
                     intervals: dict[str, tuple[float, float]] | None = None, noise_note: str | None = None) -> str:
    """The verdict line of a validation: each mean's error against its goal, and whether it exceeds the
    run's noise.

    Args:
        errors: {"mean_ttft": percent, ...} (signed errors, simulated - measured).
        goals: {"ttft": percent, ...}: the largest |error| that meets the goal.
        intervals: {"ttft": (low, high)}: the errors' 95% bootstrap intervals, percent, where known.
        noise_note: what to say when there are no intervals (e.g. the engine's own speed drift).
    """
    parts, ok = [], True
    for m, goal in goals.items():
        e = errors.get(f"mean_{m}")
        if e is None:
            continue
        good = abs(e) <= goal
        ok &= good
        text = f"mean {m.upper()} {e:+.1f}% ({'within' if good else 'outside'} {goal:g}%"
        if intervals and m in intervals:
            lo, hi = intervals[m]
            text += f"; {'beyond' if lo > 0 or hi < 0 else 'within'} the noise, 95% interval {lo:+.1f}% to {hi:+.1f}%"
        parts.append(text + ")")
    tail = "" if intervals else f" (noise: {noise_note or 'not judged: no per-request pairs kept'})"
    return f"verdict: the simulator is {'within' if ok else 'outside'} the goals: " + "; ".join(parts) + tail
