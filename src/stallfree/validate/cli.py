"""The `stallfree validate` command: engine (or a vLLM result) against the simulator.

Imports allowed: the standard library and stallfree (the heavy parts are imported when the command runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stallfree._argtypes import int_at_least, positive_float_at_most, positive_int
from stallfree.flags import add_renamed, add_scheduler_flags
from stallfree.sim.defaults import DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET

__all__ = ["register"]

# ValidateConfig's bounds, checked again while parsing so that a bad value is named by its flag: at least
# two halves of two requests, and a load or length scale of at most 100 (a guard against a typo).
_MIN_REQUESTS = 4
_MAX_FACTOR = 100.0


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.1f}{unit}"


def _print(res: dict[str, Any], title: str) -> None:
    eng, sim, err = res["engine"], res["simulator"], res["error"]
    print(title)
    for note in res.get("notes", []):
        print(f"note: {note}")
    print(f"{'metric':<10} {'measured ms':>11} {'simulator ms':>13} {'error':>9}")
    for m in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50", "p90", "p99"):
            print(f"{m.upper() + ' ' + q:<10} {_fmt(eng[f'{q}_{m}_ms']):>11} {_fmt(sim[f'{q}_{m}_ms']):>13} "
                  f"{_fmt(err[f'{m}_{q}_err_pct'], '%'):>9}")
    print("per-request absolute percentage error (median / p90):")
    for m in ("ttft", "tpot", "itl", "e2e"):
        print(f"  {m.upper():<5} {_fmt(err[f'{m}_median_ape_pct'], '%')} / {_fmt(err[f'{m}_p90_ape_pct'], '%')}")
    if "verdict" in res:
        print(res["verdict"])


def add_verdict(res: dict[str, Any], kind: str) -> None:
    """Set res["verdict"]: the errors of the means against the goals (validate.against.GOALS) and whether
    they exceed the run's noise (stallfree.sim.outputs.verdict). kind: "engine" (noise: the engine's own speed
    drift between the halves), "runs" (--against run folders: a 95% bootstrap interval over requests per
    run, kept as each run's "error_interval_pct"), else a mode without per-request pairs (said so)."""
    from stallfree.sim.outputs.verdict import mean_error_interval, validate_verdict
    from stallfree.validate.against import GOALS

    if kind == "engine":
        eng, sim = res["engine"], res["simulator"]
        errs = {f"mean_{m}": (sim[f"mean_{m}_ms"] - eng[f"mean_{m}_ms"]) / eng[f"mean_{m}_ms"] * 100.0
                for m in GOALS if eng.get(f"mean_{m}_ms") and sim.get(f"mean_{m}_ms") is not None}
        drift = res.get("config", {}).get("engine_speed_drift_pct")
        note = None if drift is None else (f"the engine's steps of equal shape (decode count and chunk sizes) "
                                           f"moved {drift:+.0f}% between the run's halves; an error smaller than "
                                           "that is machine drift, a larger one is the model's")
        res["verdict"] = validate_verdict(errs, GOALS, noise_note=note)
        return
    if kind != "runs":
        res["verdict"] += " (noise: not judged: this mode keeps no per-request pairs)"
        return
    beyond = 0
    for r in res["runs"]:
        pairs = r.get("per_request") or []
        r["error_interval_pct"] = {}
        for j, m in enumerate(("ttft", "e2e")):
            try:
                _, lo, hi = mean_error_interval([p[j] for p in pairs], [p[2 + j] for p in pairs])
            except ValueError:
                continue
            r["error_interval_pct"][m] = [lo, hi]
        beyond += any(lo > 0 or hi < 0 for lo, hi in r["error_interval_pct"].values())
    if len(res["runs"]) == 1:
        run = res["runs"][0]
        res["verdict"] = validate_verdict(run["error_pct"], GOALS, {m: (v[0], v[1]) for m, v in
                                                                    run["error_interval_pct"].items()})
    else:
        res["verdict"] += (f"; noise: in {beyond} of {len(res['runs'])} runs the mean TTFT or E2E error is beyond its "
                           "95% bootstrap interval over requests")


def _kernels_value(text: str) -> str:
    """argparse type of --kernels: checked when the command line is read, so that a wrong engine name is a
    usage error of its own rather than every row's reason for not replaying.

    Raises:
        argparse.ArgumentTypeError: an unknown engine or an empty version (stallfree.costmodel.kernel_maps
            .parse_kernels); a version the package does not serve is found per GPU, later.
    """
    from stallfree.costmodel.errors import CostModelError
    from stallfree.costmodel.kernel_maps import parse_kernels

    try:
        parse_kernels(text)
    except CostModelError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kernels ")) from None
    return text


def _against(a: argparse.Namespace) -> int:
    """`--against PATH`: the format found by content (validate.against.detect)."""
    from stallfree.sim.inputs.engine_profile import default_profile, load_profile
    from stallfree.validate import against

    fmt = against.detect(a.against)
    profile = (load_profile(a.engine_profile) if a.engine_profile
               else None if a.kernels is None else default_profile(a.kernels))
    if fmt in ("aiconfigurator", "silicon"):
        from stallfree.validate import silicon

        res = silicon.validate_silicon(a.against, profile, a.kernels, model=a.model, gpu=a.gpu, engine=a.engine,
                                       mode=a.mode, requests_per_row=a.requests_per_row, limit=a.limit_rows)
        printer, plotter = silicon.print_silicon, silicon.plot_silicon
    elif fmt == "vllm-result":
        a.vllm_result = Path(a.against)
        return _run(a)
    else:
        res = against.validate_runs(a.against, profile, a.kernels, model=a.model, gpu=a.gpu, ranges=a.range)
        printer, plotter = against.print_runs, against.plot_runs
    add_verdict(res, "runs" if printer is against.print_runs else "silicon")
    if a.json:
        print(against.dump(res))
    else:
        printer(res)
    if a.out is not None:
        plotter(a.out / "against.png", res)
        (a.out / "against.json").write_text(against.dump(res) + "\n", encoding="utf-8")
        if not a.json:
            print(f"wrote {a.out}/against.png, against.json")
    return 0


def _run(a: argparse.Namespace) -> int:
    try:
        if a.against is not None and a.vllm_result is None:
            return _against(a)
        if a.vllm_result is not None:
            a.model = a.model or "llama-3.1-8b"
            a.gpu = a.gpu or "h100-sxm"
            from stallfree.sim.inputs.engine_profile import default_profile, load_profile
            from stallfree.validate.vllm import validate_vllm

            res = validate_vllm(a.vllm_result, a.model, a.gpu, a.tp, a.dtype, a.token_budget,
                                a.max_seqs, a.gpu_memory_utilization, paged=a.kv_policy == "paged",
                                seed=a.seed, kernels=a.kernels,
                                profile=load_profile(a.engine_profile) if a.engine_profile
                                else None if a.kernels is None else default_profile(a.kernels))
            title = (f"vLLM result {a.vllm_result} against the simulator: {res['config']['requests']} requests, "
                     f"{a.model} on {a.tp} x {a.gpu}")
        else:
            try:
                import torch  # noqa: F401
            except ModuleNotFoundError:
                print("stallfree validate: error: the engine needs the 'engine' extra: "
                      "pip install 'stallfree[engine]' (or give --vllm-result FILE)", file=sys.stderr)
                return 1
            from stallfree.validate.run import ValidateConfig, run_validate

            cfg = ValidateConfig(num_requests=a.num_requests, load=a.load, token_budget=a.engine_token_budget,
                                 max_seqs=a.engine_max_seqs, kv_tokens=a.kv_tokens, threads=a.threads, seed=a.seed,
                                 engine_model=a.engine_model, device=a.device, dtype=a.engine_dtype,
                                 prompt_scale=a.prompt_scale, output_scale=a.output_scale,
                                 max_prompt=a.max_prompt, max_output=a.max_output)
            res = run_validate(cfg, a.out, a.save_gpu)
            c = res["config"]
            title = (f"engine ({c['model']}, {c['device']} {c['dtype']}, {c['threads']} thread(s)) "
                     "against the simulator: "
                     f"{c['requests']} requests, budget {c['token_budget']}, max_seqs {c['max_seqs']}; "
                     f"compared on the second half ({res['error']['requests']:.0f} requests); "
                     f"{c['total_wall_s']:.0f} s")
    except ValueError as exc:
        # Any input error, 2 (the commands' rule): a bad option, a missing path, or malformed contents of a
        # file it read (ValidateDataError).
        print(f"stallfree validate: error: {exc}", file=sys.stderr)
        return 2
    add_verdict(res, "vllm" if a.vllm_result is not None else "engine")
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        _print(res, title)
        if a.out is not None and a.vllm_result is None:
            print(f"wrote {a.out}/requests.csv, engine_steps.csv, local_gpu.json, validate.png")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate` subcommand."""
    p = sub.add_parser("validate", help="measure the simulator against the real engine (or a vLLM result)")
    p.add_argument("--json", action="store_true", help='print {"engine", "simulator", "error", ...} as JSON')
    p.add_argument("--out", type=Path, default=None,
                   help="write the results here: the engine run's CSVs, the local GPU file and a plot; "
                        "with --against, against.json and against.png")
    p.add_argument("--seed", type=int, default=0, help="prompt ids and arrival draws (default 0)")
    e = p.add_argument_group("engine run (default)")
    e.add_argument("--engine-model", default=None, help="engine checkpoint (default: bundled SmolLM2-135M)")
    factor = positive_float_at_most(_MAX_FACTOR)
    e.add_argument("--num-requests", type=int_at_least(_MIN_REQUESTS), default=24,
                   help="requests from the bundled trace (default 24)")
    e.add_argument("--load", type=factor, default=0.7, help="offered work over the engine's speed (default 0.7)")
    add_renamed(e, "--engine-max-num-batched-tokens", "--token-budget", dest="engine_token_budget", type=positive_int,
                default=128, metavar="N", help="the engine run's token budget (default 128: a step of the bundled "
                "135M model on one CPU thread stays near 0.1 s)")
    add_renamed(e, "--engine-max-num-seqs", "--max-seqs", dest="engine_max_seqs", type=positive_int, default=16,
                metavar="N", help="the engine run's most running requests (default 16)")
    e.add_argument("--kv-tokens", type=positive_int, default=16384, help="KV capacity, tokens (default 16384)")
    e.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    e.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    e.add_argument("--engine-dtype", default="float32", help="engine weights: float32 (default), bf16, fp16")
    e.add_argument("--prompt-scale", type=factor, default=1 / 16, help="trace prompt lengths x this (1/16)")
    e.add_argument("--output-scale", type=factor, default=1 / 8, help="trace output lengths x this (1/8)")
    e.add_argument("--max-prompt", type=positive_int, default=192, help="prompt length cap, tokens (192)")
    e.add_argument("--max-output", type=positive_int, default=40, help="output length cap, tokens (40)")
    e.add_argument("--save-gpu", type=Path, default=None, help="write this machine's calibrated spec here")
    v = p.add_argument_group("a vLLM result instead of the engine")
    v.add_argument("--vllm-result", type=Path, default=None,
                   help="a `vllm bench serve --save-result --save-detailed` JSON file")
    v.add_argument("--model", default=None,
                   help="cost-model name or .json (--vllm-result: default llama-3.1-8b; --against: overrides the "
                        "run's model; for a benchmark CSV, selects rows whose model contains it)")
    v.add_argument("--gpu", default=None,
                   help="GPU name or .json (--vllm-result: default h100-sxm; --against: overrides the run's GPU; "
                        "for a benchmark CSV, selects rows of that system)")
    v.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    v.add_argument("--dtype", default="bf16", help="weight dtype (default bf16)")
    # The replay's knobs carry the vocabulary's names; their older short names belong to the engine run here.
    add_scheduler_flags(v, {"token_budget": DEFAULT_TOKEN_BUDGET, "max_seqs": DEFAULT_MAX_SEQS,
                            "gpu_memory_utilization": 0.9}, with_aliases=False, shared=False)
    add_scheduler_flags(v, {"kv_policy": "paged"}, why={"kv_policy": "default paged, as vLLM"}, shared=False)
    g = p.add_argument_group("measured runs of someone else's engine (--against)")
    g.add_argument("--against", default=None, metavar="PATH",
                   help="a run folder (meta.json + requests.jsonl) or a folder of them, a vllm bench serve result, "
                        "a silicon_sample.csv-style CSV, or 'aiconfigurator' for the installed package's copy")
    g.add_argument("--engine-profile", default=None, metavar="NAME",
                   help="the engine's own time around the kernels (sim/data/engine_profiles.json): none, "
                        "vllm, ... (default: the profile fitted on the engine whose kernel tables priced the "
                        "steps; none under today's pricing)")
    g.add_argument("--kernels", default=None, metavar="ENGINE[:VERSION]", type=_kernels_value,
                   help="what prices the steps: none (today's pricing) or vllm, sglang, trtllm with an "
                        "optional :VERSION (the measured kernel tables, aiconfigurator-core); default: as "
                        "simulate, vllm's current tables where the package has the GPU, else none")
    g.add_argument("--engine", default=None, help="benchmark CSV: rows of this backend (vllm, sglang, trtllm)")
    g.add_argument("--mode", default=None, help="benchmark CSV: rows of this mode (agg, disagg, all; default all)")
    g.add_argument("--requests-per-row", type=int, default=None, metavar="K",
                   help="benchmark CSV: replay K x concurrency requests per row (default: silicon.REQUESTS_PER_ROW)")
    g.add_argument("--limit-rows", type=int, default=None, metavar="N", help="benchmark CSV: the first N rows")
    g.add_argument("--range", action=argparse.BooleanOptionalAction, default=True,
                   help="run folders: replay each run twice more, every step at the 10th and 90th percentile of the "
                   "measured step-time error (stallfree.sim.studies.ranges), and report whether each measured figure "
                   "lies "
                   "in the range, their coverage and median width (default on; --no-range: one replay a run)")
    p.set_defaults(func=_run)
