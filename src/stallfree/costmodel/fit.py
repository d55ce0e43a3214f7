"""The fit: efficiency factors and overhead terms of a CostModel from measured steps (fit_steps), with
the error on held-out rows overall, by token-count bucket and by kind of step.

Imports allowed: the standard library and stallfree.costmodel.

The model fitted, per step (CostModel's full mode; C, M, X, A its compute, memory, link and latency
parts at efficiency 1.0, from CostModel.components):
    step_s = max(C / mfu, M / mbu) + X / link_util + A
             + overhead_s + kernel_launch_s x launches + per_token_s x T + per_seq_s x B
For a fixed assignment of each row to its bound (compute or memory) this is linear in 1/mfu, 1/mbu,
1/link_util and the overhead terms; the fit alternates between that bounded linear least-squares solve
and reassigning rows, and keeps the best solution. Residuals are relative ((predicted - measured) /
measured), so short and long steps weigh alike. Bounds: the factors stay in (0, 1] and the overhead
terms >= 0, so a calibrated model is never faster than the floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.measured import BUCKETS, ErrorStats, MeasuredStep, check_fitting_rows, split_rows
from stallfree.costmodel.roofline import EFFICIENCY_KEYWORDS, CostModel

__all__ = ["FIT_PARAMS", "Calibration", "CpuFit", "fit_steps"]

#: What fit_steps can fit.
FIT_PARAMS = ("mfu", "mbu", "link_util", "overhead_s", "kernel_launch_s", "per_token_s", "per_seq_s")
_INV = {"mfu": "inv_mfu", "mbu": "inv_mbu", "link_util": "inv_link"}
_LOWER = {"inv_mfu": 1.0, "inv_mbu": 1.0, "inv_link": 1.0}
_KINDS = ("decode", "prefill", "mixed")

# One row: (compute, memory, link, latency) seconds at efficiency 1.0, kernel launches, tokens, sequences.
_Row = tuple[float, float, float, float, float, float, float]


@dataclass(frozen=True, slots=True)
class CpuFit:
    """CPU time per step as a line in the sequences of the step: step_s + per_seq_s x B.

    Attributes:
        step_s: the fixed part, seconds per step.
        per_seq_s: seconds per sequence in the step.
        test: errors on held-out rows.
        rows: rows the line was fitted to.
    """

    step_s: float
    per_seq_s: float
    test: ErrorStats
    rows: int


@dataclass(frozen=True, slots=True)
class Calibration:
    """Fitted efficiency factors and overhead terms, with the fit error on fitting and held-out rows.

    Attributes:
        mfu, mbu, link_util: fitted fractions of peak (in (0, 1]).
        overhead_s: per-step overhead, seconds (>= 0).
        allreduce_latency_s: the per-call latency used (fitted from an all-reduce table, or given).
        train, test: errors of the fitted model on the rows it was fitted to and on held-out rows.
        floor_test: errors of the uncalibrated model (all factors 1.0, no overhead) on the held-out rows.
        notes: what was held fixed or reached a bound, and where each term comes from.
        kernel_launch_s, per_token_s, per_seq_s: the other overhead terms, seconds (>= 0).
        test_by_bucket: held-out errors per token-count bucket (measured.BUCKETS), as (label, stats).
        test_by_kind: held-out errors per kind of step ('decode', 'prefill', 'mixed'), as (kind, stats).
        floor_by_bucket: the uncalibrated model's held-out errors per bucket.
        cpu: the CPU-overhead line when one was fitted (calibrate_profile), else None.
    """

    mfu: float
    mbu: float
    link_util: float
    overhead_s: float
    allreduce_latency_s: float
    train: ErrorStats
    test: ErrorStats
    floor_test: ErrorStats
    notes: tuple[str, ...] = field(default=())
    kernel_launch_s: float = 0.0
    per_token_s: float = 0.0
    per_seq_s: float = 0.0
    test_by_bucket: tuple[tuple[str, ErrorStats], ...] = ()
    test_by_kind: tuple[tuple[str, ErrorStats], ...] = ()
    floor_by_bucket: tuple[tuple[str, ErrorStats], ...] = ()
    cpu: CpuFit | None = None

    def kwargs(self) -> dict[str, float]:
        """Return the keywords to pass to CostModel / CostModel.from_names."""
        return {key: getattr(self, key) for key in EFFICIENCY_KEYWORDS}


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a small dense system by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row[:n])):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def lstsq(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Least squares by the normal equations (a handful of columns); None when they are singular."""
    k = len(rows[0]) if rows else 0
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    atb = [sum(r[i] * y for r, y in zip(rows, rhs, strict=True)) for i in range(k)]
    return _solve(ata, atb)


def _features(row: _Row, comp_bound: bool) -> dict[str, float]:
    c, m, link, _lat, launches, tokens, seqs = row
    return {
        "inv_mfu": c if comp_bound else 0.0,
        "inv_mbu": 0.0 if comp_bound else m,
        "inv_link": link,
        "overhead_s": 1.0,
        "kernel_launch_s": launches,
        "per_token_s": tokens,
        "per_seq_s": seqs,
    }


def _predict(x: dict[str, float], row: _Row) -> float:
    c, m, link, lat, launches, tokens, seqs = row
    return (
        max(c * x["inv_mfu"], m * x["inv_mbu"])
        + link * x["inv_link"]
        + lat
        + x["overhead_s"]
        + x["kernel_launch_s"] * launches
        + x["per_token_s"] * tokens
        + x["per_seq_s"] * seqs
    )


def _loss(x: dict[str, float], rows: list[_Row], times: list[float]) -> float:
    return sum(((_predict(x, r) - t) / t) ** 2 for r, t in zip(rows, times, strict=True))


def _solve_regime(
    x: dict[str, float], rows: list[_Row], times: list[float], regimes: tuple[bool, ...], active: list[str]
) -> dict[str, float] | None:
    """One bounded linear solve for a fixed regime assignment: a parameter that leaves its range is
    held at its bound and the rest refitted."""
    fixed: dict[str, float] = {}
    for _pass in range(len(active) + 1):
        cols = [f for f in active if f not in fixed]
        a, rhs = [], []
        for row, t, comp_bound in zip(rows, times, regimes, strict=True):
            feats = _features(row, comp_bound)
            rest = row[3] + sum(feats[f] * fixed.get(f, x[f]) for f in feats if f not in cols)
            a.append([feats[f] / t for f in cols])
            rhs.append((t - rest) / t)
        sol = lstsq(a, rhs) if cols else []
        if sol is None:
            return None
        trial = dict(x, **fixed, **dict(zip(cols, sol, strict=True)))
        low = [f for f in cols if trial[f] < _LOWER.get(f, 0.0)]
        if not low:
            return trial
        for f in low:
            fixed[f] = _LOWER.get(f, 0.0)
    return None


def _fit(
    rows: list[_Row], times: list[float], free: list[str], x0: dict[str, float]
) -> tuple[dict[str, float], list[str]]:
    """Alternate regime assignment and bounded linear least squares; return the best parameters found."""
    x, best, best_loss = dict(x0), dict(x0), _loss(x0, rows, times)
    seen: set[tuple[bool, ...]] = set()
    solved = False
    for _ in range(60):
        regimes = tuple(r[0] * x["inv_mfu"] >= r[1] * x["inv_mbu"] for r in rows)
        if regimes in seen:
            break
        seen.add(regimes)
        active = [
            f
            for f in free
            if not (f == "inv_mfu" and not any(regimes)) and not (f == "inv_mbu" and all(regimes))
        ]
        trial = _solve_regime(x, rows, times, regimes, active)
        if trial is None:
            break
        solved = True
        x = trial
        loss = _loss(x, rows, times)
        if loss < best_loss:
            best, best_loss = dict(x), loss
    names = {v: k for k, v in _INV.items()}
    if not solved:
        return best, ["the least-squares system is singular for these rows (too few, or the fitted terms are "
                      "the same column): nothing was fitted"]
    notes = [
        f"{names.get(f, f)} reached its bound ({'1.0' if f in _LOWER else '0'})"
        for f in free
        if best[f] == _LOWER.get(f, 0.0)
    ]
    return best, notes


def _groups(
    params: dict[str, float], rows: list[_Row], steps: Sequence[MeasuredStep], idx: list[int], key: str
) -> tuple[tuple[str, ErrorStats], ...]:
    labels = [b[0] for b in BUCKETS] if key == "bucket" else list(_KINDS)
    errs: dict[str, list[float]] = {label: [] for label in labels}
    for i in idx:
        s = steps[i]
        errs[s.bucket() if key == "bucket" else s.kind()].append(
            abs(_predict(params, rows[i]) - s.seconds) / s.seconds
        )
    return tuple((label, ErrorStats.of(errs[label])) for label in labels)


def _counts(base: CostModel, s: MeasuredStep) -> tuple[int, float, float, int]:
    """A measured step's (tokens, pairs, cached tokens read, sampled) as `base` prices them (windows, MLA)."""
    tokens, _, _, sampled = s.counts()
    pairs, kv = base.attention_counts(
        s.num_prefill_tokens, s.prefill_context_sum, s.num_decodes, s.num_tokens - s.num_prefill_tokens,
        s.decode_context_sum,
    )
    return tokens, pairs, kv, sampled


def fit_steps(
    base: CostModel,
    steps: Sequence[MeasuredStep],
    fit: Sequence[str] = ("mfu", "mbu", "overhead_s"),
    holdout: float = 0.2,
    seed: int = 0,
) -> Calibration:
    """Fit efficiency factors and overhead terms of `base` (its model, GPU, tp, dtypes) to measured steps.

    Args:
        base: the cost model to calibrate; parameters not in `fit` keep its values.
        steps: measured steps.
        fit: which of FIT_PARAMS to fit. overhead_s and kernel_launch_s are the same column for one
            model (the launches per step are fixed by its layers), so they are not fitted together;
            link_util is nearly collinear with mfu when every step is compute bound (fit it from an
            all-reduce table instead, see fit_allreduce).
        holdout: fraction of rows held out (seeded shuffle) to measure the fit error.
        seed: the shuffle's seed.

    Raises:
        CostModelError: an unknown parameter name, overhead_s with kernel_launch_s, or fewer fitting
            rows than parameters + 1 (measured.check_fitting_rows: too few steps, or too many held out).
    """
    bad = [f for f in fit if f not in FIT_PARAMS]
    if bad:
        raise CostModelError(f"cannot fit {', '.join(map(repr, bad))}; choose from {', '.join(FIT_PARAMS)}")
    if "overhead_s" in fit and "kernel_launch_s" in fit:
        raise CostModelError(
            "cannot fit overhead_s and kernel_launch_s together: for one model both are a constant per "
            "step; fit one of them"
        )
    train_idx, test_idx = split_rows(len(steps), holdout, seed)
    check_fitting_rows(len(train_idx), len(steps), len(fit), len(fit) + 1, holdout, "measured steps")
    launches = float(base.kernel_launches)
    rows: list[_Row] = [
        (*base.components(*_counts(base, s)), launches, float(s.num_tokens), float(s.sequences())) for s in steps
    ]
    times = [s.seconds for s in steps]
    x0 = {
        "inv_mfu": 1 / base.mfu,
        "inv_mbu": 1 / base.mbu,
        "inv_link": 1 / base.link_util,
        "overhead_s": base.overhead_s,
        "kernel_launch_s": base.kernel_launch_s,
        "per_token_s": base.per_token_s,
        "per_seq_s": base.per_seq_s,
    }
    free = [_INV.get(f, f) for f in fit]
    x, notes = _fit([rows[i] for i in train_idx], [times[i] for i in train_idx], free, x0)
    floor = dict.fromkeys(x0, 0.0) | {"inv_mfu": 1.0, "inv_mbu": 1.0, "inv_link": 1.0}

    def errors(params: dict[str, float], idx: list[int]) -> ErrorStats:
        return ErrorStats.of([abs(_predict(params, rows[i]) - times[i]) / times[i] for i in idx])

    held = [n for n in FIT_PARAMS if n not in fit]
    if held:
        notes.insert(0, "held fixed: " + ", ".join(held))
    return Calibration(
        mfu=1 / x["inv_mfu"],
        mbu=1 / x["inv_mbu"],
        link_util=1 / x["inv_link"],
        overhead_s=x["overhead_s"],
        allreduce_latency_s=base.allreduce_latency_s,
        train=errors(x, train_idx),
        test=errors(x, test_idx),
        floor_test=errors(floor, test_idx),
        notes=tuple(notes),
        kernel_launch_s=x["kernel_launch_s"],
        per_token_s=x["per_token_s"],
        per_seq_s=x["per_seq_s"],
        test_by_bucket=_groups(x, rows, steps, test_idx, "bucket"),
        test_by_kind=_groups(x, rows, steps, test_idx, "kind"),
        floor_by_bucket=_groups(floor, rows, steps, test_idx, "bucket"),
    )


def describe(cal: Calibration) -> dict[str, Any]:
    """Return the calibration as the JSON object `stallfree calibrate --json` prints (units in the keys)."""
    out: dict[str, Any] = {
        "mfu": cal.mfu,
        "mbu": cal.mbu,
        "link_util": cal.link_util,
        "overhead_ms": cal.overhead_s * 1e3,
        "allreduce_latency_us": cal.allreduce_latency_s * 1e6,
        "kernel_launch_us": cal.kernel_launch_s * 1e6,
        "per_token_us": cal.per_token_s * 1e6,
        "per_seq_us": cal.per_seq_s * 1e6,
        "train_error": cal.train.as_dict(),
        "test_error": cal.test.as_dict(),
        "uncalibrated_test_error": cal.floor_test.as_dict(),
        "test_error_by_bucket": {k: v.as_dict() for k, v in cal.test_by_bucket},
        "uncalibrated_test_error_by_bucket": {k: v.as_dict() for k, v in cal.floor_by_bucket},
        "test_error_by_kind": {k: v.as_dict() for k, v in cal.test_by_kind},
        "notes": list(cal.notes),
    }
    if cal.cpu is not None:
        out["cpu_overhead"] = {
            "step_ms": cal.cpu.step_s * 1e3,
            "per_seq_us": cal.cpu.per_seq_s * 1e6,
            "rows": cal.cpu.rows,
            "test_error": cal.cpu.test.as_dict(),
        }
    return out
