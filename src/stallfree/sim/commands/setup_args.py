"""The workload and hardware flags every simulator command shares, their checks, and the typed options and
Setup built from them.

Imports allowed: the standard library, stallfree._argtypes, stallfree.core, stallfree.flags and
stallfree.sim.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from stallfree._argtypes import (
    float_at_least,
    float_between,
    int_list,
    out_dir,
    partial_prefill_flag_problem,
    positive_float,
    positive_int,
)
from stallfree.core.config import SchedulerConfig
from stallfree.flags import add_scheduler_flags, given, scheduler_options
from stallfree.sim.commands.common import ENGINE_DEFAULT_WHY, CliError, slo_tpot, slo_ttft
from stallfree.sim.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LORA_RANK,
    DEFAULT_MAX_SEQS,
    DEFAULT_RATE_SCALE,
)
from stallfree.sim.defaults import DEFAULT_REPLICA as DEFAULTS

if TYPE_CHECKING:
    from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
    from stallfree.sim.inputs.setup import Setup

# The options, the Setup and the LoRA parser are imported where they are built, not here, so that
# building a parser (a command's --help) imports none of the simulator.

__all__ = [
    "add_common",
    "check_partial_prefill_flags",
    "check_synthetic_flags",
    "hardware_options",
    "setup_from_args",
    "workload_options",
]


def add_common(p: argparse.ArgumentParser, hardware_lists: bool = False) -> None:
    """Add the workload, model-and-hardware, scheduler and report options every command shares;
    with `hardware_lists` (plan), --gpu and --tp take comma-separated lists (args.tp is then a list)."""
    _add_workload_args(p.add_argument_group("workload (default: the bundled Azure LLM 2023 conversation trace)"))
    _add_hardware_args(p.add_argument_group("model and hardware (the cost model)"), hardware_lists)
    s = p.add_argument_group("scheduler")
    add_scheduler_flags(s, {"max_seqs": DEFAULT_MAX_SEQS, "policy": "fcfs", "async_scheduling": None,
                            "enable_chunked_prefill": True, "max_num_partial_prefills": 1,
                            "max_long_partial_prefills": None, "long_prefill_token_threshold": None},
                        why={"async_scheduling": f"default: {ENGINE_DEFAULT_WHY}; docs/simulator.md"})
    # What a command without these flags reads (argparse defaults with no flag): one place, not getattr.
    # (Set before a command adds its own flags, so a flag's default wins where it has one.) None: the
    # pricing engine's default, resolved by Setup once the pricing is known (stallfree.sim.inputs.engine_behaviour).
    p.set_defaults(concurrency=None, think_time=0.0, closed_loop_flags=False, kv_policy=None, block_size=None,
                   watermark=None, enable_prefix_caching=None, cpu_kv_tokens=None, kv_offloading_size=None)
    _add_lora_args(p.add_argument_group("LoRA adapters (docs/simulator.md, \"LoRA adapters\")"))
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft", type=slo_ttft, metavar="T", help="TTFT objective for goodput (200ms, 1s; bare = ms)")
    r.add_argument("--slo-tpot", type=slo_tpot, metavar="T", help="TPOT objective for goodput (bare = ms)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    r.add_argument("--out", type=out_dir, metavar="DIR", help="write summary, records (CSV) and plots (PNG) here")


def _add_lora_args(g: Any) -> None:
    """The LoRA options (an argparse argument group): the scheduler's adapter limit, the replica's
    adapter memory and rank, and adapters drawn for the workload."""
    add_scheduler_flags(g, {"max_loras": None, "max_lora_passes": None, "max_cpu_loras": None, "lora_rank": None},
                        why={"max_lora_passes": f"default {SchedulerConfig.max_lora_passes}",
                             "max_cpu_loras": "default: --max-loras", "lora_rank": f"default {DEFAULT_LORA_RANK}"})
    g.add_argument("--loras", type=positive_int, metavar="N",
                   help="each request names one of N adapters (lora-0 .. lora-N-1), drawn with --lora-popularity "
                   "(seeded by --seed); in place of a trace's lora column")
    g.add_argument("--lora-popularity", default=None, metavar="zipf:S", type=_popularity,
                   help="with --loras: adapter k drawn with probability proportional to 1/(k+1)^S (default zipf:1)")


def _popularity(text: str) -> str:
    """--lora-popularity's value, checked (stallfree.sim.run.lora.parse_popularity); a usage error otherwise."""
    from stallfree.sim.run.lora import parse_popularity

    try:
        parse_popularity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_workload_args(w: Any) -> None:
    """The workload options (an argparse argument group)."""
    w.add_argument(
        "--trace",
        metavar="PATH",
        help="a trace file: Azure 2023 CSV, BurstGPT CSV, Mooncake JSONL (with hash_ids), or "
        "CSV/JSONL with arrival_time,prompt_len,output_len (.gz allowed); 'mooncake': the bundled "
        "Mooncake FAST'25 conversation trace",
    )
    w.add_argument(
        "--trace-format", default="auto",
        choices=["auto", "azure", "burstgpt", "csv", "jsonl", "mooncake", "sessions"],
        help="auto picks by extension and header; a JSONL whose first object has session_id is a session trace",
    )
    w.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows instead of stopping")
    w.add_argument("--synthetic", choices=["poisson", "gamma", "shared-prefix", "sessions", "diurnal"],
                   help="draw synthetic arrivals instead of a trace (shared-prefix: with --shared-prefix; "
                        "sessions: multi-turn conversations, --rate in sessions/s, --prompt-len each turn's new "
                        "input, --turns, --think-time, --system-prompt; diurnal: a day whose mean rate is --rate, "
                        "with --peak-ratio and --peak-hour, Poisson or with --burstiness gamma)")
    w.add_argument("--peak-ratio", type=float_at_least(1), default=None, metavar="X",
                   help="--synthetic diurnal: the busiest rate over the quietest (default 3, an example)")
    w.add_argument("--peak-hour", type=float_between(0, 24), default=None, metavar="H",
                   help="--synthetic diurnal: the hour of the busiest rate, 0 to 24 (default 14, an example)")
    w.add_argument("--rate-profile", default=None, metavar="FILE",
                   help="arrivals under the rate of a CSV t_s,rate (requests/s, linear between points), Poisson "
                        "or with --burstiness gamma; lengths from --prompt-len/--output-len")
    w.add_argument("--turns", default=None, metavar="DIST",
                   help="--synthetic sessions: turns per session, a length distribution (default fixed:4; at most "
                   "10,000 a session)")
    w.add_argument("--system-prompt", default=None, metavar="TOKENS[,COUNT]",
                   help="--synthetic sessions: every session opens with one of COUNT (default 1) system prompts "
                        "of TOKENS tokens (vLLM's suffixes: 1k = 1,000, 1K = 1,024), shared as a cached prefix "
                        "(default none)")
    w.add_argument("--shared-prefix", default=None, metavar="G,P,S,Q",
                   help="synthetic shared-prefix: G groups of P prompts, a system prompt of S tokens shared "
                        "within a group, a question of Q tokens (S and Q with vLLM's suffixes: 1k = 1,000, 1K = "
                        "1,024; outputs: --output-len; hits need --kv-policy paged --enable-prefix-caching)")
    # The synthetic-only options default to None (their values: WorkloadOptions's defaults), so that
    # one given on a trace replay, where it would be ignored, is refused (check_synthetic_flags).
    w.add_argument("--rate", type=positive_float, default=None, help="synthetic: mean requests/s (default 5)")
    w.add_argument(
        "--burstiness",
        type=positive_float,
        default=None,
        help="synthetic gamma: shape of the gaps (1 = Poisson, < 1 burstier)",
    )
    w.add_argument(
        "--prompt-len",
        default=None,
        metavar="DIST",
        help="synthetic: fixed:N, uniform:LO,HI, lognormal:MEDIAN,SIGMA, trace or trace:PATH; N, LO, HI and "
        "MEDIAN are tokens, with vLLM's suffixes (1k = 1,000, 1K = 1,024)",
    )
    w.add_argument("--output-len", default=None, metavar="DIST",
                   help="synthetic: as --prompt-len (with --synthetic shared-prefix: the outputs)")
    w.add_argument("--seed", type=int, default=None,
                   help="synthetic: random seed of what is drawn (lengths, arrivals, --loras' adapters; default 0)")
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


def _add_hardware_args(m: Any, lists: bool = False) -> None:
    """The model-and-hardware options (an argparse argument group); `lists`: --gpu and --tp take lists."""
    m.add_argument("--model", default=DEFAULTS["model"],
                   help="model name (see `stallfree specs`) or a .json file, a Hugging Face config.json or our "
                   f"format (default {DEFAULTS['model']})")
    if lists:
        m.add_argument("--gpu", default=DEFAULTS["gpu"], metavar="LIST",
                       help=f"GPU presets to search, comma-separated (default {DEFAULTS['gpu']})")
        m.add_argument("--tp", type=int_list, default=[DEFAULTS["tp"]], metavar="LIST",
                       help=f"tensor-parallel GPUs per replica to search, comma-separated (default {DEFAULTS['tp']})")
    else:
        m.add_argument("--gpu", default=DEFAULTS["gpu"],
                       help=f"GPU name (see `stallfree specs`) or a .json file (default {DEFAULTS['gpu']})")
        m.add_argument("--tp", type=positive_int, default=DEFAULTS["tp"],
                       help=f"tensor-parallel GPUs per replica (default {DEFAULTS['tp']})")
    m.add_argument("--dtype", default=DEFAULTS["dtype"],
                   help="weight dtype: bf16, fp16, fp8 (W8A8), int8, int4 (weight-only), mxfp4, nvfp4 "
                   f"(default {DEFAULTS['dtype']})")
    m.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: the cost model's)")
    m.add_argument("--ep", type=positive_int, default=1, metavar="N",
                   help="expert parallelism of an MoE model: experts split over N GPUs (vLLM's "
                   "--enable-expert-parallel, SGLang's --ep-size; default 1)")
    m.add_argument("--dp-attention", type=positive_int, default=1, metavar="N",
                   help="data-parallel attention ranks of an MoE model, each of --tp GPUs (SGLang's "
                   "--enable-dp-attention --dp-size N, vLLM's --data-parallel-size N; default 1)")
    add_scheduler_flags(m, {"gpu_memory_utilization": 0.9, "kv_tokens": None, "max_model_len": None},
                        why={"max_model_len": "default: the model's; a request whose prompt + max_new exceeds "
                             "it is refused at arrival, as vLLM's server refuses it"})
    m.add_argument(
        "--cut-output-to-fit",
        action="store_true",
        help="cut max_new to fit the context length instead (vLLM's behaviour without max_tokens); "
        "only a prompt that leaves no room for output is refused",
    )
    m.add_argument(
        "--linear-cost",
        metavar="BASE_MS,PER_TOKEN_US[,PER_CTX_NS]",
        help="price steps as BASE + PER_TOKEN * tokens + PER_CTX * decode context instead",
    )
    m.add_argument(
        "--kernels",
        metavar="ENGINE[:VERSION]",
        help="price steps from measured GPU kernel tables (aiconfigurator-core): vllm, sglang or trtllm, "
        "VERSION a slot (current, previous, next) or a version the package serves; 'none' for the "
        "calibrated or floor pricing (default: vllm's current tables where the package is installed and "
        "has the GPU, else none; the header says which)",
    )
    m.add_argument(
        "--engine-profile",
        metavar="NAME",
        help="add the engine's own time around the kernels (sim/data/engine_profiles.json: none, vllm; "
        "docs/fidelity.md): its step terms to every step, its front end to every TTFT and E2E; default: "
        "the profile fitted on the engine whose kernel tables priced the steps, none under today's pricing",
    )


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    """The workload options of a parsed command line."""
    from stallfree.sim.inputs.options import WorkloadOptions

    return WorkloadOptions(
        trace=args.trace,
        trace_format=args.trace_format,
        skip_bad_rows=args.skip_bad_rows,
        synthetic=args.synthetic,
        seed=0 if args.seed is None else args.seed,
        num_requests=args.num_requests,
        start=args.start,
        end=args.end,
        rate_scale=args.rate_scale,
        max_tokens=args.max_tokens,
        cut_output_to_fit=args.cut_output_to_fit,
        shared_prefix=args.shared_prefix,
        shared_prefix_block=args.block_size or DEFAULT_BLOCK_SIZE,
        concurrency=args.concurrency,
        think_time=args.think_time,
        loras=args.loras,
        # The synthetic-only options as given; one left out takes WorkloadOptions's default.
        **{name: value for name in ("rate", "burstiness", "prompt_len", "output_len", "turns", "system_prompt",
                                    "lora_popularity", "peak_ratio", "peak_hour", "rate_profile")
           if (value := vars(args)[name]) is not None},
    )


def check_synthetic_flags(args: argparse.Namespace) -> None:
    """Refuse a synthetic-load option given where nothing would read it, naming the flag (a flag that would
    be ignored is never silent). --rate is read by a synthetic arrival process (--synthetic poisson, gamma
    or shared-prefix), --burstiness by --synthetic gamma alone; --prompt-len by --synthetic poisson or gamma
    and --output-len by any --synthetic, both also by --concurrency N without --trace (closed-loop load on
    drawn lengths; stallfree.sim.inputs.setup). --num-requests is not one of them: it cuts a trace too.

    Raises:
        CliError: such an option given explicitly without the mode that reads it (exit 2).
    """
    synthetic = args.synthetic
    profile = args.rate_profile is not None
    if profile and (synthetic is not None or args.trace):
        raise CliError(f"--rate-profile gives the arrivals: drop {'--trace' if args.trace else '--synthetic'}", 2)
    if profile and args.rate is not None:
        raise CliError("--rate applies to synthetic arrivals; --rate-profile gives the rates: drop --rate", 2)
    if synthetic is None and profile:
        synthetic = "profile"
    for flag, value in (("--peak-ratio", args.peak_ratio), ("--peak-hour", args.peak_hour)):
        if value is not None and synthetic != "diurnal":
            raise CliError(f"{flag} applies to --synthetic diurnal: add it, or drop {flag}", 2)
    closed_drawn = args.concurrency is not None and not args.trace
    closed = args.closed_loop_flags
    needs = " or --concurrency N" if closed else ""
    read = {
        "--rate": (args.rate, synthetic is not None,
                   "synthetic arrivals: add --synthetic poisson, gamma, shared-prefix, sessions or diurnal"),
        "--turns": (args.turns, synthetic == "sessions", "--synthetic sessions: add it"),
        "--system-prompt": (args.system_prompt, synthetic == "sessions", "--synthetic sessions: add it"),
        "--burstiness": (args.burstiness, synthetic in ("gamma", "diurnal", "profile"),
                         "--synthetic gamma or diurnal, or --rate-profile (the shape of its gaps): add one"),
        "--prompt-len": (args.prompt_len, synthetic in ("poisson", "gamma", "sessions", "diurnal", "profile")
                         or closed_drawn,
                         f"synthetic load: add --synthetic poisson or gamma{needs}"
                         + (" without --trace" if closed else "")),
        "--output-len": (args.output_len, synthetic is not None or closed_drawn,
                         f"synthetic load: add --synthetic{needs}" + (" without --trace" if closed else "")),
        "--seed": (args.seed, synthetic is not None or closed_drawn or getattr(args, "loras", None) is not None,
                   f"what a run draws: synthetic load (add --synthetic{needs}) or --loras' adapters"),
    }
    for flag, (value, used, where) in read.items():
        if value is not None and not used:
            own = {"--rate": "arrivals", "--burstiness": "arrivals", "--seed": "arrivals and lengths"}
            why = "" if synthetic else f" (a trace replay has its own {own.get(flag, 'lengths')})"
            raise CliError(f"{flag} applies to {where}, or drop {flag}{why}", 2)


def hardware_options(args: argparse.Namespace) -> HardwareOptions:
    """The hardware options of a parsed command line."""
    from stallfree.sim.inputs.options import HardwareOptions

    return HardwareOptions(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        ep=args.ep,
        dp_attention=args.dp_attention,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_tokens=args.kv_tokens,
        linear_cost=args.linear_cost,
        max_model_len=args.max_model_len,
        kernels=args.kernels,
        engine_profile=args.engine_profile,
    )


def check_partial_prefill_flags(args: argparse.Namespace) -> None:
    """Refuse partial-prefill options that contradict each other, naming the flags as typed.

    Raises:
        CliError: --max-long-partial-prefills above --max-num-partial-prefills, or L or T given
            while --max-num-partial-prefills is 1 (exit 2).
    """
    problem = partial_prefill_flag_problem(
        args.max_num_partial_prefills, args.max_long_partial_prefills, args.long_prefill_token_threshold)
    if problem is not None:
        raise CliError(problem, 2)


def setup_from_args(args: argparse.Namespace) -> Setup:
    """The Setup of a parsed command line (scheduler options default where a command has none).

    Raises:
        CliError: contradictory partial-prefill options (check_partial_prefill_flags), a synthetic-load
            option without the mode that reads it (check_synthetic_flags), or --block-size or --watermark
            typed for a run that reserves its KV (exit 2).
    """
    check_partial_prefill_flags(args)
    check_synthetic_flags(args)
    options = scheduler_options(args)
    options.pop("kv_tokens", None)  # the replica's capacity: HardwareOptions.kv_tokens, else the cost model's
    if options.get("token_budget") is None:
        options.pop("token_budget", None)
    if args.lora_popularity is not None and args.loras is None:
        raise CliError("--lora-popularity draws adapters for --loras N: add it", 2)
    if args.max_loras is None:
        for flag, value in (("--max-cpu-loras", args.max_cpu_loras), ("--lora-rank", args.lora_rank),
                            ("--max-lora-passes", args.max_lora_passes)):
            if value is not None:
                raise CliError(f"{flag} applies to LoRA adapters: add --max-loras N", 2)
    from stallfree.sim.inputs.setup import Setup

    setup = Setup(workload_options(args), hardware_options(args), options,
                  kv_offloading_gib=args.kv_offloading_size, async_scheduling=args.async_scheduling,
                  lora_rank=args.lora_rank or DEFAULT_LORA_RANK, max_cpu_loras=args.max_cpu_loras)
    # Paged-only flags typed for a run that, by the pricing engine's default, reserves its KV.
    typed = [n for n in (given(args, "block_size"), given(args, "watermark")) if n]
    if typed and not setup.paged:
        verb = "applies" if len(typed) == 1 else "apply"
        raise CliError(f"{' and '.join(typed)} {verb} to --kv-policy paged (this run reserves its KV: "
                       f"{setup.behaviour()}): add --kv-policy paged", 2)
    return setup
