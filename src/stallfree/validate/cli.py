"""The `stallfree validate` command: engine (or a vLLM result) against the simulator.

Imports allowed: the standard library and stallfree (the heavy parts are imported when the command runs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from stallfree._argtypes import int_at_least, out_dir, positive_float_at_most, positive_int
from stallfree._files import writable_file_problem
from stallfree.flags import add_renamed, add_scheduler_flags
from stallfree.sim.defaults import DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET

__all__ = ["register"]

# ValidateConfig's bounds, checked again while parsing so that a bad value is named by its flag: at least
# two halves of two requests, and a load or length scale of at most 100 (a guard against a typo).
_MIN_REQUESTS = 4
_MAX_FACTOR = 100.0

#: The exit status when the verdict is outside the goals (tune's and plan's 3 for SLOs missed); the figures and
#: the verdict are printed first.
EXIT_OUTSIDE_GOALS = 3


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


def exit_status(res: dict[str, Any], kind: str) -> int:
    """EXIT_OUTSIDE_GOALS when res["verdict"] says the simulator is outside the goals, else 0. The engine run's
    verdict does not count when the machine drifted (validate.run.machine_drifted: a note says the errors
    include that drift), since the miss may then be the machine's; kind: "engine", "vllm", "runs" or "csv"."""
    if not re.match(r"verdict: (the simulator is )?outside the goals", res.get("verdict", "")):
        return 0
    if kind == _ENGINE:
        from stallfree.validate.run import machine_drifted

        if machine_drifted(res.get("config", {}).get("engine_speed_drift_pct")):
            return 0
    return EXIT_OUTSIDE_GOALS


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


#: Which inputs read each flag that not all of them read, by dest, in --help's order: the engine run (the
#: default), a vLLM result (--vllm-result, or --against with one), run folders and a benchmark CSV
#: (--against). --json is read by all four.
_ENGINE, _VLLM, _RUNS, _CSV = "engine", "vllm", "runs", "csv"
_READERS: dict[str, frozenset[str]] = {
    "out": frozenset({_ENGINE, _RUNS, _CSV}),
    "seed": frozenset({_ENGINE, _VLLM}),
    **dict.fromkeys(("engine_model", "num_requests", "load", "engine_token_budget", "engine_max_seqs", "kv_tokens",
                     "threads", "device", "engine_dtype", "prompt_scale", "output_scale", "max_prompt",
                     "max_output", "save_gpu"), frozenset({_ENGINE})),
    **dict.fromkeys(("model", "gpu"), frozenset({_VLLM, _RUNS, _CSV})),
    **dict.fromkeys(("tp", "dtype", "token_budget", "max_seqs", "gpu_memory_utilization", "kv_policy"),
                    frozenset({_VLLM})),
    **dict.fromkeys(("engine_profile", "kernels"), frozenset({_VLLM, _RUNS, _CSV})),
    **dict.fromkeys(("engine", "mode", "requests_per_row", "limit_rows"), frozenset({_CSV})),
    "range": frozenset({_RUNS}),
}
_WHERE = {
    frozenset({_ENGINE}): "the engine run (no --against or --vllm-result)",
    frozenset({_VLLM}): "--vllm-result (or --against with a vllm bench serve result)",
    frozenset({_RUNS}): "--against and run folders",
    frozenset({_CSV}): "--against and a benchmark CSV (a silicon_sample.csv-style file or aiconfigurator)",
    frozenset({_VLLM, _RUNS, _CSV}): "--against or --vllm-result",
    frozenset({_ENGINE, _VLLM}): "the engine run or --vllm-result",
    frozenset({_ENGINE, _RUNS, _CSV}): "the engine run, or --against with run folders or a benchmark CSV",
}
_INPUT = {_ENGINE: "the engine run (the default: no --against or --vllm-result)", _VLLM: "a vLLM result",
          _RUNS: "run folders", _CSV: "a benchmark CSV"}
#: The options added through stallfree.flags, whose defaults are not None: one was given when the parser
#: recorded the name it was typed under.
_KNOB_DESTS = frozenset({"engine_token_budget", "engine_max_seqs", "token_budget", "max_seqs",
                         "gpu_memory_utilization", "kv_policy"})
#: The engine run's options whose parser default is None so that one typed can be told from one left out
#: (the engine run takes ValidateConfig's defaults for those left out; --help says them).
_ENGINE_CONFIG = ("num_requests", "load", "kv_tokens", "threads", "seed", "engine_model", "device", "prompt_scale",
                  "output_scale", "max_prompt", "max_output")


def _input(a: argparse.Namespace) -> str:
    """What this command line replays, checked before anything runs: "engine", "vllm", "runs" or "csv" (module
    constants). --against PATH is read for its format (validate.against.detect); a vLLM result found there is
    set as a.vllm_result.

    Raises:
        ValueError: --against and --vllm-result together, an --against PATH of no known format, or a flag
            given explicitly that the input does not read (named with its value; exit 2).
    """
    if a.against is not None and a.vllm_result is not None:
        raise ValueError(f"--against {a.against!r} and --vllm-result {str(a.vllm_result)!r} each name the "
                         "measured input: give one")
    kind = _ENGINE if a.against is None and a.vllm_result is None else _VLLM
    if a.against is not None:
        from stallfree.validate.against import detect

        fmt = detect(a.against)
        kind = {"aiconfigurator": _CSV, "silicon": _CSV, "vllm-result": _VLLM}.get(fmt, _RUNS)
        if kind == _VLLM:
            a.vllm_result = Path(a.against)
    typed = getattr(a, "_knob_names", {})  # the names stallfree.flags' options were typed under
    for dest, readers in _READERS.items():
        if kind in readers:
            continue
        value = getattr(a, dest)
        if dest in _KNOB_DESTS:
            if dest not in typed:
                continue  # left at its default
            flag, given = typed[dest], f"{typed[dest]} {value}"
        elif value is None:
            continue
        elif dest == "range":
            flag = given = "--range" if value else "--no-range"
        else:
            flag = f"--{dest.replace('_', '-')}"
            given = f"{flag} {value}"
        raise ValueError(f"{given} only applies with {_WHERE[readers]}, not with {_INPUT[kind]}: drop {flag}")
    return kind


def _against(a: argparse.Namespace, kind: str) -> int:
    """`--against PATH` with run folders or a benchmark CSV (kind, from _input)."""
    from stallfree.sim.inputs.engine_profile import default_profile, load_profile
    from stallfree.validate import against

    profile = (load_profile(a.engine_profile) if a.engine_profile
               else None if a.kernels is None else default_profile(a.kernels))
    if kind == _CSV:
        from stallfree.validate import silicon

        res = silicon.validate_silicon(a.against, profile, a.kernels, model=a.model, gpu=a.gpu, engine=a.engine,
                                       mode=a.mode, requests_per_row=a.requests_per_row, limit=a.limit_rows)
        printer, plotter = silicon.print_silicon, silicon.plot_silicon
    else:
        res = against.validate_runs(a.against, profile, a.kernels, model=a.model, gpu=a.gpu,
                                    ranges=a.range is not False)
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
    return exit_status(res, kind)


def _run(a: argparse.Namespace) -> int:
    try:
        kind = _input(a)
        if kind in (_RUNS, _CSV):
            return _against(a, kind)
        if kind == _VLLM:
            a.model = a.model or "llama-3.1-8b"
            a.gpu = a.gpu or "h100-sxm"
            a.tp = 1 if a.tp is None else a.tp
            from stallfree.sim.inputs.engine_profile import default_profile, load_profile
            from stallfree.validate.vllm import validate_vllm

            res = validate_vllm(a.vllm_result, a.model, a.gpu, a.tp, a.dtype or "bf16", a.token_budget,
                                a.max_seqs, a.gpu_memory_utilization, paged=a.kv_policy == "paged",
                                seed=a.seed or 0, kernels=a.kernels,
                                profile=load_profile(a.engine_profile) if a.engine_profile
                                else None if a.kernels is None else default_profile(a.kernels))
            title = (f"vLLM result {a.vllm_result} against the simulator: {res['config']['requests']} requests, "
                     f"{a.model} on {a.tp} x {a.gpu}")
        else:
            # Checked before the run, as calibrate checks its --save-gpu; the writer creates missing folders.
            problem = None if a.save_gpu is None else writable_file_problem(a.save_gpu, "--save-gpu", (".json",),
                                                                            creates_dirs=True)
            if problem:
                raise ValueError(problem)
            try:
                import torch  # noqa: F401
            except ModuleNotFoundError:
                print("stallfree validate: error: the engine needs the 'engine' extra: "
                      "pip install 'stallfree[engine]' (or give --vllm-result FILE)", file=sys.stderr)
                return 1
            from stallfree.validate.run import ValidateConfig, run_validate

            given = {name: value for name in _ENGINE_CONFIG if (value := getattr(a, name)) is not None}
            if a.engine_dtype is not None:
                given["dtype"] = a.engine_dtype
            cfg = ValidateConfig(token_budget=a.engine_token_budget, max_seqs=a.engine_max_seqs, **given)
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
    return exit_status(res, kind)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate` subcommand."""
    p = sub.add_parser("validate", help="measure the simulator against the real engine (or a vLLM result)",
                       description="Measure the simulator against the real engine on this machine, a vLLM result "
                       "or measured runs (--against), and print a verdict against the goals of docs/fidelity.md. "
                       f"Exits {EXIT_OUTSIDE_GOALS} when the verdict is outside the goals (not for an engine run "
                       "whose machine drifted: its note says so).")
    p.add_argument("--json", action="store_true", help='print {"engine", "simulator", "error", ...} as JSON')
    p.add_argument("--out", type=out_dir, default=None,
                   help="write the results here: the engine run's CSVs, the local GPU file and a plot; "
                        "with --against, against.json and against.png")
    p.add_argument("--seed", type=int, default=None, help="prompt ids and arrival draws (default 0)")
    e = p.add_argument_group("engine run (default)")
    e.add_argument("--engine-model", default=None, help="engine checkpoint (default: bundled SmolLM2-135M)")
    factor = positive_float_at_most(_MAX_FACTOR)
    e.add_argument("--num-requests", type=int_at_least(_MIN_REQUESTS), default=None,
                   help="requests from the bundled trace (default 24)")
    e.add_argument("--load", type=factor, default=None, help="offered work over the engine's speed (default 0.7)")
    add_renamed(e, "--engine-max-num-batched-tokens", "--token-budget", dest="engine_token_budget", type=positive_int,
                default=128, metavar="N", help="the engine run's token budget (default 128: a step of the bundled "
                "135M model on one CPU thread stays near 0.1 s)")
    add_renamed(e, "--engine-max-num-seqs", "--max-seqs", dest="engine_max_seqs", type=positive_int, default=16,
                metavar="N", help="the engine run's most running requests (default 16)")
    e.add_argument("--kv-tokens", type=positive_int, default=None, help="KV capacity, tokens (default 16384)")
    e.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default 1)")
    e.add_argument("--device", default=None, help="cpu (default) or cuda")
    e.add_argument("--engine-dtype", default=None, help="engine weights: float32 (default), bf16, fp16")
    e.add_argument("--prompt-scale", type=factor, default=None, help="trace prompt lengths x this (1/16)")
    e.add_argument("--output-scale", type=factor, default=None, help="trace output lengths x this (1/8)")
    e.add_argument("--max-prompt", type=positive_int, default=None, help="prompt length cap, tokens (192)")
    e.add_argument("--max-output", type=positive_int, default=None, help="output length cap, tokens (40)")
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
    v.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree (default 1)")
    v.add_argument("--dtype", default=None, help="weight dtype (default bf16)")
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
    g.add_argument("--range", action=argparse.BooleanOptionalAction, default=None,
                   help="run folders: replay each run twice more, every step at the 10th and 90th percentile of the "
                   "measured step-time error (stallfree.sim.studies.ranges), and report whether each measured figure "
                   "lies "
                   "in the range, their coverage and median width (default on; --no-range: one replay a run)")
    p.set_defaults(func=_run)
