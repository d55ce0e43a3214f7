"""Calibration: fit the cost model's efficiency factors and per-step overhead to measured step times,
and report the fit error on held-out rows.

Imports allowed: the standard library and stallfree.costmodel.

Two sources of measurements:
- a step CSV (read_steps_csv), one row per measured step. Columns (header names; order free):
    num_tokens           tokens in the step (required)
    num_decodes          decodes in the step (required)
    decode_context_sum   sum over the decodes of the tokens already in their KV cache (required)
    seconds              the measured step time, seconds (required)
    num_prefill_tokens   prompt tokens in the step (default num_tokens - num_decodes)
    prefill_context_sum  sum over the prefill chunks of their start (default 0)
    num_sampled          tokens that sample (default num_decodes)
    step                 ignored (any other column is ignored too)
  The attention pairs of the prefill part are worked out as if it were one chunk (exact when it is):
  P x p + P(P + 1)/2 for P prefill tokens at offset p = prefill_context_sum.
- per-layer kernel tables (steps_from_profile): mlp, attention and all-reduce times as published by
  the Vidur project (MLSys 2024); a step's time is composed from them as L x (linear ops + attention) +
  embedding + 2 x L all-reduces, which is how that simulator composes its steps.

The fit: step_s = max(C / mfu, M / mbu) + X / link_util + A + overhead_s, with C, M, X, A the model's
parts at efficiency 1.0 (CostModel.components). For a fixed assignment of each row to its bound
(compute or memory) the model is linear in 1/mfu, 1/mbu, 1/link_util and overhead_s; the fit
alternates between that linear least-squares solve and reassigning rows, keeping the best solution.
Residuals are relative ((predicted - measured) / measured), so short and long steps weigh alike.
"""

from __future__ import annotations

import csv
import gzip
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.hardware import normalize_name
from stallfree.costmodel.roofline import CostModel

__all__ = [
    "BUILTIN_PROFILES",
    "AllReduceFit",
    "Calibration",
    "ErrorStats",
    "MeasuredStep",
    "calibrate_profile",
    "fit_allreduce",
    "fit_steps",
    "read_steps_csv",
    "steps_from_profile",
]

#: Profiles shipped in data/profiles: name -> (model, gpu, tp).
BUILTIN_PROFILES: dict[str, tuple[str, str, int]] = {
    "a100-codellama34b-tp2": ("codellama-34b", "a100-sxm-80gb", 2),
}
_PARAMS = ("mfu", "mbu", "link_util", "overhead_s")


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One measured step: its token counts (tokens) and its time (seconds)."""

    num_tokens: int
    num_decodes: int
    decode_context_sum: int
    seconds: float
    num_prefill_tokens: int = 0
    prefill_context_sum: int = 0
    num_sampled: int | None = None

    def counts(self) -> tuple[int, float, float, int]:
        """Return (tokens, attention pairs, cached tokens read, sampled tokens) for CostModel.components."""
        nd, p_tok = self.num_decodes, self.num_prefill_tokens
        dec_tok = self.num_tokens - p_tok
        pairs = float(p_tok * self.prefill_context_sum + p_tok * (p_tok + 1) / 2)
        if nd:
            k = dec_tok / nd
            pairs += k * self.decode_context_sum + dec_tok * (k + 1) / 2
        sampled = nd if self.num_sampled is None else self.num_sampled
        return self.num_tokens, pairs, float(self.decode_context_sum + self.prefill_context_sum), sampled


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """Absolute relative errors |predicted - measured| / measured over some rows (fractions, not %)."""

    rows: int
    mean: float
    median: float
    p90: float
    max: float

    @staticmethod
    def of(errors: Sequence[float]) -> ErrorStats:
        """Summarise a list of absolute relative errors."""
        e = sorted(errors)
        if not e:
            return ErrorStats(0, 0.0, 0.0, 0.0, 0.0)
        return ErrorStats(
            len(e), sum(e) / len(e), e[len(e) // 2], e[min(len(e) - 1, int(0.9 * len(e)))], e[-1]
        )


@dataclass(frozen=True, slots=True)
class Calibration:
    """Fitted efficiency factors and overhead, with the fit error on training and held-out rows.

    Attributes:
        mfu, mbu, link_util: fitted fractions of peak (clamped to (0, 1]).
        overhead_s: fitted per-step overhead, seconds (>= 0).
        allreduce_latency_s: the per-call latency used (fitted from an all-reduce table, or given).
        train, test: errors of the fitted model on the rows it was fitted to and on held-out rows.
        floor_test: errors of the uncalibrated model (all factors 1.0) on the held-out rows.
        notes: what was held fixed or clamped, and why.
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

    def kwargs(self) -> dict[str, float]:
        """Return the keywords to pass to CostModel / CostModel.from_names."""
        return {
            "mfu": self.mfu,
            "mbu": self.mbu,
            "link_util": self.link_util,
            "overhead_s": self.overhead_s,
            "allreduce_latency_s": self.allreduce_latency_s,
        }


# ---- reading -------------------------------------------------------------------------------------
def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115 - the caller closes it


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    try:
        with _open_text(path) as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or ()), rows
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CostModelError(f"cannot read {str(path)!r}: {exc}") from None


def _cell(where: str, row: dict[str, str], col: str, default: float | None, integer: bool) -> Any:
    """Return one CSV cell as an int (or a float) >= 0; seconds must be > 0."""
    raw = row.get(col)
    if raw is None or raw == "":
        if default is None:
            raise CostModelError(f"{where}: column {col!r} is empty")
        return default
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        raise CostModelError(f"{where}: column {col!r} is not a number: {raw!r}") from None
    # Finite, and below 1e12 (tokens or seconds): a measured step never comes near it.
    if not 0 <= value < 1e12 or (col == "seconds" and not value > 0):
        raise CostModelError(f"{where}: column {col!r} out of range: {raw!r}")
    return value


def read_steps_csv(path: str | Path) -> list[MeasuredStep]:
    """Read measured steps from a CSV with the columns of the module docstring.

    Raises:
        CostModelError: the file cannot be read, a required column is missing (named), or a value is
            not a number or out of range (the row and column are named).
    """
    p = Path(path)
    header, rows = _read_rows(p)
    for col in ("num_tokens", "num_decodes", "decode_context_sum", "seconds"):
        if col not in header:
            raise CostModelError(f"{str(p)!r}: missing column {col!r} (have: {', '.join(header)})")
    out = []
    for i, row in enumerate(rows, start=2):
        where = f"{str(p)!r} line {i}"

        def num(
            col: str,
            default: float | None = None,
            integer: bool = True,
            row: dict[str, str] = row,
            at: str = where,
        ) -> Any:
            return _cell(at, row, col, default, integer)

        tokens, nd = num("num_tokens"), num("num_decodes")
        prefill = num("num_prefill_tokens", tokens - nd)
        if prefill < 0 or prefill > tokens or nd > tokens - prefill:
            raise CostModelError(
                f"{where}: num_decodes {nd} + num_prefill_tokens {prefill} exceed num_tokens {tokens}"
            )
        sampled = row.get("num_sampled")
        out.append(
            MeasuredStep(
                num_tokens=tokens,
                num_decodes=nd,
                decode_context_sum=num("decode_context_sum"),
                seconds=num("seconds", integer=False),
                num_prefill_tokens=prefill,
                prefill_context_sum=num("prefill_context_sum", 0),
                num_sampled=num("num_sampled") if sampled else None,
            )
        )
    if not out:
        raise CostModelError(f"{str(p)!r} holds no rows")
    return out


# ---- least squares -------------------------------------------------------------------------------
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


def _lstsq(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    k = len(rows[0]) if rows else 0
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    atb = [sum(r[i] * y for r, y in zip(rows, rhs, strict=True)) for i in range(k)]
    return _solve(ata, atb)


_Comp = tuple[float, float, float, float]


def _predict(x: dict[str, float], comp: _Comp) -> float:
    c, m, link, lat = comp
    return max(c * x["inv_mfu"], m * x["inv_mbu"]) + link * x["inv_link"] + lat + x["overhead_s"]


def _loss(x: dict[str, float], comps: list[_Comp], times: list[float]) -> float:
    return sum(((_predict(x, c) - t) / t) ** 2 for c, t in zip(comps, times, strict=True))


def _fit(
    comps: list[_Comp], times: list[float], free: list[str], x0: dict[str, float]
) -> tuple[dict[str, float], list[str]]:
    """Alternate regime assignment and bounded linear least squares; return the best parameters found."""
    lower = {"inv_mfu": 1.0, "inv_mbu": 1.0, "inv_link": 1.0, "overhead_s": 0.0}
    x, best, best_loss, notes = dict(x0), dict(x0), _loss(x0, comps, times), []
    seen: set[tuple[bool, ...]] = set()
    for _ in range(60):
        regimes = tuple(c[0] * x["inv_mfu"] >= c[1] * x["inv_mbu"] for c in comps)
        if regimes in seen:
            break
        seen.add(regimes)
        active = [
            f
            for f in free
            if not (f == "inv_mfu" and not any(regimes)) and not (f == "inv_mbu" and all(regimes))
        ]
        fixed: dict[str, float] = {}
        for _pass in range(len(active) + 1):
            cols = [f for f in active if f not in fixed]
            rows, rhs = [], []
            for (c, m, link, lat), t, comp_bound in zip(comps, times, regimes, strict=True):
                feats = {
                    "inv_mfu": c if comp_bound else 0.0,
                    "inv_mbu": 0.0 if comp_bound else m,
                    "inv_link": link,
                    "overhead_s": 1.0,
                }
                rest = lat + sum(
                    feats[f] * (fixed[f] if f in fixed else x[f]) for f in feats if f not in cols
                )
                rows.append([feats[f] / t for f in cols])
                rhs.append((t - rest) / t)
            sol = _lstsq(rows, rhs) if cols else []
            if sol is None:
                break
            trial = dict(x, **fixed, **dict(zip(cols, sol, strict=True)))
            low = [f for f in cols if trial[f] < lower[f]]
            if not low:
                x = trial
                break
            for f in low:  # hold a parameter that wants to leave its range at the bound, refit the rest
                fixed[f] = lower[f]
        loss = _loss(x, comps, times)
        if loss < best_loss:
            best, best_loss = dict(x), loss
    for f in free:
        if best[f] == lower[f]:
            notes.append(f"{_NAMES[f]} reached its bound ({'1.0' if f != 'overhead_s' else '0'})")
    return best, notes


_NAMES = {"inv_mfu": "mfu", "inv_mbu": "mbu", "inv_link": "link_util", "overhead_s": "overhead_s"}


def _split(n: int, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    if not 0 < holdout < 1:
        raise CostModelError(f"holdout must be in (0, 1), got {holdout!r}")
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_test = max(1, round(n * holdout))
    return sorted(idx[n_test:]), sorted(idx[:n_test])


def fit_steps(
    base: CostModel,
    steps: Sequence[MeasuredStep],
    fit: Sequence[str] = ("mfu", "mbu", "overhead_s"),
    holdout: float = 0.2,
    seed: int = 0,
) -> Calibration:
    """Fit efficiency factors and overhead of `base` (its model, GPU, tp, dtypes, mode) to measured steps.

    Args:
        base: the cost model to calibrate; parameters not in `fit` keep its values.
        steps: measured steps.
        fit: which of 'mfu', 'mbu', 'link_util', 'overhead_s' to fit (link_util and overhead_s are
            nearly collinear with mfu when every step is compute bound; fit link_util from an
            all-reduce table instead, see fit_allreduce).
        holdout: fraction of rows held out (seeded shuffle) to measure the fit error.
        seed: the shuffle's seed.

    Raises:
        CostModelError: an unknown parameter name, or fewer training rows than parameters + 1.
    """
    bad = [f for f in fit if f not in _PARAMS]
    if bad:
        raise CostModelError(f"cannot fit {', '.join(bad)}; choose from {', '.join(_PARAMS)}")
    train_idx, test_idx = _split(len(steps), holdout, seed)
    if len(train_idx) < len(fit) + 1:
        raise CostModelError(
            f"need at least {len(fit) + 2} measured steps to fit {len(fit)} parameters, got {len(steps)}"
        )
    comps = [base.components(*s.counts()) for s in steps]
    times = [s.seconds for s in steps]
    x0 = {
        "inv_mfu": 1 / base.mfu,
        "inv_mbu": 1 / base.mbu,
        "inv_link": 1 / base.link_util,
        "overhead_s": base.overhead_s,
    }
    inv = {"mfu": "inv_mfu", "mbu": "inv_mbu", "link_util": "inv_link", "overhead_s": "overhead_s"}
    x, notes = _fit([comps[i] for i in train_idx], [times[i] for i in train_idx], [inv[f] for f in fit], x0)
    floor = {"inv_mfu": 1.0, "inv_mbu": 1.0, "inv_link": 1.0, "overhead_s": 0.0}

    def errors(params: dict[str, float], idx: list[int]) -> ErrorStats:
        return ErrorStats.of([abs(_predict(params, comps[i]) - times[i]) / times[i] for i in idx])

    held = [n for n in _PARAMS if n not in fit]
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
    )


# ---- kernel tables -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AllReduceFit:
    """t = latency_s + 2(n-1)/n x bytes / bw_bytes_per_s, fitted to an all-reduce table.

    Attributes:
        latency_s: per-call latency, seconds.
        bw_bytes_per_s: effective per-direction bandwidth, B/s.
        link_util: bw_bytes_per_s / the GPU's link bandwidth (<= 1: fit_allreduce refuses more).
        test: errors on held-out rows.
    """

    latency_s: float
    bw_bytes_per_s: float
    link_util: float
    test: ErrorStats

    def seconds(self, nbytes: float, n: int) -> float:
        """Predicted all-reduce time of `nbytes` bytes over `n` GPUs, seconds."""
        return self.latency_s + 2 * (n - 1) / n * nbytes / self.bw_bytes_per_s


def _profile_dir(profile: str | Path) -> tuple[Path | Any, tuple[str, str, int] | None]:
    key = normalize_name(str(profile))
    if key in BUILTIN_PROFILES:
        folder = resources.files("stallfree.costmodel").joinpath("data/profiles/" + key.replace("-", "_"))
        return folder, BUILTIN_PROFILES[key]
    p = Path(profile)
    if not p.is_dir():
        raise CostModelError(
            f"unknown profile {str(profile)!r}: not a folder; "
            f"built-in profiles: {', '.join(BUILTIN_PROFILES)}"
        )
    return p, None


def _table(folder: Path | Any, name: str) -> list[dict[str, str]]:
    for candidate in (name, name + ".gz"):
        path = folder.joinpath(candidate)
        if path.is_file():
            return _read_rows(Path(str(path)))[1]
    raise CostModelError(f"profile folder {str(folder)!r} has no {name} (or {name}.gz)")


def _ms(row: dict[str, str], op: str) -> float:
    raw = row.get(f"time_stats.{op}.median", "")
    return float(raw) * 1e-3 if raw not in ("", None) else 0.0


def fit_allreduce(
    rows: list[dict[str, str]], base: CostModel, holdout: float = 0.2, seed: int = 0
) -> AllReduceFit:
    """Fit latency and bandwidth to all-reduce rows (num_workers, size in BYTES, median ms).

    The `size` column is the message size in bytes (Vidur's all_reduce.csv; read as fp16 elements it
    would make 2 x A100 move 316 GB/s over NVLink3's 300 GB/s per direction). A fit that implies a
    bandwidth above the group's link peak (GPUSpec.allreduce_bw) is physically impossible and is refused:
    it means the sizes are in the wrong unit or the table is not for this GPU.

    Raises:
        CostModelError: fewer than 3 rows for base.tp GPUs; no positive bandwidth; or a fitted bandwidth
            above the link's peak (the message gives both, in GB/s).
    """
    n = base.tp
    pts = [
        (float(r["size"]), _ms(r, "all_reduce"))
        for r in rows
        if r.get("collective", "all_reduce") == "all_reduce"
        and int(r["num_workers"]) == n
        and _ms(r, "all_reduce") > 0
    ]
    if len(pts) < 3:
        raise CostModelError(f"the all-reduce table has {len(pts)} rows for {n} GPUs; need at least 3")
    train, test = _split(len(pts), holdout, seed)
    ring = 2 * (n - 1) / n
    sol = _lstsq([[1 / pts[i][1], ring * pts[i][0] / pts[i][1]] for i in train], [1.0] * len(train))
    if sol is None or sol[1] <= 0:
        raise CostModelError("the all-reduce table does not determine a bandwidth")
    lat, inv_bw = max(sol[0], 0.0), sol[1]
    peak = base.gpu.allreduce_bw(n)
    if 1 / inv_bw > peak * (1 + 1e-9):
        raise CostModelError(
            f"the all-reduce fit implies {1 / inv_bw / 1e9:.0f} GB/s per direction over {n} x {base.gpu.key}, "
            f"above the link's peak of {peak / 1e9:.0f} GB/s, which is physically impossible; is the size "
            "column in bytes, and is the table for this GPU?"
        )
    fitted = AllReduceFit(lat, 1 / inv_bw, (1 / inv_bw) / peak, ErrorStats(0, 0, 0, 0, 0))
    errs = [abs(fitted.seconds(pts[i][0], n) - pts[i][1]) / pts[i][1] for i in test]
    return AllReduceFit(fitted.latency_s, fitted.bw_bytes_per_s, fitted.link_util, ErrorStats.of(errs))


_LINEAR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


def steps_from_profile(
    profile: str | Path, base: CostModel, allreduce: AllReduceFit, mixed_stride: int = 7
) -> list[MeasuredStep]:
    """Compose whole-step times from per-layer kernel tables (one folder with mlp.csv, attention.csv).

    A step's time = L x (linear ops(T) + attention ops) + embedding(T) + 2 x L x all-reduce(T x h x 2 B),
    with the all-reduce taken from `allreduce`. Steps: every decode-only row (batch B at context K)
    and every prefill row (one chunk c at offset p) whose token count is in the mlp table, plus mixed
    steps (a chunk and a decode batch together) taken every `mixed_stride`-th combination. The lm_head
    is not in the tables, so the steps have num_sampled = 0.

    Raises:
        CostModelError: the folder or a table is missing, or no row matches.
    """
    folder, _ = _profile_dir(profile)
    m = base.model
    linear = {}
    emb = {}
    for r in _table(folder, "mlp.csv"):
        t = int(r["num_tokens"])
        linear[t] = sum(_ms(r, op) for op in _LINEAR_OPS)
        emb[t] = _ms(r, "emb")
    decode, prefill = {}, {}
    for r in _table(folder, "attention.csv"):
        k = int(r["kv_cache_size"])
        reshape = _ms(r, "attn_input_reshape") + _ms(r, "attn_output_reshape")
        if r["is_prefill"] == "True":
            prefill[(int(r["prefill_chunk_size"]), k)] = _ms(r, "attn_prefill") + reshape
        else:
            decode[(int(r["batch_size"]), k)] = _ms(r, "attn_decode") + reshape
    layers, ar_bytes = m.num_layers, m.hidden_size * 2

    def step_s(tokens: int, attn: float) -> float:
        return (
            layers * (linear[tokens] + attn)
            + emb[tokens]
            + 2 * layers * allreduce.seconds(tokens * ar_bytes, base.tp)
        )

    out = [
        MeasuredStep(b, b, b * k, step_s(b, a), 0, 0, 0)
        for (b, k), a in sorted(decode.items())
        if b in linear
    ]
    out += [
        MeasuredStep(c, 0, 0, step_s(c, a), c, p, 0) for (c, p), a in sorted(prefill.items()) if c in linear
    ]
    batches = [(b, k) for (b, k) in sorted(decode) if b in (16, 32, 64, 128) and k in (512, 1024, 2048, 4032)]
    combos = [(c, p, b, k) for (c, p) in sorted(prefill) for (b, k) in batches if c + b in linear]
    for c, p, b, k in combos[::mixed_stride]:
        out.append(MeasuredStep(c + b, b, b * k, step_s(c + b, prefill[(c, p)] + decode[(b, k)]), c, p, 0))
    if not out:
        raise CostModelError(
            f"profile {str(profile)!r}: no attention row matches a token count of the mlp table"
        )
    return out


def calibrate_profile(
    profile: str | Path = "a100-codellama34b-tp2",
    base: CostModel | None = None,
    holdout: float = 0.2,
    seed: int = 0,
    stride: int = 1,
) -> tuple[Calibration, AllReduceFit, int]:
    """Calibrate against kernel tables: fit the all-reduce line, compose steps, fit mfu, mbu and overhead.

    Args:
        profile: a built-in profile name (BUILTIN_PROFILES) or a folder with mlp.csv, attention.csv
            and all_reduce.csv (optionally .gz).
        base: the cost model to calibrate; None builds the built-in profile's model, GPU and tp in bf16.
        stride: use every stride-th composed step (1 = all), to trade accuracy for time.

    Returns:
        (the step calibration, the all-reduce fit, the number of composed steps used).

    Raises:
        CostModelError: base is None for a folder that is not a built-in profile, or a table is bad.
    """
    folder, builtin = _profile_dir(profile)
    if base is None:
        if builtin is None:
            raise CostModelError(
                f"profile {str(profile)!r} is a folder: give the cost model (model, gpu, tp)"
            )
        base = CostModel.from_names(builtin[0], builtin[1], tp=builtin[2], dtype="fp16")
    ar = fit_allreduce(_table(folder, "all_reduce.csv"), base, holdout, seed)
    base = base.replace(link_util=ar.link_util, allreduce_latency_s=ar.latency_s)
    steps = steps_from_profile(profile, base, ar)[:: max(1, stride)]
    return fit_steps(base, steps, ("mfu", "mbu", "overhead_s"), holdout, seed), ar, len(steps)
