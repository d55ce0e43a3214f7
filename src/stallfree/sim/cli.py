"""The `stallfree simulate` and `stallfree sweep` commands: build a workload, a cost model and
scheduler configs from the command line, run them, and print or write the reports.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim;
numpy, matplotlib and rich lazily (reports and plots).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from stallfree._argtypes import int_list, positive_float, positive_float_list, positive_int
from stallfree.core.metrics import parse_duration
from stallfree.sim.costs import LinearCostModel, StepCostModel
from stallfree.sim.simulator import (
    BATCHING_MODES,
    SchedulerConfig,
    SimulationError,
    saturated_throughput,
    simulate,
)
from stallfree.sim.workload import (
    TraceError,
    Workload,
    load_bundled,
    load_trace,
    parse_length_spec,
    synthetic,
)

__all__ = ["DEFAULT_RATE_SCALE", "Setup", "default_cost_model", "register"]

#: The default speed-up of the bundled trace (docs/simulator.md explains the choice): at its real
#: rate (5.5 req/s) the default replica (Llama 3.3 70B, 4 x H100 SXM, FP8) is only lightly busy.
DEFAULT_RATE_SCALE = 3.0

DEFAULTS = {"model": "llama-3.3-70b", "gpu": "h100-sxm", "tp": 4, "dtype": "fp8"}

#: The default cap of a step's budget in time budget mode, tokens: far above what a step within a
#: TPOT-sized target holds, so that the target is what limits it.
TIME_BUDGET_CAP = 65536


class CliError(Exception):
    """A user error to print as one line; `code` is the exit status (1, or 2 for usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------- parsing






def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None






def _modes(text: str) -> list[str]:
    modes = [t.strip() for t in text.split(",") if t.strip()]
    if not modes:
        raise argparse.ArgumentTypeError(f"expected batching modes ({', '.join(BATCHING_MODES)}), got {text!r}")
    for m in modes:
        if m not in BATCHING_MODES:
            raise argparse.ArgumentTypeError(f"unknown batching mode {m!r} (choose from {', '.join(BATCHING_MODES)})")
    return modes




def _add_common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (default: the bundled Azure LLM 2023 conversation trace)")
    w.add_argument(
        "--trace",
        metavar="PATH",
        help="a trace file: Azure 2023 CSV, BurstGPT CSV, or "
        "CSV/JSONL with arrival_time,prompt_len,output_len (.gz allowed)",
    )
    w.add_argument("--trace-format", default="auto", choices=["auto", "azure", "burstgpt", "csv", "jsonl"])
    w.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows instead of stopping")
    w.add_argument("--synthetic", choices=["poisson", "gamma"], help="draw synthetic arrivals instead of a trace")
    w.add_argument("--rate", type=positive_float, default=5.0, help="synthetic: mean requests/s (default 5)")
    w.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="synthetic gamma: shape of the gaps (1 = Poisson, < 1 burstier)",
    )
    w.add_argument(
        "--prompt-len",
        default="trace",
        metavar="DIST",
        help="synthetic: fixed:N, uniform:LO,HI, lognormal:MEDIAN,SIGMA, trace or trace:PATH",
    )
    w.add_argument("--output-len", default="trace", metavar="DIST", help="synthetic: as --prompt-len")
    w.add_argument("--seed", type=int, default=0, help="synthetic: random seed (default 0)")
    w.add_argument(
        "--num-requests",
        type=positive_int,
        metavar="N",
        help="only the first N requests (synthetic: how many to draw, default 1000)",
    )
    w.add_argument("--start", type=float, default=0.0, metavar="S", help="time window start, s of trace time")
    w.add_argument("--end", type=float, default=math.inf, metavar="S", help="time window end, s of trace time")
    w.add_argument(
        "--rate-scale",
        type=positive_float,
        metavar="X",
        help=f"replay X times faster (default {DEFAULT_RATE_SCALE:g} for the bundled trace, else 1)",
    )
    w.add_argument(
        "--max-tokens",
        type=positive_int,
        metavar="N",
        help="every request's max_new (KV reservation); shorter outputs stop early, longer are cut",
    )
    m = p.add_argument_group("model and hardware (the cost model)")
    m.add_argument("--model", default=DEFAULTS["model"])
    m.add_argument("--gpu", default=DEFAULTS["gpu"])
    m.add_argument("--tp", type=positive_int, default=DEFAULTS["tp"], help="tensor-parallel GPUs")
    m.add_argument("--dtype", default=DEFAULTS["dtype"], help="weight dtype")
    m.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: the cost model's)")
    m.add_argument("--gpu-memory-utilization", type=positive_float, default=0.9, metavar="F")
    m.add_argument("--kv-tokens", type=positive_int, metavar="N", help="KV capacity override, tokens")
    m.add_argument(
        "--linear-cost",
        metavar="BASE_MS,PER_TOKEN_US[,PER_CTX_NS]",
        help="price steps as BASE + PER_TOKEN * tokens + PER_CTX * decode context instead",
    )
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-seqs", type=positive_int, default=256, help="most running requests (default 256)")
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft", type=_duration, metavar="T", help="TTFT objective for goodput (200ms, 1s; bare = ms)")
    r.add_argument("--slo-tpot", type=_duration, metavar="T", help="TPOT objective for goodput (bare = ms)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    r.add_argument("--out", type=Path, metavar="DIR", help="write summary, records (CSV) and plots (PNG) here")


def register(subparsers: Any) -> None:
    """Add the `simulate` and `sweep` subcommands to the top-level CLI."""
    sim = subparsers.add_parser(
        "simulate",
        help="replay a trace through the scheduler and report TTFT, TPOT, ITL, goodput",
        description="Replay a workload through the scheduler, timing each step with the cost model. "
        "With no arguments: the bundled Azure conversation trace on Llama 3.3 70B, 4 x H100 SXM, FP8.",
    )
    _add_common(sim)
    g = sim.add_argument_group("batching")
    g.add_argument(
        "--batching",
        choices=BATCHING_MODES,
        default="chunked",
        help="chunked (the contract), prefill-first or no-chunk (baselines)",
    )
    g.add_argument(
        "--budget",
        "--token-budget",
        dest="budget",
        type=positive_int,
        default=None,
        help="token budget per step (default 2048; with --step-time-target, the cap of each step's "
        f"budget, default {TIME_BUDGET_CAP:,})",
    )
    g.add_argument(
        "--step-time-target",
        type=_duration,
        metavar="T",
        help="time budget mode: each step takes the most tokens whose predicted time stays under T "
        "(50ms; bare = ms), given the running decodes' context lengths",
    )
    g.add_argument(
        "--scheduler",
        choices=["reserve", "paged"],
        default="reserve",
        help="reserve: KV for prompt + max_new reserved at admission (the contract); paged: KV blocks "
        "taken as tokens are computed, preemption by recompute",
    )
    g.add_argument("--block-size", type=positive_int, default=16, help="paged: tokens per KV block (default 16)")
    g.add_argument(
        "--watermark",
        type=float,
        default=0.01,
        help="paged: fraction of KV blocks kept free at admission (default 0.01)",
    )
    g.add_argument("--compare", action="store_true", help="run all three batching modes side by side")
    g.add_argument("--check", action="store_true", help="check the scheduler's invariants after every step")
    g.add_argument("--records", type=Path, metavar="FILE", help="per-request records to FILE (.csv or .json)")
    sim.set_defaults(func=_guard(run_simulate))

    sweep = subparsers.add_parser(
        "sweep",
        help="simulate a grid of token budgets (and rate scales, batching modes) in parallel",
        description="One simulation per (batching mode, rate scale, budget), in parallel processes; "
        "a table, and with --out a CSV and PNGs of p99 TPOT against p99 TTFT and of TTFT/TPOT CDFs.",
    )
    _add_common(sweep)
    sweep.add_argument(
        "--budgets",
        type=int_list,
        default=[256, 512, 1024, 2048, 4096, 8192],
        metavar="LIST",
        help="token budgets to simulate (default 256,512,1024,2048,4096,8192)",
    )
    sweep.add_argument(
        "--rate-scales", type=positive_float_list, metavar="LIST", help="default: the --rate-scale default"
    )
    sweep.add_argument(
        "--batching",
        type=_modes,
        default=list(BATCHING_MODES),
        metavar="LIST",
        help="comma-separated modes (default all three)",
    )
    sweep.add_argument("--jobs", type=positive_int, metavar="N", help="worker processes (default: CPUs)")
    sweep.set_defaults(func=_guard(run_sweep))

    from stallfree.sim.tune import register_tune

    register_tune(subparsers)


def _guard(func: Any) -> Any:
    """Turn expected errors into one line on stderr and an exit status."""

    def run(args: argparse.Namespace) -> int:
        prog = f"stallfree {args.command}"
        try:
            return int(func(args))
        except CliError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return exc.code
        except (TraceError, SimulationError, ValueError, OSError) as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1

    return run


# ------------------------------------------------------------------------------------ setup


class Setup:
    """What a command line asks for: the workload, the cost model, and the KV capacity."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base_workload, self.rate_scale = build_workload(args)
        self.workload = self.base_workload.scale_rate(self.rate_scale)
        self.cost_model, self.kv_tokens, self.hardware = build_cost_model(args)

    def config(self, batching: str, budget: int) -> SchedulerConfig:
        """The scheduler config for one run (paged KV applies to chunked batching; baselines reserve)."""
        a = self.args
        kv = getattr(a, "scheduler", "reserve") if batching == "chunked" else "reserve"
        block_size, watermark = getattr(a, "block_size", 16), getattr(a, "watermark", 0.01)
        return SchedulerConfig(self.kv_tokens, budget, a.max_seqs, batching, kv, block_size, watermark)

    def header(self) -> dict[str, Any]:
        """Facts for the report's header."""
        wl = self.workload
        return {
            "workload": wl.name,
            "requests": len(wl),
            "rate_scale": self.rate_scale,
            "offered_rate": wl.mean_rate,
            "hardware": self.hardware,
            "kv_tokens": self.kv_tokens,
            "max_seqs": self.args.max_seqs,
            "max_tokens": self.args.max_tokens,
            "notes": list(wl.notes),
        }


# The most requests a synthetic workload draws: each costs a few hundred bytes here and a step or more
# of simulation, so more would take minutes and GiBs without telling anything new.
MAX_SYNTHETIC_REQUESTS = 5_000_000


def build_workload(args: argparse.Namespace) -> tuple[Workload, float]:
    """The workload the options describe (at its own rate), and the rate scale to apply.

    Raises:
        CliError: conflicting options; TraceError: an unreadable trace; ValueError: a bad value.
    """
    if args.synthetic and args.trace:
        raise CliError("--trace and --synthetic are exclusive", 2)
    if args.synthetic:
        if (args.num_requests or 0) > MAX_SYNTHETIC_REQUESTS:
            raise CliError(
                f"--num-requests {args.num_requests:,} is more than a synthetic run draws "
                f"(at most {MAX_SYNTHETIC_REQUESTS:,}, about a GiB of memory)",
                2,
            )
        wl = synthetic(
            args.num_requests or 1000,
            args.rate,
            parse_length_spec(args.prompt_len),
            parse_length_spec(args.output_len),
            args.synthetic,
            args.burstiness,
            args.seed,
        )
        scale = args.rate_scale or 1.0
    else:
        wl = load_trace(args.trace, args.trace_format, args.skip_bad_rows) if args.trace else load_bundled()
        if args.start or args.end != math.inf:
            wl = wl.window(args.start, args.end)
            if not len(wl):
                raise CliError(f"no request arrives in the window [{args.start:g}, {args.end:g}) s")
        if args.num_requests:
            wl = wl.head(args.num_requests)
        scale = args.rate_scale or (1.0 if args.trace else DEFAULT_RATE_SCALE)
    return wl, scale


def _parse_linear(text: str) -> LinearCostModel:
    try:
        nums = [float(x) for x in text.split(",")]
        if len(nums) not in (2, 3) or not all(math.isfinite(x) for x in nums):
            raise ValueError("each must be a finite number" if len(nums) in (2, 3) else "")
        return LinearCostModel(nums[0] * 1e-3, nums[1] * 1e-6, (nums[2] if len(nums) == 3 else 0.0) * 1e-9)
    except ValueError as exc:
        detail = f": {exc}" if str(exc) else ""
        raise CliError(f"--linear-cost wants BASE_MS,PER_TOKEN_US[,PER_CTX_NS], got {text!r}{detail}", 2) from None


def build_cost_model(args: argparse.Namespace) -> tuple[StepCostModel, int, str]:
    """The cost model, the KV capacity (tokens) and a one-line description of the hardware.

    The KV capacity comes from stallfree.costmodel (model, GPU, TP, dtypes and
    --gpu-memory-utilization) unless --kv-tokens overrides it; --linear-cost replaces the step
    pricing only.

    Raises:
        CliError: an unknown model, GPU or dtype, or a bad --linear-cost.
    """
    from stallfree.costmodel import CostModel, CostModelError

    try:
        real = CostModel.from_names(
            model=args.model, gpu=args.gpu, tp=args.tp, dtype=args.dtype, kv_dtype=args.kv_dtype, mode="full"
        )
        kv = args.kv_tokens or real.kv_capacity_tokens(gpu_memory_utilization=args.gpu_memory_utilization)
    except (CostModelError, ValueError) as exc:
        raise CliError(str(exc)) from None
    hw = f"{args.model}, {args.tp} x {args.gpu}, {args.dtype}" + (f", KV {args.kv_dtype}" if args.kv_dtype else "")
    if args.linear_cost:
        return (
            _parse_linear(args.linear_cost),
            int(kv),
            f"linear cost {args.linear_cost} (ms, us/token, ns/context token)",
        )
    return real, int(kv), hw


# ----------------------------------------------------------------------------------- commands


def run_simulate(args: argparse.Namespace) -> int:
    """`stallfree simulate`: one run, or all batching modes with --compare."""
    from stallfree.sim.report import print_table, summarize_result, write_records

    if args.check and args.batching != "chunked" and not args.compare:
        raise CliError("--check checks the contract's scheduler: use it with --batching chunked", 2)
    if not 0 <= args.watermark < 1:
        raise CliError(f"--watermark must be in [0, 1), got {args.watermark}", 2)
    if args.scheduler != "paged" and (args.block_size != 16 or args.watermark != 0.01):
        raise CliError("--block-size and --watermark apply to --scheduler paged", 2)
    if args.compare and args.batching != "chunked":
        raise CliError("--compare runs every batching mode: drop --batching", 2)
    if args.scheduler == "paged" and args.batching != "chunked" and not args.compare:
        raise CliError("--scheduler paged runs chunked batching: drop --batching", 2)
    if args.step_time_target is not None and (args.compare or args.batching != "chunked"):
        raise CliError("--step-time-target drives the chunked scheduler: drop --compare and --batching", 2)
    if args.budget is None:
        args.budget = 2048 if args.step_time_target is None else TIME_BUDGET_CAP
    setup = Setup(args)
    modes = list(BATCHING_MODES) if args.compare else [args.batching]
    header_rate = setup.workload.mean_rate
    results, summaries = [], []
    for mode in modes:
        sched = _scheduler_for(args, setup, mode)
        res = simulate(
            setup.workload,
            sched,
            setup.cost_model,
            max_tokens=args.max_tokens,
            check=args.check and mode == "chunked",
            label=getattr(sched, "label", None),
        )
        if args.step_time_target is not None:
            res.config.update(batching=mode, max_seqs=args.max_seqs, step_time_target_s=args.step_time_target)
        results.append(res)
        summary = summarize_result(res, args.slo_ttft, args.slo_tpot)
        summary["capacity_req_s"] = saturated_throughput(setup.workload, sched, setup.cost_model, args.max_tokens)
        summary["load"] = header_rate / summary["capacity_req_s"]
        summaries.append(summary)
    header = setup.header()
    header["token_budget"] = args.budget
    header["step_time_target_s"] = args.step_time_target
    if args.json:
        print(json.dumps({"header": header, "runs": summaries}, indent=1))
    else:
        _print_header(header, summaries)
        print_table(summaries)
        for res in results:
            if res.rejected:
                print(f"{res.label}: rejected {len(res.rejected)} requests; first: {res.rejected[0][1]}")
            if args.check and res.config.get("batching", "chunked") == "chunked":
                print(f"{res.label}: every scheduler invariant held after each of {res.num_steps:,} steps")
    if args.records:
        for res in results:
            path = args.records if len(results) == 1 else _suffixed(args.records, res.config["batching"])
            write_records(res, path)
    if args.out:
        _write_out(args.out, header, results, summaries)
    return 0


def _scheduler_for(args: argparse.Namespace, setup: Setup, mode: str) -> Any:
    """The scheduler of one run: a SchedulerConfig, or a TimeBudgetConfig with --step-time-target."""
    if args.step_time_target is None:
        return setup.config(mode, args.budget)
    from stallfree.sim.time_budget import TimeBudgetConfig

    return TimeBudgetConfig(
        setup.kv_tokens, args.step_time_target, setup.cost_model, args.budget, args.max_seqs,
        kv_policy=args.scheduler, block_size=args.block_size, watermark=args.watermark,
    )


def _suffixed(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.stem}-{tag}{path.suffix}")


def _budget_text(header: dict[str, Any]) -> str:
    if header.get("step_time_target_s") is None:
        return f"budget {header['token_budget']:,}"
    return f"step time target {header['step_time_target_s'] * 1e3:g} ms (budget cap {header['token_budget']:,})"


def _print_header(header: dict[str, Any], summaries: list[dict[str, Any]]) -> None:
    wl = f"{header['workload']}: {header['requests']:,} requests"
    rate = header["offered_rate"]
    offered = f"{rate:.2f} req/s offered" if math.isfinite(rate) else "all at one instant"
    scale = f"rate scale {header['rate_scale']:g} ({offered})"
    print(f"{wl}, {scale}")
    print(
        f"{header['hardware']}; KV {header['kv_tokens']:,} tokens; max_seqs {header['max_seqs']}; "
        + _budget_text(header) + (f"; max_tokens {header['max_tokens']}" if header["max_tokens"] else "")
    )
    for s in summaries:
        print(
            f"{s['label']}: utilization {s['load']:.0%} of capacity (~{s['capacity_req_s']:.1f} req/s "
            f"when saturated); requests waiting after {s.get('queued_fraction') or 0:.0%} of steps"
            + (f"; {s['budget_utilization']:.0%} of the token budget used" if s.get("budget_utilization") else "")
        )
    for note in header["notes"]:
        print(f"note: {note}")


def _write_out(out: Path, header: dict[str, Any], results: list[Any], summaries: list[dict[str, Any]]) -> None:
    from stallfree.sim import plots
    from stallfree.sim.report import write_records, write_steps_csv

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"header": header, "runs": summaries}, indent=1) + "\n")
    for res in results:
        tag = res.config.get("batching", res.label)
        write_records(res, out / f"requests-{tag}.csv")
        write_steps_csv(res, out / f"steps-{tag}.csv")
    plots.plot_cdfs(results, out / "cdf.png")
    plots.plot_timeline(results, out / "timeline.png")
    print(f"wrote {out}/summary.json, requests-*.csv, steps-*.csv, cdf.png, timeline.png")


def run_sweep(args: argparse.Namespace) -> int:
    """`stallfree sweep`: a grid of runs in worker processes; table, CSV and plots."""
    from stallfree.sim.sweep import run_grid

    setup = Setup(args)
    return run_grid(args, setup, args.rate_scales or [setup.rate_scale])


def default_cost_model() -> tuple[StepCostModel, int]:
    """The default replica's cost model and KV capacity (tokens): Llama 3.3 70B, 4 x H100 SXM, FP8."""
    args = argparse.Namespace(**DEFAULTS, kv_dtype=None, gpu_memory_utilization=0.9, kv_tokens=None, linear_cost=None)
    cost, kv, _ = build_cost_model(args)
    return cost, kv
