"""The cost model's commands: `stallfree budget`, `stallfree calibrate` and `stallfree specs`.

Imports allowed: the standard library, stallfree.costmodel and the CLI leaves (stallfree._argtypes, _files,
_default_replica).

Errors print one line on stderr: exit code 2 for bad arguments (unknown names, sizes, impossible
configurations), 1 for unreadable files.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from stallfree._argtypes import list_items, non_negative_float, parse_token_count, positive_fraction, positive_int
from stallfree._default_replica import DEFAULT_REPLICA
from stallfree._files import writable_file_problem
from stallfree.costmodel.budget import budget_rows, kernel_figures
from stallfree.costmodel.calibrate import (
    BUILTIN_PROFILES,
    FIT_PARAMS,
    calibrate_profile,
    describe,
    fit_steps,
    read_steps_csv,
)
from stallfree.costmodel.errors import CostModelError, CostModelMemoryError, CostModelWarning
from stallfree.costmodel.hardware import GPUCalibration, get_gpu, gpu_to_dict, list_gpus, normalize_name
from stallfree.costmodel.kernel_maps import SYSTEMS
from stallfree.costmodel.model import get_model, list_models
from stallfree.costmodel.roofline import CostModel, moe_split_problem

__all__ = ["register"]


def _add_target(p: argparse.ArgumentParser, model: str | None, gpu: str | None, tp: int, dtype: str = "bf16") -> None:
    """The model-and-GPU flags; a default of None (calibrate's --model and --gpu) is shown as none."""

    def default(value: object) -> str:
        return "" if value is None else f" (default {value})"

    p.add_argument(
        "--model",
        default=model,
        help="model name (see `stallfree specs`) or a .json file, a Hugging Face config.json or our format"
        + default(model),
    )
    p.add_argument("--gpu", default=gpu, help="GPU name (see `stallfree specs`) or a .json file" + default(gpu))
    p.add_argument("--tp", type=positive_int, default=tp, help="tensor-parallel degree, GPUs" + default(tp))
    p.add_argument(
        "--pp", type=positive_int, default=1, help="pipeline-parallel degree (stages of --tp GPUs; default 1)"
    )
    p.add_argument("--ep", type=positive_int, default=1, help="expert parallelism of an MoE model (GPUs; default 1)")
    p.add_argument(
        "--dp-attention", type=positive_int, default=1,
        help="data-parallel attention ranks of an MoE model, each of --tp GPUs (default 1)",
    )
    p.add_argument(
        "--dtype",
        default=dtype,
        help=f"weight dtype: bf16, fp16, fp8 (W8A8), int8, int4 (weight-only), mxfp4, nvfp4 (default {dtype})",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="KV cache dtype (default: bf16 under 8-bit weights, else the weight dtype)",
    )
    p.add_argument("--mfu", type=positive_fraction, default=1.0, help="fraction of peak FLOP/s reached (default 1.0)")
    p.add_argument("--mbu", type=positive_fraction, default=1.0, help="fraction of peak memory bandwidth (default 1.0)")
    p.add_argument("--link-util", type=positive_fraction, default=1.0, help="fraction of link bandwidth (default 1.0)")
    p.add_argument("--overhead-ms", type=non_negative_float, default=0.0, help="fixed time per step, ms (default 0)")
    p.add_argument(
        "--allreduce-latency-us",
        type=non_negative_float,
        default=0.0,
        help="fixed time per all-reduce call, microseconds (default 0)",
    )
    p.add_argument(
        "--kernel-launch-us", type=non_negative_float, default=0.0, help="fixed time per kernel launch, us (default 0)"
    )
    p.add_argument(
        "--per-token-us", type=non_negative_float, default=0.0, help="time per token in a step, us (default 0)"
    )
    p.add_argument(
        "--per-seq-us", type=non_negative_float, default=0.0, help="time per sequence in a step, us (default 0)"
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")


def _flag(field: str) -> str:
    """The flag of a cost-model field in these commands' messages: "dp_attention" -> "--dp-attention"."""
    return "--" + field.replace("_", "-")


def _cost_model(a: argparse.Namespace, mode: str = "full") -> CostModel:
    if a.model is None or a.gpu is None or a.tp is None:
        missing = [f"--{n}" for n in ("model", "gpu", "tp") if getattr(a, n) is None]
        raise CostModelError(f"{', '.join(missing)} required")
    model = get_model(a.model)
    # Named by the flags, not the cost model's fields ("--ep 3 does not divide ...", not "ep 3 ...").
    problem = moe_split_problem(model, a.tp, a.pp, a.ep, a.dp_attention, name=_flag)
    if problem is not None:
        raise CostModelError(problem)
    return CostModel.from_names(
        model,
        a.gpu,
        tp=a.tp,
        dtype=a.dtype,
        kv_dtype=a.kv_dtype,
        mode=mode,
        pp=a.pp,
        ep=a.ep,
        dp_attention=a.dp_attention,
        mfu=a.mfu,
        mbu=a.mbu,
        link_util=a.link_util,
        overhead_s=a.overhead_ms * 1e-3,
        allreduce_latency_s=a.allreduce_latency_us * 1e-6,
        kernel_launch_s=a.kernel_launch_us * 1e-6,
        per_token_s=a.per_token_us * 1e-6,
        per_seq_s=a.per_seq_us * 1e-6,
    )


def _run(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command: warnings become 'warning:' lines, errors one 'error:' line and an exit code."""

    def wrapped(a: argparse.Namespace) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CostModelWarning)
            try:
                code = func(a)
            except CostModelError as exc:
                # Any input error is 2, as the simulator's commands answer them: a missing file, malformed
                # contents of a data file (CostModelDataError), any other unusable value.
                code = 2
                # Named by the flags, not the cost model's fields ("--tp 3 does not divide ...", not "tp 3 ...");
                # a command with --pp says where more pipeline stages would make room, as raising tp would.
                with_pp = (exc.named_with_pp(_flag) if isinstance(exc, CostModelMemoryError)
                           and getattr(a, "pp", None) is not None else None)
                print(f"stallfree {a.command}: error: {with_pp or exc.named(_flag)}", file=sys.stderr)
        for message in dict.fromkeys(str(w.message) for w in caught):  # each once: "always" repeats them
            print(f"stallfree {a.command}: warning: {message}", file=sys.stderr)
        return code

    return wrapped


def _parse_budgets(text: str) -> list[int]:
    """--budgets: comma-separated token counts, each with vLLM's suffixes as every other token flag takes them
    (stallfree._argtypes.parse_token_count: "512,2k,8K")."""
    out = []
    for part in text.split(","):
        try:
            out.append(parse_token_count(part.strip()))
        except ValueError:
            raise CostModelError(
                f"--budgets: {part.strip()!r} is not a whole number of tokens (give e.g. 512,2k,8192; suffixes k, "
                "m, g = 10^3, 10^6, 10^9 and K, M, G = 2^10, 2^20, 2^30)"
            ) from None
    for b in out:
        if b < 1:
            raise CostModelError(f"--budgets: {b} is not a positive number of tokens")
    twice = next((b for i, b in enumerate(out) if b in out[:i]), None)
    if twice is not None:
        raise CostModelError(f"--budgets {text}: {twice} is given twice; give each value once")
    return out


def _kernel_column(a: argparse.Namespace, full: CostModel, budgets: list[int]) -> tuple[Any, list[Any]]:
    """The measured-kernel choice of `budget` (its --kernels) and its figures per budget ([] unless
    the kernels price the steps)."""
    from stallfree.costmodel.choice import choose_cost_model

    if a.pp != 1 and a.kernels in (None, "none"):
        return None, []  # the kernel tables price pp 1 only; the default stays with the roofline
    if a.pp != 1:
        raise CostModelError(f"--kernels {a.kernels}: the kernel tables price --pp 1 only, got --pp {a.pp}")
    chosen = choose_cost_model(full.model, full.gpu, full.tp, full.dtype, full.kv_dtype, kernels=a.kernels,
                               ep=full.ep, dp_attention=full.dp_attention)
    if chosen.name != "kernels":
        return chosen, []
    return chosen, kernel_figures(chosen.cost_model, budgets, a.decodes, a.context, a.prompt)


def _check_budget_flags(a: argparse.Namespace, budgets: list[int]) -> None:
    """The values of budget's own flags, checked before the model and GPU, so that a bad one is named first.

    Raises:
        CostModelError: --decodes or --context < 0, --prompt < 1, or a budget <= --decodes (flag and value named).
    """
    for flag, value, low in (("--decodes", a.decodes, 0), ("--context", a.context, 0), ("--prompt", a.prompt, 1)):
        if value < low:
            raise CostModelError(f"{flag} {value}: must be an integer >= {low}")
    for b in budgets:
        if b <= a.decodes:
            raise CostModelError(f"--budgets {b:,}: leaves no room for the prompt after --decodes {a.decodes}; "
                                 "each budget must exceed --decodes")


def _check_budget_limit(full: CostModel, budgets: list[int], decodes: int, capacity: int) -> None:
    """Refuse a budget no step can use: one whose prompt chunk (budget - decodes) is longer than the
    model's context length (no prompt is longer), or one with more tokens than the KV cache holds
    (capacity, tokens; every scheduled token's KV must fit).

    Raises:
        CostModelError: naming --budgets, the value and the limit.
    """
    limits = [(capacity, f"the {capacity:,}-token KV cache of this replica")]
    if full.model.context_length:
        ctx = full.model.context_length
        limits.append((ctx + decodes, f"{full.model.key}'s context of {ctx:,} tokens plus --decodes {decodes}"))
    limit, why = min(limits)
    for b in budgets:
        if b > limit:
            raise CostModelError(f"--budgets {b:,}: more tokens in one step than {why}; at most {limit:,}")


def _check_request_limit(full: CostModel, a: argparse.Namespace, capacity: int) -> None:
    """Refuse a --prompt or --context no server would run: a prompt longer than the model's context
    length (a server refuses it at arrival), a decode context longer than it, or --decodes decodes
    whose contexts (decodes x context tokens of KV) do not fit the KV cache (capacity, tokens).

    Raises:
        CostModelError: naming the flag, the value and the limit.
    """
    ctx = full.model.context_length
    for flag, value in (("--prompt", a.prompt), ("--context", a.context)):
        if ctx and value > ctx:
            raise CostModelError(f"{flag} {value:,}: longer than {full.model.key}'s context of {ctx:,} tokens; "
                                 f"at most {ctx:,}")
    if a.decodes and a.decodes * a.context > capacity:
        raise CostModelError(
            f"--context {a.context:,}: --decodes {a.decodes} x {a.context:,} = {a.decodes * a.context:,} KV tokens, "
            f"more than the {capacity:,}-token KV cache of this replica; at most {capacity // a.decodes:,}")


def _budget(a: argparse.Namespace) -> int:
    budgets = _parse_budgets(a.budgets)
    _check_budget_flags(a, budgets)
    full = _cost_model(a)
    _check_budget_limit(full, budgets, a.decodes, full.kv_capacity_tokens(a.gpu_memory_utilization))
    _check_request_limit(full, a, full.kv_capacity_tokens(a.gpu_memory_utilization))
    rows = budget_rows(full, budgets, a.decodes, a.context, a.prompt)
    capacity = full.kv_capacity_tokens(a.gpu_memory_utilization)
    chosen, kern = _kernel_column(a, full, budgets)
    if a.json:

        def mode(f: Any) -> dict[str, float]:
            return {
                "step_ms": f.step_s * 1e3,
                "decode_step_ms": f.decode_step_s * 1e3,
                "ttft_ms": f.ttft_s * 1e3,
                "compute_ms": f.parts.compute_s * 1e3,
                "memory_ms": f.parts.memory_s * 1e3,
                "comm_ms": f.parts.comm_s * 1e3,
            }

        print(
            json.dumps(
                {
                    "model": full.model.key,
                    "gpu": full.gpu.key,
                    "tp": full.tp, "pp": full.pp, "ep": full.ep, "dp_attention": full.dp_attention,
                    "gpus": full.gpus,
                    "dtype": full.dtype,
                    "kv_dtype": full.kv_dtype,
                    "decodes": a.decodes,
                    "context": a.context,
                    "prompt": a.prompt,
                    "kv_capacity_tokens": capacity,
                    "gpu_memory_utilization": a.gpu_memory_utilization,
                    "efficiency": {
                        "mfu": full.mfu,
                        "mbu": full.mbu,
                        "link_util": full.link_util,
                        "overhead_ms": full.overhead_s * 1e3,
                    },
                    "cost_model": chosen.name if chosen else "full",
                    "cost_model_source": chosen.source if chosen else {"kind": "full", "chosen_by": "--pp"},
                    "rows": [
                        {
                            "budget": r.budget,
                            "steps_to_first_token": r.steps_to_first_token,
                            "design": mode(r.design),
                            "full": mode(r.full),
                        }
                        | ({"kernels": {"step_ms": k.step_s * 1e3, "decode_step_ms": k.decode_step_s * 1e3,
                                        "ttft_ms": k.ttft_s * 1e3}} if k else {})
                        for r, k in zip(rows, kern or [None] * len(rows), strict=True)
                    ],
                    "warnings": list(full.warnings),
                },
                indent=1,
            )
        )
        return 0
    gpus = f"{full.tp} x {full.gpu.key}"
    if full.pp > 1:
        # Name every GPU of the replica and the split: the step figures are one batch passing the stages
        # in turn, so they do not shrink with pp while the KV capacity grows.
        gpus = (f"{full.gpus} x {full.gpu.key} (tp {full.tp} x pp {full.pp}: one batch passes the {full.pp} "
                "stages in turn)")
    print(
        f"{full.model.key} on {gpus}"
        + (f" x {full.dp_attention} attention ranks" if full.dp_attention > 1 else "")
        + (f", experts over ep {full.ep}" if full.ep > 1 else "")
        + f", weights {full.dtype}, KV cache {full.kv_dtype}; "
        f"{a.decodes} decodes at {a.context} tokens of context; prompt {a.prompt} tokens"
    )
    print(
        f"KV capacity {capacity:,} tokens at gpu_memory_utilization {a.gpu_memory_utilization}; "
        f"full mode at mfu {full.mfu}, mbu {full.mbu}, link_util {full.link_util}, "
        f"overhead {full.overhead_s * 1e3:g} ms"
    )
    print()
    head = (
        f"{'budget':>7} {'steps':>6} | {'step ms':>8} {'decode ms':>9} {'TTFT ms':>9} | "
        f"{'step ms':>8} {'decode ms':>9} {'TTFT ms':>9} | {'compute':>8} {'memory':>8} {'comm':>8}"
    )
    print(f"{'':>14} | {'design (docs/DESIGN.md §2)':^28} | {'full model':^28} | {'full step parts, ms':^26}")
    print(head)
    for r in rows:
        d, f = r.design, r.full
        print(
            f"{r.budget:>7} {r.steps_to_first_token:>6} | "
            f"{d.step_s * 1e3:>8.1f} {d.decode_step_s * 1e3:>9.1f} {d.ttft_s * 1e3:>9.1f} | "
            f"{f.step_s * 1e3:>8.1f} {f.decode_step_s * 1e3:>9.1f} {f.ttft_s * 1e3:>9.1f} | "
            f"{f.parts.compute_s * 1e3:>8.1f} {f.parts.memory_s * 1e3:>8.1f} {f.parts.comm_s * 1e3:>8.1f}"
        )
    if kern:
        print()
        print(f"kernels: {chosen.line}")
        print(f"{'budget':>7} | {'step ms':>8} {'decode ms':>9} {'TTFT ms':>9}")
        for k in kern:
            print(f"{k.budget:>7} | {k.step_s * 1e3:>8.1f} {k.decode_step_s * 1e3:>9.1f} {k.ttft_s * 1e3:>9.1f}")
    elif chosen is not None and chosen.source.get("fallback_reason"):
        print()
        print(f"kernels: not priced ({chosen.source['fallback_reason']})")
    elif a.pp != 1 and a.kernels is None:
        # The default adds kernel figures at pp 1; say why they are missing rather than drop them unseen.
        print()
        print("kernels: not priced (the kernel tables price --pp 1 only)")
    print()
    print(
        "steps = steps to the prompt's first token; step = the decodes plus a (budget - decodes)-token "
        "chunk; design and full defaults are floors (efficiency 1.0)"
    )
    if full.model.num_experts:
        print(
            f"design counts all {full.model.total_params / 1e9:,.1f}B parameters per token (docs/DESIGN.md's "
            f"arithmetic); an MoE token runs {full.model.active_params / 1e9:,.1f}B, which the full model "
            "prices"
        )
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    if (a.csv is None) == (a.profile is None):
        raise CostModelError("give exactly one of --csv FILE or --profile NAME|FOLDER")
    if not 0 < a.holdout < 1:
        raise CostModelError(f"--holdout {a.holdout:g}: the fraction of rows held out must be above 0 and below 1")
    # Before the fit, as every output flag: the file is JSON, and `--gpu FILE` reads only a name ending in .json.
    problem = None if a.save_gpu is None else writable_file_problem(Path(a.save_gpu), "--save-gpu", (".json",))
    if problem is not None:
        raise CostModelError(problem)
    if a.csv is not None:
        try:
            fit = tuple(list_items("mfu,mbu,overhead_s" if a.fit is None else a.fit))
        except argparse.ArgumentTypeError as exc:
            raise CostModelError(f"--fit: {exc}") from None
        if not fit:
            raise CostModelError(f"--fit {a.fit!r}: name the parameters to fit, from {','.join(FIT_PARAMS)}")
        base: CostModel | None = _cost_model(a)
        assert base is not None
        steps = read_steps_csv(a.csv)
        cal = fit_steps(base, steps, fit, a.holdout, a.seed)
        ar, n = None, len(steps)
    else:
        if a.fit is not None:
            raise CostModelError("--fit applies to --csv; --profile fits its own set")
        base = _cost_model(a) if a.model is not None else None
        cal, ar, n = calibrate_profile(a.profile, base, a.holdout, a.seed)
        if base is None:
            model, gpu, tp = BUILTIN_PROFILES[normalize_name(a.profile)]
            base = CostModel.from_names(model, gpu, tp=tp, dtype="fp16")
    if a.save_gpu is not None:
        _save_gpu(a, base, cal, n)

    out: dict[str, Any] = {"steps": n, **describe(cal)}
    if ar is not None:
        out["allreduce"] = {
            "latency_us": ar.latency_s * 1e6,
            "bandwidth_GBps": ar.bw_bytes_per_s / 1e9,
            "link_util": ar.link_util,
            "test_error": ar.test.as_dict(),
        }
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"fitted on {cal.train.rows} of {n} steps, tested on {cal.test.rows} held-out "
          f"step{'' if cal.test.rows == 1 else 's'}")
    print(
        f"mfu {cal.mfu:.3f}  mbu {cal.mbu:.3f}  link_util {cal.link_util:.3f}  "
        f"overhead {cal.overhead_s * 1e3:.3f} ms"
        f"  all-reduce latency {cal.allreduce_latency_s * 1e6:.1f} us"
    )
    print(
        f"kernel launch {cal.kernel_launch_s * 1e6:.2f} us  per token {cal.per_token_s * 1e6:.2f} us  "
        f"per sequence {cal.per_seq_s * 1e6:.2f} us"
    )
    for label, s in (
        ("train", cal.train),
        ("held-out", cal.test),
        ("held-out, uncalibrated", cal.floor_test),
    ):
        print(
            f"{label:>23}: |error| mean {s.mean:.1%}  median {s.median:.1%}  p90 {s.p90:.1%}  max {s.max:.1%}"
        )
    for title, groups in (("tokens", cal.test_by_bucket), ("kind", cal.test_by_kind)):
        for label, s in groups:
            # A bucket no held-out step fell in has no error to show; 0.0% would read as a perfect fit.
            figures = (f"median {s.median:.1%}  p90 {s.p90:.1%}  max {s.max:.1%}" if s.rows
                       else "median -  p90 -  max -")
            count = f"{s.rows} step{'' if s.rows == 1 else 's'}"
            print(f"{'held-out ' + title + ' ' + label:>23}: |error| {figures}  ({count})")
    if ar is not None:
        print(
            f"all-reduce: latency {ar.latency_s * 1e6:.1f} us, bandwidth {ar.bw_bytes_per_s / 1e9:.0f} GB/s "
            f"(link_util {ar.link_util:.2f}); held-out |error| mean {ar.test.mean:.1%}, p90 {ar.test.p90:.1%}"
        )
    for note in cal.notes:
        print(f"note: {note}")
    return 0


def _save_gpu(a: argparse.Namespace, base: CostModel, cal: Any, n: int) -> None:
    """Write base's GPU with the calibration, so `--gpu FILE` in simulate, sweep and tune reuses it."""
    data = f"--csv {a.csv}" if a.csv is not None else f"--profile {a.profile}"
    block = GPUCalibration(
        kwargs=tuple(cal.kwargs().items()),
        source=(
            f"`stallfree calibrate {data}` on {base.model.key} at tp {base.tp}, {n} steps, "
            f"held-out median error {cal.test.median:.1%}"
        ),
        model=base.model.key,
        tp=base.tp,
        linear_flops_per_token_per_gpu=2.0 * base.model.active_layer_params / base.tp,
    )
    entry = gpu_to_dict(replace(base.gpu, calibration=block))
    path = Path(a.save_gpu)
    try:
        path.write_text(json.dumps(entry, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CostModelError(f"cannot write --save-gpu file {str(path)!r}: {exc}") from None
    print(f"wrote {path}: use --gpu {path} to price steps with this calibration", file=sys.stderr)


def _specs(a: argparse.Namespace) -> int:
    models: dict[str, dict[str, Any]] = {
        k: {
            "layers": m.num_layers,
            "hidden": m.hidden_size,
            "heads": m.num_heads,
            "kv_heads": m.num_kv_heads,
            "total_params": m.total_params,
            "active_params": m.active_params,
            "attention": "mla" if m.is_mla else (
                ("gqa" if m.num_kv_heads < m.num_heads else "mha") + ("+window" if m.num_window_layers else "")
            ),
            "kv_bytes_per_token_bf16": int(m.kv_bytes_per_token(2)),
            "aliases": list(m.aliases),
        }
        for k in list_models()
        for m in [get_model(k)]
    }
    gpus: dict[str, dict[str, Any]] = {
        k: {
            "bf16_tflops": g.bf16_flops_per_s / 1e12,
            "fp8_tflops": None if g.fp8_flops_per_s is None else g.fp8_flops_per_s / 1e12,
            "fp4_tflops": None if g.fp4_flops_per_s is None else g.fp4_flops_per_s / 1e12,
            "mem_bw_GBps": g.mem_bw_bytes_per_s / 1e9,
            "mem_GB": g.mem_bytes / 1e9,
            "link_GBps": g.link_bw_bytes_per_s / 1e9,
            "aliases": list(g.aliases),
            "kernel_system": SYSTEMS.get(k),
        }
        for k in list_gpus()
        for g in [get_gpu(k)]
    }
    if a.json:
        print(json.dumps({"models": models, "gpus": gpus}, indent=1))
        return 0
    print(
        f"{'model':<18} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'total B':>8} {'active B':>8} "
        f"{'attention':>10} {'KV B/tok':>8}  aliases"
    )
    for k, m in models.items():
        print(
            f"{k:<18} {m['layers']:>6} {m['hidden']:>6} {m['heads']:>5} {m['kv_heads']:>3} "
            f"{m['total_params'] / 1e9:>8.2f} {m['active_params'] / 1e9:>8.2f} {m['attention']:>10} "
            f"{m['kv_bytes_per_token_bf16']:>8}  {', '.join(m['aliases'])}".rstrip()
        )
    print()
    print(f"{'gpu':<14} {'bf16 TF/s':>9} {'fp8 TF/s':>9} {'fp4 TF/s':>9} {'HBM GB/s':>9} {'GB':>5} {'link GB/s':>9} "
          f"{'kernels':>19}  aliases")
    for k, g in gpus.items():
        fp8 = "-" if g["fp8_tflops"] is None else f"{g['fp8_tflops']:.1f}"
        fp4 = "-" if g["fp4_tflops"] is None else f"{g['fp4_tflops']:.1f}"
        print(
            f"{k:<14} {g['bf16_tflops']:>9.1f} {fp8:>9} {fp4:>9} {g['mem_bw_GBps']:>9.0f} {g['mem_GB']:>5.0f} "
            f"{g['link_GBps']:>9.0f} {g['kernel_system'] or '-':>19}  {', '.join(g['aliases'])}".rstrip()
        )
    print("\nkernels: the system name of the GPU's measured kernel tables in aiconfigurator-core ('-': none);"
          "\naliases: other names --model and --gpu accept ('-' and '_' are alike, case is ignored)")
    print("sources: src/stallfree/costmodel/data/SOURCES.md")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `budget`, `calibrate` and `specs` subcommands."""
    p = sub.add_parser("budget", help="price token budgets in milliseconds (design vs full cost model)",
                       description="Price token budgets in milliseconds (design vs full cost model). With no "
                       "--model or --gpu: the simulator's default replica, "
                       f"{DEFAULT_REPLICA['model']} on {DEFAULT_REPLICA['tp']} x {DEFAULT_REPLICA['gpu']}, "
                       f"{DEFAULT_REPLICA['dtype']}.")
    _add_target(p, DEFAULT_REPLICA["model"], DEFAULT_REPLICA["gpu"], DEFAULT_REPLICA["tp"], DEFAULT_REPLICA["dtype"])
    p.add_argument(
        "--budgets", default="512,2048,8192", help="comma-separated token budgets (default 512,2048,8192)"
    )
    p.add_argument("--decodes", type=int, default=64, help="decodes running in each step (default 64)")
    p.add_argument(
        "--context", type=int, default=4096, help="tokens in each decode's KV cache (default 4096)"
    )
    p.add_argument("--prompt", type=int, default=32768, help="the arriving prompt, tokens (default 32768)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=positive_fraction,
        default=0.9,
        help="fraction of GPU memory for weights and KV (default 0.9)",
    )
    p.add_argument(
        "--kernels",
        metavar="ENGINE[:VERSION]",
        help="add figures priced from measured GPU kernel tables: vllm, sglang or trtllm (VERSION a slot or "
        "a version the package serves), or none (default: vllm's current tables where the optional package "
        "aiconfigurator-core is installed and has the GPU)",
    )
    p.set_defaults(func=_run(_budget))

    c = sub.add_parser(
        "calibrate", help="fit efficiency factors and overhead to measured steps or kernel tables"
    )
    _add_target(c, None, None, 1)
    c.add_argument("--csv", default=None, help="a CSV of measured steps (see docs/costmodel.md)")
    c.add_argument(
        "--profile", default=None, help=f"kernel tables: a folder, or built in: {', '.join(BUILTIN_PROFILES)}"
    )
    c.add_argument(
        "--fit",
        default=None,
        help=f"parameters to fit, from {','.join(FIT_PARAMS)} (default: mfu,mbu,overhead_s for --csv; "
        "mfu,mbu,kernel_launch_s,per_token_s,per_seq_s plus the CPU line for --profile)",
    )
    c.add_argument("--holdout", type=float, default=0.2, help="fraction of rows held out (default 0.2)")
    c.add_argument("--seed", type=int, default=0, help="seed of the held-out split (default 0)")
    c.add_argument(
        "--save-gpu",
        default=None,
        metavar="FILE",
        help="write the GPU with this calibration to FILE (.json); `--gpu FILE` then uses it by default",
    )
    c.set_defaults(func=_run(_calibrate))

    s = sub.add_parser("specs", help="list the known models and GPUs")
    s.add_argument("--json", action="store_true", help="print JSON for machines")
    s.set_defaults(func=_run(_specs))
