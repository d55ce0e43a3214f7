"""What the simulator's commands share: the workload and hardware options, the error guard that
turns expected errors into one line and an exit status, and the value types of their options.

Imports allowed: the standard library, stallfree._argtypes, stallfree.core and stallfree.sim.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stallfree._argtypes import int_list, partial_prefill_flag_problem, positive_float, positive_int
from stallfree.core.config import SchedulerConfig
from stallfree.core.errors import InvalidConfig, StallfreeError
from stallfree.core.metrics import parse_duration
from stallfree.flags import KNOBS, add_scheduler_flags, flag_text, scheduler_options
from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQS
from stallfree.sim.executors import EXECUTORS, Executor, ExecutorError, make_executor
from stallfree.sim.lora import DEFAULT_LORA_RANK, parse_popularity
from stallfree.sim.sessions import parse_think_spec
from stallfree.sim.setup import (
    DEFAULT_RATE_SCALE,
    DEFAULTS,
    HardwareOptions,
    Setup,
    SetupError,
    WorkloadOptions,
)
from stallfree.sim.simulator import BATCHING_MODES, SimulationError
from stallfree.sim.workload import TraceError, TraceFileError

__all__ = [
    "ENGINE_DEFAULT_WHY",
    "CliError",
    "add_common",
    "add_executor_flags",
    "check_partial_prefill_flags",
    "check_synthetic_flags",
    "duration",
    "ensure_writable_dir",
    "ensure_writable_file",
    "OUT_FILES",
    "refuse_writing_the_trace",
    "executor_from_args",
    "flag_message",
    "flag_words",
    "guard",
    "hardware_options",
    "modes",
    "positive_duration",
    "PROGRESS_DELAY_S",
    "ProgressLine",
    "EXIT_SERVED_NOTHING",
    "rejection_warning",
    "served_nothing",
    "warn_rejections",
    "setup_from_args",
    "workload_options",
]


#: How a behaviour knob's default is worded in --help: the pricing engine's (docs/simulator.md).
ENGINE_DEFAULT_WHY = ("the engine whose kernel tables price the run (vLLM >= 0.14.0: on); the contract's "
                      "(off) under --kernels none")


class CliError(StallfreeError):
    """A user error to print as one line; `code` is the exit status (the commands' rule: 2 for any input
    error, 1 for a failure while running, 3 for SLOs missed, 4 for a run that served nothing)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def duration(text: str) -> float:
    """An argparse type: a non-negative duration ("200ms", "1s", bare = ms), in seconds."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def think_time(text: str) -> float | str:
    """An argparse type for --think-time: a duration ("200ms", "1s", bare = ms), in seconds, or a think-time
    distribution in seconds for --synthetic sessions ("fixed:S", "uniform:LO,HI", "exponential:MEAN",
    "lognormal:MEDIAN,SIGMA"; stallfree.sim.sessions.parse_think_spec), kept as its text."""
    if ":" in text:
        try:
            parse_think_spec(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()
    return duration(text)


def positive_duration(text: str) -> float:
    """An argparse type: a duration > 0 ("50ms", "1s", bare = ms), in seconds."""
    value = duration(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a duration > 0 (50ms, 1s; bare = ms), got {text!r}")
    return value


#: Below these, an SLO read as milliseconds is likely meant as seconds: warn (TTFT, TPOT), in s.
_SLO_WARN_BELOW = {"--slo-ttft": 0.010, "--slo-tpot": 0.001}


def _slo(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = positive_duration(text)
        if value < _SLO_WARN_BELOW[flag]:
            print(f"warning: {flag} {text} is read as {value * 1e3:g} ms (a bare number is ms); "
                  f"write {text.strip().lower().removesuffix('ms')}s for seconds", file=sys.stderr)
        return value

    parse.__name__ = "duration"  # argparse names the type in its error: "invalid duration value"
    return parse


def slo_ttft(text: str) -> float:
    """An argparse type for --slo-ttft: a duration > 0, s; under 10 ms, one warning line on stderr
    saying how it was read (a bare number is ms), since a TTFT objective that small is seldom meant."""
    return _slo("--slo-ttft")(text)


def slo_tpot(text: str) -> float:
    """An argparse type for --slo-tpot: a duration > 0, s; under 1 ms, one warning line on stderr."""
    return _slo("--slo-tpot")(text)


def modes(text: str) -> list[str]:
    """An argparse type: a comma-separated list of batching modes."""
    found = [t.strip() for t in text.split(",") if t.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"expected batching modes ({', '.join(BATCHING_MODES)}), got {text!r}")
    for m in found:
        if m not in BATCHING_MODES:
            raise argparse.ArgumentTypeError(f"unknown batching mode {m!r} (choose from {', '.join(BATCHING_MODES)})")
    return found


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
    # pricing engine's default, resolved by Setup once the pricing is known (stallfree.sim.engine_behaviour).
    p.set_defaults(concurrency=None, think_time=0.0, closed_loop_flags=False, kv_policy=None, block_size=None,
                   watermark=None, enable_prefix_caching=None, cpu_kv_tokens=None, kv_offloading_size=None)
    _add_lora_args(p.add_argument_group("LoRA adapters (docs/simulator.md, \"LoRA adapters\")"))
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft", type=slo_ttft, metavar="T", help="TTFT objective for goodput (200ms, 1s; bare = ms)")
    r.add_argument("--slo-tpot", type=slo_tpot, metavar="T", help="TPOT objective for goodput (bare = ms)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    r.add_argument("--out", type=Path, metavar="DIR", help="write summary, records (CSV) and plots (PNG) here")


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
    """--lora-popularity's value, checked (stallfree.sim.lora.parse_popularity); a usage error otherwise."""
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
    w.add_argument("--peak-ratio", type=float, default=None, metavar="X",
                   help="--synthetic diurnal: the busiest rate over the quietest (default 3, an example)")
    w.add_argument("--peak-hour", type=float, default=None, metavar="H",
                   help="--synthetic diurnal: the hour of the busiest rate, 0 to 24 (default 14, an example)")
    w.add_argument("--rate-profile", default=None, metavar="FILE",
                   help="arrivals under the rate of a CSV t_s,rate (requests/s, linear between points), Poisson "
                        "or with --burstiness gamma; lengths from --prompt-len/--output-len")
    w.add_argument("--turns", default=None, metavar="DIST",
                   help="--synthetic sessions: turns per session, a length distribution (default fixed:4)")
    w.add_argument("--system-prompt", default=None, metavar="TOKENS[,COUNT]",
                   help="--synthetic sessions: every session opens with one of COUNT (default 1) system prompts "
                        "of TOKENS tokens, shared as a cached prefix (default none)")
    w.add_argument("--shared-prefix", default=None, metavar="G,P,S,Q",
                   help="synthetic shared-prefix: G groups of P prompts, a system prompt of S tokens shared "
                        "within a group, a question of Q tokens (outputs: --output-len; hits need --kv-policy "
                        "paged --enable-prefix-caching)")
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
        help="synthetic: fixed:N, uniform:LO,HI, lognormal:MEDIAN,SIGMA, trace or trace:PATH",
    )
    w.add_argument("--output-len", default=None, metavar="DIST",
                   help="synthetic: as --prompt-len (with --synthetic shared-prefix: the outputs)")
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


def _add_hardware_args(m: Any, lists: bool = False) -> None:
    """The model-and-hardware options (an argparse argument group); `lists`: --gpu and --tp take lists."""
    m.add_argument("--model", default=DEFAULTS["model"])
    if lists:
        m.add_argument("--gpu", default=DEFAULTS["gpu"], metavar="LIST",
                       help=f"GPU presets to search, comma-separated (default {DEFAULTS['gpu']})")
        m.add_argument("--tp", type=int_list, default=[DEFAULTS["tp"]], metavar="LIST",
                       help=f"tensor-parallel GPUs per replica to search, comma-separated (default {DEFAULTS['tp']})")
    else:
        m.add_argument("--gpu", default=DEFAULTS["gpu"])
        m.add_argument("--tp", type=positive_int, default=DEFAULTS["tp"], help="tensor-parallel GPUs")
    m.add_argument("--dtype", default=DEFAULTS["dtype"], help="weight dtype")
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
    return WorkloadOptions(
        trace=args.trace,
        trace_format=args.trace_format,
        skip_bad_rows=args.skip_bad_rows,
        synthetic=args.synthetic,
        seed=args.seed,
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
    drawn lengths; stallfree.sim.setup). --num-requests is not one of them: it cuts a trace too.

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
                   "synthetic arrivals: add --synthetic poisson, gamma, shared-prefix or sessions"),
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
    }
    for flag, (value, used, where) in read.items():
        if value is not None and not used:
            why = "" if synthetic else (" (a trace replay has its own "
                                        f"{'arrivals' if flag in ('--rate', '--burstiness') else 'lengths'})")
            raise CliError(f"{flag} applies to {where}, or drop {flag}{why}", 2)


def hardware_options(args: argparse.Namespace) -> HardwareOptions:
    """The hardware options of a parsed command line."""
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
        CliError: contradictory partial-prefill options (check_partial_prefill_flags), or a synthetic-load
            option without the mode that reads it (check_synthetic_flags).
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
    return Setup(workload_options(args), hardware_options(args), options,
                 kv_offloading_gib=args.kv_offloading_size, async_scheduling=args.async_scheduling,
                 lora_rank=args.lora_rank or DEFAULT_LORA_RANK, max_cpu_loras=args.max_cpu_loras)


#: The exit status of a run that served no request (every one rejected or refused): the figures describe nothing.
EXIT_SERVED_NOTHING = 4


def served_nothing(command: str, rows: list[dict[str, Any]]) -> int | None:
    """EXIT_SERVED_NOTHING, with one line on stderr saying why, when no run of `rows` (summaries or sweep rows)
    completed a request; None when any did. The report has been printed by then: its rejection lines name
    the reasons (over the context length, never fits the KV cache)."""
    if not rows or any(r.get("completed") for r in rows):
        return None
    rejected = sum(int(r.get("rejected") or 0) for r in rows)
    why = f" ({rejected:,} requests rejected: see the lines above)" if rejected else ""
    print(f"stallfree {command}: error: no run served any request{why}; nothing to report (exit "
          f"{EXIT_SERVED_NOTHING})", file=sys.stderr)
    return EXIT_SERVED_NOTHING


def rejection_warning(label: str, num_requests: int, by_reason: dict[str, int], first: str | None) -> str:
    """The one-line warning for rejected requests: how many, of how many, by reason, and the first reason."""
    total = sum(by_reason.values())
    reasons = ", ".join(f"{n:,} {_REASON_TEXT.get(k, k)}" for k, n in sorted(by_reason.items()))
    text = f"warning: {label}: rejected {total:,} of {num_requests:,} requests ({reasons})"
    return text + (f"; first: {first}" if first else "")


def warn_rejections(rows: list[dict[str, Any]], num_requests: int) -> None:
    """Print one warning line on stderr when any run of a sweep or a tune rejected requests."""
    hit = [r for r in rows if r.get("rejected")]
    if not hit:
        return
    first = hit[0]
    label = f"{len(hit)} of {len(rows)} runs rejected requests; the first, budget {first.get('token_budget'):,}"
    print(rejection_warning(label, num_requests, first.get("rejected_by_reason") or {}, None), file=sys.stderr)


_REASON_TEXT = {
    "context_length": "over the context length (context_length)",
    "kv_capacity": "never fit the KV cache (kv_capacity)",
}


def ensure_writable_dir(path: Path, flag: str) -> None:
    """Check that `path` can be created (with parents) and a file written in it, leaving nothing behind.

    The directories it makes for the check are removed again, so that a run which then fails, is
    interrupted (Ctrl-C) or is killed (SIGTERM) leaves no empty `path`: the writers create it when they
    write the first file.

    Raises:
        CliError: it is a file, or cannot be created or written (exit 1), naming the flag and the reason.
    """
    if path.exists() and not path.is_dir():
        raise CliError(f"{flag} {path}: exists and is not a directory", 2)
    made: list[Path] = []  # the missing directories, outermost first
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        made.insert(0, parent)
    try:
        for d in made:
            d.mkdir()
        probe = path / ".stallfree-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CliError(f"{flag} {path}: cannot write there ({exc.strerror or exc})", 2) from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass


def ensure_writable_file(path: Path, flag: str) -> None:
    """Check that `path` can be written: its directory exists and is writable, and it is not a directory.

    Raises:
        CliError: otherwise, naming the flag and the reason.
    """
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CliError(f"{flag} {path}: is a directory; give a file name (.csv or .json)", 2)
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: the directory {parent} does not exist", 2)
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"{flag} {path}: not writable", 2)


#: The files each command's --out DIR may write (shell patterns: a tag names the run).
OUT_FILES = {
    "simulate": ("summary.json", "requests-*.csv", "steps-*.csv", "cdf.png", "timeline.png", "autoscale.png"),
    "sweep": ("sweep.csv", "sweep.json", "tradeoff.png", "cdf.png", "kv_sweep.json", "kv_sweep.png",
              "cpu_tier_sweep.json", "cpu_tier_sweep.png"),
    "tune": ("tune.json", "tune.png"),
    "plan": ("plan.json", "plan.csv", "plan.png"),
}


def refuse_writing_the_trace(args: argparse.Namespace, path: Path, flag: str,
                             names: tuple[str, ...] | None = None) -> None:
    """Refuse an output path that would overwrite the --trace file, before anything runs.

    Args:
        path: the file an option writes (`names` None), or the directory it writes `names` in (shell
            patterns, as OUT_FILES).
        flag: the option, as the message names it.

    Raises:
        CliError: the file written (or one of `names` in the directory) is the --trace file, the same
            file by another path or link included (exit 2).
    """
    trace = getattr(args, "trace", None)
    if not trace or not Path(trace).is_file():
        return  # no trace file: the bundled trace, a name such as 'mooncake', or a missing file
    trace_path = Path(trace)

    def same(a: Path, b: Path) -> bool:
        try:
            return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
        except OSError:
            return False

    if names is None:
        hit = same(path, trace_path)
    else:
        hit = same(path, trace_path.parent) and any(fnmatch.fnmatchcase(trace_path.name, n) for n in names)
    if hit:
        where = "is the --trace file" if names is None else f"would overwrite the --trace file {trace}"
        raise CliError(f"{flag} {path}: {where}; give another path", 2)


def add_executor_flags(p: argparse.ArgumentParser) -> None:
    """Add --executor and --ray-address (sweep, tune)."""
    p.add_argument(
        "--executor", choices=EXECUTORS, default="process",
        help="where the simulations run: process (a pool of --jobs workers, the default), ray (one Ray task "
        "each) or serial (this process)",
    )
    p.add_argument(
        "--ray-address", metavar="ADDR",
        help="--executor ray: the cluster (HOST:PORT, ray://HOST:PORT or auto; default RAY_ADDRESS, else a "
        "local Ray instance)",
    )


def executor_from_args(args: argparse.Namespace) -> Executor:
    """The executor of --executor, --jobs and --ray-address.

    Raises:
        CliError: Ray missing, an address with another executor, or a Ray head that does not answer (exit 2).
    """
    try:
        return make_executor(args.executor, args.jobs or os.cpu_count() or 1, args.ray_address)
    except ExecutorError as exc:
        raise CliError(flag_message(exc), 2) from None


#: The flag of each option whose field name is not the flag's name with underscores (the others are
#: "--" + the field with dashes: `cpu_kv_tokens` is --cpu-kv-tokens).
_FIELD_FLAGS = {"kv_offloading_gib": "--kv-offloading-size", "kv_sizes": "--kv-tokens",
                "cpu_sizes": "--cpu-kv-tokens", "address": "--ray-address"}

#: A field named in a library message: `name`, or `name`=value ('quoted' or up to a blank or : ; ).
_FIELD_MENTION = re.compile(r"`(\w+)`(?:=('[^']*'|[^\s:;)]+))?")


def flag_words(message: str) -> str:
    """A library error's message worded in flags, as a user typed them. The simulator's library names
    each option by its field in backticks (stallfree.sim.setup.SetupError); each becomes its flag, and
    `field`=value becomes "--flag value" (`kv_policy`='paged' is "--kv-policy paged"). The rest of the
    text is kept, and a message without backticked fields comes back unchanged."""

    def flag(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        text = _FIELD_FLAGS.get(name) or (KNOBS[name].flag if name in KNOBS else "--" + name.replace("_", "-"))
        return text if value is None else f"{text} {value.strip(chr(39))}"

    return _FIELD_MENTION.sub(flag, message)


def flag_message(exc: BaseException) -> str:
    """flag_words of an exception's message."""
    return flag_words(str(exc))


def guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command so that expected errors become one line on stderr and an exit status."""

    def run(args: argparse.Namespace) -> int:
        prog = f"stallfree {args.command}"
        try:
            return int(func(args))
        except CliError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return exc.code
        except (TraceFileError, TraceError) as exc:  # a trace file missing, unreadable or malformed: input
            print(f"{prog}: error: {flag_message(exc)}", file=sys.stderr)
            return 2
        except SetupError as exc:
            print(f"{prog}: error: {flag_message(exc)}", file=sys.stderr)
            return 2 if exc.usage else 1
        except InvalidConfig as exc:  # a scheduler field out of range: the flags as typed
            print(f"{prog}: error: {flag_text(str(exc))}", file=sys.stderr)
            return 2
        except (SimulationError, ValueError, OSError, ExecutorError) as exc:
            print(f"{prog}: error: {flag_message(exc)}", file=sys.stderr)
            return 1

    return run


def progress_bar() -> Any:
    """A transient rich progress bar on stderr ("simulating", bar, done/total, elapsed); off when stderr
    is not a terminal, where the bar could not be erased and would leave a blank line before whatever
    the command prints next (an error, the report)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )


#: Seconds a command runs before its progress line appears: shorter runs print nothing extra.
PROGRESS_DELAY_S = 10.0


class ProgressLine:
    """A one-line status on stderr for a long run ("simulating: <phase>, 12 s"): it appears once the run
    has taken `delay` seconds, is redrawn every `interval` seconds from a background thread and is
    erased when the block ends, so the report that follows starts on a clean line. Nothing is written
    when the stream is not a terminal (a pipe, a file, a test's capture), so redirected output and
    --json are the same with or without it.

    Args:
        what: the first word of the line.
        delay: seconds before the line first appears (PROGRESS_DELAY_S by default).
        interval: seconds between redraws.
        stream: where to draw (sys.stderr, read when the block starts, by default).
    """

    def __init__(self, what: str = "simulating", delay: float | None = None, interval: float = 1.0,
                 stream: Any = None) -> None:
        import threading

        self.what, self.interval, self._phase = what, interval, ""
        self.delay = PROGRESS_DELAY_S if delay is None else delay
        self._stream, self._stop = stream, threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._drawn = False
        self._start = 0.0

    def phase(self, text: str) -> None:
        """Name what the run is doing now; the next redraw shows it."""
        self._phase = text

    @property
    def current(self) -> str:
        """The phase named last ("" before any)."""
        return self._phase

    def __enter__(self) -> ProgressLine:
        import threading
        import time

        if self._stream is None:
            self._stream = sys.stderr
        isatty = getattr(self._stream, "isatty", None)
        if callable(isatty) and isatty():
            self._start = time.monotonic()
            if self.delay <= 0:
                self._draw()
            self._thread = threading.Thread(target=self._draw_loop, name="stallfree-progress", daemon=True)
            self._thread.start()
        return self

    def _draw(self) -> None:
        """Draw the line once (unless the block has ended)."""
        import time

        elapsed = time.monotonic() - self._start
        text = f"{self.what}: {self._phase}, {elapsed:.0f} s" if self._phase else f"{self.what}, {elapsed:.0f} s"
        with self._lock:
            if self._stop.is_set():
                return
            # "\r" back to the line's start, "\x1b[K" erases what a longer line left.
            self._stream.write(f"\r{text}\x1b[K")
            self._stream.flush()
            self._drawn = True

    def _draw_loop(self) -> None:
        # With no delay the first line is drawn by __enter__ itself, so it is there however short the run.
        if self.delay > 0:
            if self._stop.wait(self.delay):
                return
            self._draw()
        while not self._stop.wait(self.interval):
            self._draw()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._drawn:
                self._stream.write("\r\x1b[K")
                self._stream.flush()
                self._drawn = False
