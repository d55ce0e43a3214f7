"""Kernel tables: fit the all-reduce line (fit_allreduce), compose whole steps from per-layer kernel
times (steps_from_profile), fit the CPU time per step (fit_cpu_overheads), and calibrate a cost model
against all of them (calibrate_profile).

Imports allowed: the standard library and stallfree.costmodel.

The tables are those published by the Vidur project (MLSys 2024): per-layer mlp and attention kernel
times, all-reduce times by message size in bytes, and per-step CPU overheads by batch size. A step's
time is composed as L x (linear ops(T) + attention) + embedding(T) + 2 x L all-reduces (the measured
all-reduce table, interpolated), which is how that simulator composes its steps.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from stallfree.costmodel.errors import CostModelError, CostModelWarning
from stallfree.costmodel.fit import Calibration, CpuFit, fit_steps, lstsq
from stallfree.costmodel.hardware import normalize_name
from stallfree.costmodel.measured import ErrorStats, MeasuredStep, check_fitting_rows, read_rows, split_rows
from stallfree.costmodel.roofline import CostModel

__all__ = [
    "BUILTIN_PROFILES",
    "PROFILE_FIT",
    "AllReduceFit",
    "MeasuredAllReduce",
    "calibrate_profile",
    "fit_allreduce",
    "fit_cpu_overheads",
    "steps_from_profile",
]

#: Profiles shipped in data/profiles: name -> (model, gpu, tp).
BUILTIN_PROFILES: dict[str, tuple[str, str, int]] = {
    "a100-codellama34b-tp2": ("codellama-34b", "a100-sxm-80gb", 2),
}
#: What calibrate_profile fits to the composed steps (the CPU terms come from cpu_overheads.csv).
PROFILE_FIT = ("mfu", "mbu", "kernel_launch_s", "per_token_s", "per_seq_s")
#: The per-step CPU costs of cpu_overheads.csv that the CPU line sums (median columns, ms).
CPU_COLUMNS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")


class _AllReduceTime(Protocol):
    def seconds(self, nbytes: float, n: int) -> float: ...


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
            return read_rows(Path(str(path)))[1]
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
        CostModelError: fewer than 3 rows for base.tp GPUs, or a holdout that leaves fewer than 2 to fit; no
            positive bandwidth; or a fitted bandwidth above the link's peak (the message gives both, in GB/s).
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
    train, test = split_rows(len(pts), holdout, seed)
    check_fitting_rows(len(train), len(pts), 2, 2, holdout, f"all-reduce rows for {n} GPUs")
    ring = 2 * (n - 1) / n
    sol = lstsq([[1 / pts[i][1], ring * pts[i][0] / pts[i][1]] for i in train], [1.0] * len(train))
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


@dataclass(frozen=True, slots=True)
class MeasuredAllReduce:
    """The measured all-reduce table itself as a time per message: linear interpolation between the
    two nearest measured sizes (bytes), proportional beyond the largest, the smallest's time below it.

    Attributes:
        sizes: measured message sizes, bytes, ascending.
        seconds_at: the median time at each size, seconds.
    """

    sizes: tuple[float, ...]
    seconds_at: tuple[float, ...]

    @staticmethod
    def of(rows: list[dict[str, str]], n: int) -> MeasuredAllReduce:
        """Build from all-reduce rows for `n` GPUs (size in bytes, median ms; one time per size).

        Raises:
            CostModelError: no row for n GPUs.
        """
        by_size: dict[float, float] = {}
        for r in rows:
            if r.get("collective", "all_reduce") == "all_reduce" and int(r["num_workers"]) == n:
                t = _ms(r, "all_reduce")
                if t > 0:
                    by_size.setdefault(float(r["size"]), t)
        if not by_size:
            raise CostModelError(f"the all-reduce table has no rows for {n} GPUs")
        sizes = tuple(sorted(by_size))
        return MeasuredAllReduce(sizes, tuple(by_size[s] for s in sizes))

    def seconds(self, nbytes: float, n: int) -> float:
        """The all-reduce time of `nbytes` bytes, seconds (`n` is the table's group size)."""
        xs, ys = self.sizes, self.seconds_at
        i = bisect.bisect_left(xs, nbytes)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1] * nbytes / xs[-1]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


def steps_from_profile(
    profile: str | Path, base: CostModel, allreduce: _AllReduceTime, mixed_stride: int = 7
) -> list[MeasuredStep]:
    """Compose whole-step times from per-layer kernel tables (one folder with mlp.csv, attention.csv).

    A step's time = L x (linear ops(T) + attention ops) + embedding(T) + 2 x L x all-reduce(T x h x 2 B),
    with the all-reduce taken from `allreduce` (MeasuredAllReduce, the table itself, or an AllReduceFit).
    Steps: every decode-only row (batch B at context K)
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


def fit_cpu_overheads(rows: list[dict[str, str]], holdout: float = 0.2, seed: int = 0) -> CpuFit:
    """Fit the CPU time per step, step_s + per_seq_s x batch, to a cpu_overheads table.

    Each row's time is the sum of the median columns of CPU_COLUMNS (scheduling, sampling, input
    preparation, output processing; ms) at its `batch_size` (sequences in the step).

    Raises:
        CostModelError: fewer than 3 rows, a holdout that leaves fewer than 2 to fit, a missing column
            (named), or no line (all one batch size).
    """
    pts = []
    for i, r in enumerate(rows, start=2):
        try:
            t = sum(float(r[f"{c}_median"]) for c in CPU_COLUMNS) * 1e-3
            pts.append((float(r["batch_size"]), t))
        except KeyError as exc:
            raise CostModelError(f"cpu_overheads line {i}: missing column {exc.args[0]!r}") from None
        except ValueError:
            raise CostModelError(f"cpu_overheads line {i}: a value is not a number") from None
    if len(pts) < 3:
        raise CostModelError(f"the cpu_overheads table has {len(pts)} rows; need at least 3")
    train, test = split_rows(len(pts), holdout, seed)
    check_fitting_rows(len(train), len(pts), 2, 2, holdout, "rows of the cpu_overheads table")
    sol = lstsq([[1 / pts[i][1], pts[i][0] / pts[i][1]] for i in train], [1.0] * len(train))
    if sol is None:
        raise CostModelError("the cpu_overheads table does not determine a line (one batch size only?)")
    step_s, per_seq_s = max(sol[0], 0.0), max(sol[1], 0.0)
    errs = [abs(step_s + per_seq_s * pts[i][0] - pts[i][1]) / pts[i][1] for i in test]
    return CpuFit(step_s, per_seq_s, ErrorStats.of(errs), len(train))


#: The mlp table's columns that say what it was measured on, with the ModelSpec field each is (the vocab_size
#: column is left out: Vidur pads it, 32,768 for CodeLlama's 32,000).
_SHAPE_COLUMNS = (("n_embd", "hidden_size"), ("n_head", "num_heads"), ("n_kv_head", "num_kv_heads"),
                  ("n_expanded_embd", "intermediate_size"))
_SHAPE_WORDS = {"hidden_size": "hidden size", "num_heads": "query heads", "num_kv_heads": "KV heads",
                "intermediate_size": "MLP size"}


def _measured_elsewhere(profile: str | Path, folder: Path | Any, builtin: tuple[str, str, int] | None,
                        base: CostModel) -> str | None:
    """The warning for kernel tables measured on another model shape, tensor-parallel degree or GPU than
    base's, or None. The shape and the degree are the mlp table's own columns (any it lacks is not compared);
    the GPU is known for a built-in profile only (a folder's tables do not record it)."""
    rows = _table(folder, "mlp.csv")
    first = rows[0] if rows else {}
    measured: dict[str, int] = {}
    for column, field in (*_SHAPE_COLUMNS, ("num_tensor_parallel_workers", "tp")):
        try:
            measured[field] = int(first[column])
        except (KeyError, ValueError):
            pass
    named = {field: getattr(base.model, field) for _, field in _SHAPE_COLUMNS} | {"tp": base.tp}
    differ = []
    shape = [f for _, f in _SHAPE_COLUMNS if f in measured]
    if any(measured[f] != named[f] for f in shape):
        of = f" ({builtin[0]})" if builtin is not None else ""
        differ.append(f"on a model of {', '.join(f'{_SHAPE_WORDS[f]} {measured[f]}' for f in shape)}{of}, where "
                      f"{base.model.key} has {', '.join(str(named[f]) for f in shape)}")
    if "tp" in measured and measured["tp"] != base.tp:
        differ.append(f"at tp {measured['tp']}, not {base.tp}")
    if builtin is not None and normalize_name(builtin[1]) != normalize_name(base.gpu.key):
        differ.append(f"on {builtin[1]}, not {base.gpu.key}")
    if not differ:
        return None
    return (f"profile {str(profile)!r} was measured {'; '.join(differ)}: the factors fitted to it are of those "
            f"kernel times, not of {base.model.key} at tp {base.tp} on {base.gpu.key}")


def calibrate_profile(
    profile: str | Path = "a100-codellama34b-tp2",
    base: CostModel | None = None,
    holdout: float = 0.2,
    seed: int = 0,
    stride: int = 1,
) -> tuple[Calibration, AllReduceFit, int]:
    """Calibrate against kernel tables: fit the all-reduce line, compose steps from the measured
    kernels, fit PROFILE_FIT to them, and add the CPU line of cpu_overheads.csv when the folder has one.

    The errors of the returned Calibration are on GPU time (the composed steps hold no CPU time); its
    overhead_s and part of its per_seq_s are the CPU line's (see its notes), so that CostModel(**kwargs())
    prices a whole engine step.

    Args:
        profile: a built-in profile name (BUILTIN_PROFILES) or a folder with mlp.csv, attention.csv
            and all_reduce.csv, and optionally cpu_overheads.csv (each optionally .gz).
        base: the cost model to calibrate; None builds the built-in profile's model, GPU and tp in fp16.
        stride: use every stride-th composed step (1 = all), to trade accuracy for time.

    Returns:
        (the step calibration, the all-reduce fit, the number of composed steps used).

    Raises:
        CostModelError: base is None for a folder that is not a built-in profile, or a table is bad.

    Warns:
        CostModelWarning: base's model shape (hidden size, heads, MLP size) or tp differs from the mlp
            table's, or its GPU from a built-in profile's: the fit is made, but of another machine's times.
    """
    folder, builtin = _profile_dir(profile)
    if base is None:
        if builtin is None:
            raise CostModelError(
                f"profile {str(profile)!r} is a folder: give the cost model (model, gpu, tp)"
            )
        base = CostModel.from_names(builtin[0], builtin[1], tp=builtin[2], dtype="fp16")
    ar_rows = _table(folder, "all_reduce.csv")
    ar = fit_allreduce(ar_rows, base, holdout, seed)
    # Warned once the tables are known to fit at all (a tp the all-reduce table lacks is an error of its own).
    elsewhere = _measured_elsewhere(profile, folder, builtin, base)
    if elsewhere is not None:
        warnings.warn(elsewhere, CostModelWarning, stacklevel=2)
    base = base.replace(link_util=ar.link_util, allreduce_latency_s=ar.latency_s, overhead_s=0.0)
    steps = steps_from_profile(profile, base, MeasuredAllReduce.of(ar_rows, base.tp))[:: max(1, stride)]
    cal = fit_steps(base, steps, PROFILE_FIT, holdout, seed)
    try:
        cpu_rows = _table(folder, "cpu_overheads.csv")
    except CostModelError:
        return cal, ar, len(steps)
    cpu = fit_cpu_overheads(cpu_rows, holdout, seed)
    note = (
        f"CPU per step from cpu_overheads.csv ({' + '.join(CPU_COLUMNS)}): {cpu.step_s * 1e3:.3f} ms + "
        f"{cpu.per_seq_s * 1e6:.1f} us per sequence, added as overhead_s and to per_seq_s; "
        "the errors above are on GPU time (the kernel tables hold no CPU time)"
    )
    return (
        replace(
            cal,
            overhead_s=cal.overhead_s + cpu.step_s,
            per_seq_s=cal.per_seq_s + cpu.per_seq_s,
            cpu=cpu,
            notes=(*cal.notes, note),
        ),
        ar,
        len(steps),
    )
