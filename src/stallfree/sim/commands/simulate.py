"""`stallfree simulate`: one run (or every batching mode with --compare) of a workload through the
scheduler; prints the header, the table and any warnings, and writes the files asked for.

Imports allowed: the standard library, stallfree._argtypes and stallfree.sim; rich lazily.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from stallfree._argtypes import positive_int, token_count_list
from stallfree.core.config import SchedulerConfig
from stallfree.flags import add_scheduler_flags, given
from stallfree.sim.cluster import (
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_AFFINITY_LOAD_MARGIN,
    DEFAULT_PREFIX_THRESHOLD,
    DEFAULT_ROUTER_SEED,
    ROUTERS,
    make_router,
    run_cluster_study,
)
from stallfree.sim.commands import autoscale as autoscale_cli
from stallfree.sim.commands.common import (
    OUT_FILES,
    CliError,
    ProgressLine,
    add_common,
    check_partial_prefill_flags,
    check_synthetic_flags,
    ensure_writable_dir,
    ensure_writable_file,
    flag_message,
    guard,
    positive_duration,
    refuse_writing_the_trace,
    rejection_warning,
    served_nothing,
    setup_from_args,
    think_time,
)
from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_TOKEN_BUDGET
from stallfree.sim.disagg import (
    DEFAULT_DECODE_BUDGETS,
    DEFAULT_INTERCONNECT,
    DEFAULT_PREFILL_BUDGETS,
    INTERCONNECTS,
    Interconnect,
    parse_disaggregate,
    run_disagg_experiment,
    search_plan,
    sides_behaviour,
)
from stallfree.sim.experiment import Experiment, run_experiment, run_tag
from stallfree.sim.report import print_table
from stallfree.sim.result import ClusterError
from stallfree.sim.routers import DEFAULT_ADAPTER_SLOTS, DEFAULT_SESSION_LOAD_FACTOR, DEFAULT_SESSION_LOAD_MARGIN
from stallfree.sim.sessions import SessionWorkload
from stallfree.sim.setup import TIME_BUDGET_CAP
from stallfree.sim.simulator import BATCHING_MODES
from stallfree.sim.writers import write_disagg_out, write_disagg_records, write_experiment, write_records

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the `simulate` subcommand."""
    sim = subparsers.add_parser(
        "simulate",
        help="replay a trace through the scheduler and report TTFT, TPOT, ITL, goodput",
        description="Replay a workload through the scheduler, timing each step with the cost model. "
        "With no arguments: the bundled Azure conversation trace on Llama 3.3 70B, 4 x H100 SXM, FP8.",
    )
    add_common(sim)
    _add_batching_flags(sim.add_argument_group("batching"))
    _add_load_flags(sim)
    sim.set_defaults(closed_loop_flags=True)
    _add_cluster_flags(sim)
    autoscale_cli.add_flags(sim)
    sim.set_defaults(func=guard(run))


def _add_kv_flags(g: Any) -> None:
    """The KV flags of `simulate` (an argparse argument group): the KV policy, its blocks and
    watermark, prefix caching and the CPU KV tier."""
    add_scheduler_flags(
        g, {"kv_policy": None, "block_size": None, "watermark": None,
            "enable_prefix_caching": None, "cpu_kv_tokens": None, "kv_offloading_size": None},
        why={"kv_policy": "default: the pricing engine's (vLLM, SGLang: paged; TensorRT-LLM: reserve); reserve, "
                          "the contract, under --kernels none",
             "block_size": f"paged; default {DEFAULT_BLOCK_SIZE}",
             "watermark": f"default: the pricing engine's (vLLM: 0), else {SchedulerConfig.watermark:g}",
             "enable_prefix_caching": "default: on where the pricing engine pages and caches (vLLM, SGLang), "
                                      "else off; hits need a trace with prefix ids: --trace mooncake or a "
                                      "Mooncake JSONL"})
    g.add_argument(
        "--compare-caching",
        action="store_true",
        help="paged: run with prefix caching off and on, side by side; with a CPU KV tier, the GPU-only "
        "cache against the two tiers",
    )


def _add_batching_flags(g: Any) -> None:
    """The batching, KV and run-mode flags of `simulate` (an argparse argument group; the KV ones
    are _add_kv_flags')."""
    g.add_argument(
        "--batching",
        choices=BATCHING_MODES,
        default="chunked",
        help="chunked (the contract), prefill-first or no-chunk (baselines)",
    )
    add_scheduler_flags(g, {"token_budget": None}, why={
        "token_budget": f"default {DEFAULT_TOKEN_BUDGET:,}, a GPU's; with --step-time-target, the cap of each "
        f"step's budget, default {TIME_BUDGET_CAP:,}"})
    g.add_argument(
        "--step-time-target",
        type=positive_duration,
        metavar="T",
        help="time budget mode: each step takes the most tokens whose predicted time stays under T "
        "(50ms; bare = ms), given the running decodes' context lengths",
    )
    g.add_argument(
        "--max-queue-time",
        type=positive_duration,
        metavar="T",
        help="chunked batching: shed a request still waiting T after its arrival (bare = ms; reason timeout, "
        "no token; by_tenant's shed, in no latency figure). Default: no limit",
    )
    _add_kv_flags(g)
    g.add_argument("--compare", action="store_true", help="run all three batching modes side by side")
    g.add_argument("--check", action="store_true", help="check the scheduler's invariants after every step")
    g.add_argument(
        "--no-range", dest="range", action="store_false",
        help="leave out the range of each latency (by default two more replays, every step scaled to the "
        "10th and 90th percentile of the measured step-time error: docs/simulator.md, \"Ranges\")",
    )
    g.add_argument("--records", type=Path, metavar="FILE", help="per-request records to FILE (.csv or .json)")


def _has_cpu_tier(args: argparse.Namespace) -> bool:
    """Whether the command line asks for a CPU KV tier (--cpu-kv-tokens or --kv-offloading-size)."""
    return args.cpu_kv_tokens is not None or args.kv_offloading_size is not None


def _check_mode_flags(args: argparse.Namespace) -> None:
    """Refuse run-mode and KV flags of `simulate` that contradict each other, before anything loads.

    Raises:
        CliError: --compare with --batching, caching or a CPU KV tier without what it needs, two sizes
            of the CPU tier, a CPU tier with --step-time-target, or a bad --kv-offloading-size (exit 2).
    """
    if args.compare and args.batching != "chunked":
        raise CliError("--compare runs every batching mode: drop --batching", 2)
    if args.step_time_target is not None and (args.compare or args.batching != "chunked"):
        raise CliError("--step-time-target drives the chunked scheduler: drop --compare and --batching", 2)
    # A KV policy left open is the pricing engine's (Setup resolves it; _check_resolved refuses what then
    # does not go together): only the one typed is checked here.
    if (args.enable_prefix_caching or args.compare_caching) and args.kv_policy == "reserve":
        flag = given(args, "enable_prefix_caching") if args.enable_prefix_caching else "--compare-caching"
        raise CliError(f"{flag} needs --kv-policy paged (cached blocks are paged KV blocks)", 2)
    if args.kv_policy == "reserve":
        typed = [n for n in (given(args, "block_size"), given(args, "watermark")) if n]
        if typed:
            raise CliError(f"{' and '.join(typed)} {'apply' if len(typed) > 1 else 'applies'} to --kv-policy paged", 2)
    if args.compare_caching and args.compare:
        raise CliError("--compare-caching and --compare are exclusive", 2)
    tier = _has_cpu_tier(args)
    caching_off = args.enable_prefix_caching is False or (args.enable_prefix_caching is None
                                                         and args.kv_policy == "reserve")
    if tier and caching_off and not args.compare_caching:
        flag = "--cpu-kv-tokens" if args.cpu_kv_tokens is not None else "--kv-offloading-size"
        raise CliError(f"{flag}: a CPU KV tier keeps prefix-cache blocks: add --enable-prefix-caching (or "
                       "--compare-caching) and --kv-policy paged", 2)
    if args.cpu_kv_tokens is not None and args.kv_offloading_size is not None:
        raise CliError("--cpu-kv-tokens and --kv-offloading-size both size the CPU KV tier: give one", 2)
    if tier and args.step_time_target is not None:
        raise CliError("a CPU KV tier runs with a token budget: drop --step-time-target", 2)
    if args.kv_offloading_size is not None and not 0 < args.kv_offloading_size < math.inf:
        raise CliError(f"--kv-offloading-size {args.kv_offloading_size:g}: must be a number of GiB > 0", 2)


def _check_resolved(args: argparse.Namespace, setup: Any) -> None:
    """Refuse paged-only flags typed for a run that, by the pricing engine's default, reserves its KV.

    Raises:
        CliError: --block-size or --watermark typed and the run does not page (exit 2).
    """
    typed = [n for n in (given(args, "block_size"), given(args, "watermark")) if n]
    if typed and not setup.paged:
        raise CliError(f"{' and '.join(typed)} apply to --kv-policy paged (this run reserves its KV: "
                       f"{setup.behaviour()}): add --kv-policy paged", 2)
    if args.step_time_target is not None and setup.async_scheduling:
        # A time budget per step plans each step from the step before it: not modelled with the step
        # planned ahead. Typed, refused; the engine's default is left out, and said.
        if given(args, "async_scheduling"):
            raise CliError("--async-scheduling is not modelled with --step-time-target: drop one of them", 2)
        why = setup.engine_behaviour.pop("async_scheduling", {}).get("source", "")
        setup.async_scheduling = False
        print(f"note: asynchronous scheduling ({why}) is not modelled with --step-time-target: the run schedules "
              "synchronously", file=sys.stderr)


def _study(args: argparse.Namespace, setup: Any, capacity: bool = True,
           progress: ProgressLine | None = None) -> tuple[Experiment, list[Any]]:
    """The runs of `simulate` on `setup`: one study (_run_once), or with --compare-caching the
    caching-off (or GPU-only) runs followed by the caching-on (two-tier) runs of the same replicas
    (capacity: as run_experiment's; progress: the line that names the phase, if any)."""
    on_setup = setup
    what = progress.current if progress is not None else ""
    if args.compare_caching:
        setup.check_prefix_block()  # before the caching-off run, not after it
        # The GPU-only run first with a CPU tier (the copies' pricing has nothing to price there),
        # else caching off.
        off = {"cpu_kv_tokens": 0} if _has_cpu_tier(args) else {"enable_prefix_caching": False}
        setup = setup.with_scheduler(**off)
        if progress is not None:
            progress.phase(f"{what}, caching off (1 of 2)")
    study, clusters = _run_once(args, setup, capacity)
    if args.compare_caching:
        if progress is not None:
            progress.phase(f"{what}, caching on (2 of 2)")
        # The same replicas and router as the caching-off run: only the cache differs.
        on, on_clusters = _run_once(args, on_setup, capacity)
        study.results.extend(on.results)
        study.summaries.extend(on.summaries)
        clusters.extend(on_clusters)
    return study, clusters


def _report(args: argparse.Namespace, study: Experiment, explained: list[str], verdict: dict[str, Any] | None) -> None:
    """Print a study: JSON or the header and table (and the verdict) on stdout; one line per run
    with rejections and the overload notes on stderr; with --check, that the invariants held."""
    if args.json:
        print(json.dumps({"header": study.header, "runs": study.summaries}
                         | ({"verdict": verdict} if verdict else {}), indent=1))
    else:
        print_header(study.header, study.summaries)
        print_table(study.summaries)
        if verdict:
            print(verdict["line"])
        if "static" in study.summaries[0]:
            autoscale_cli.print_lines(study.summaries[0])
    # Rejections are not an error, but never silent: one line per run on stderr, in every mode.
    for res in study.results:
        if res.rejected:
            line = rejection_warning(res.label, res.num_requests, res.rejected_by_reason, res.rejected[0][1])
            print(line, file=sys.stderr)
    for line in explained:
        print(line, file=sys.stderr)
    if not args.json:
        for res in study.results:
            if args.check and res.config.get("batching", "chunked") == "chunked":
                print(f"{res.label}: every scheduler invariant held after each of {res.num_steps:,} steps")


def run(args: argparse.Namespace) -> int:
    """Run `stallfree simulate` on parsed arguments; returns the exit status."""
    _check_mode_flags(args)
    _check_flags(args)
    # Before the simulation, not after it: a bad output path fails at once.
    if args.out:
        refuse_writing_the_trace(args, args.out, "--out", OUT_FILES["simulate"])
        ensure_writable_dir(args.out, "--out")
    if args.records:
        refuse_writing_the_trace(args, args.records, "--records")
        ensure_writable_file(args.records, "--records")
    caching = bool(given(args, "enable_prefix_caching") and args.enable_prefix_caching) or args.compare_caching
    if args.compare_caching:
        args.enable_prefix_caching = True  # the caching-on run's setup; _study makes the other one
    if (args.compare or args.batching != "chunked") and args.kv_policy is None:
        # The baselines reserve KV and cache nothing: a comparison of batching modes runs every mode so,
        # rather than the pricing engine's paged, caching default for chunked batching alone.
        args.kv_policy = "reserve"
        if args.enable_prefix_caching is None:
            args.enable_prefix_caching = False
    setup = setup_from_args(args)
    _check_resolved(args, setup)
    if args.max_queue_time is not None:
        if args.compare or args.batching != "chunked" or args.step_time_target is not None:
            raise CliError("--max-queue-time applies to chunked batching without --compare or --step-time-target", 2)
        setup.max_queue_time_s = args.max_queue_time
    sessions = isinstance(setup.workload, SessionWorkload)
    if caching and setup.workload.prefix_ids is None and not sessions:
        flag = "--compare-caching" if args.compare_caching else given(args, "enable_prefix_caching")
        print(f"note: {flag}: {setup.workload.name} has no prompt block hashes (prefix ids), so nothing can hit "
              "the cache (--trace mooncake or a Mooncake JSONL has them)", file=sys.stderr)
    if args.disaggregate is not None and sessions:
        raise CliError("--disaggregate does not model sessions in this version (a turn's history would move "
                       "between the prefill and the decode side): drop --disaggregate, or replay the turns as "
                       "single requests", 2)
    if args.disaggregate is not None:
        # Typed, it is refused; the pricing engine's default is left out on both sides, and said.
        if given(args, "async_scheduling") and args.async_scheduling:
            raise CliError("--async-scheduling is not modelled with --disaggregate: drop one of them", 2)
        return _run_disagg(args, setup)
    # A line on stderr while a long run goes on (a terminal only: redirected output is unchanged).
    with ProgressLine() as progress:
        progress.phase(f"replaying {setup.workload.name}")
        study, clusters = _study(args, setup, progress=progress)
        if args.autoscale is not None:
            progress.phase(f"replaying {setup.workload.name} on the static fleet")
            _add_static(args, setup, study, clusters)
        if args.range:
            _add_ranges(args, setup, study, progress)
    from stallfree.sim.overload import annotate

    explained = annotate(study.results, study.summaries, study.header, args.replicas)
    verdict = _verdict(args, study)
    _report(args, study, explained, verdict)
    if args.records:
        for res, cluster in zip(study.results, clusters, strict=True):
            path = args.records if len(study.results) == 1 else _suffixed(args.records, run_tag(res))
            write_records(res, path, cluster.routed if cluster is not None else None)
    if args.out:
        _write_out(args.out, study, clusters, quiet_stdout=args.json)
    return served_nothing("simulate", study.summaries) or 0


def _verdict(args: argparse.Namespace, study: Experiment) -> dict[str, Any] | None:
    """--compare and --compare-caching: the verdict (sim/verdict.py) of each run against the first."""
    from stallfree.sim.verdict import compare_verdict

    if not (args.compare or args.compare_caching) or len(study.results) < 2:
        return None
    what = "prefix caching" if args.compare_caching else "chunked prefill against the baselines"
    line, figures = compare_verdict(study.results, [s["label"] for s in study.summaries], what)
    return {"line": line, "figures": figures}
def _add_ranges(args: argparse.Namespace, setup: Any, study: Experiment, progress: ProgressLine | None = None) -> None:
    """Give each run of the study its "range" (stallfree.sim.ranges): the same study replayed with every
    step scaled to the error model's low and high factor (no capacity measured), and the error model
    in the header."""
    import copy

    from stallfree.sim.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, error_model, run_range

    quiet = copy.copy(args)
    quiet.check = False  # the run itself was checked; its scaled replays run the same scheduler
    scaled = []
    for k, factor in enumerate((STEP_TIME_LOW, STEP_TIME_HIGH), 1):
        if progress is not None:
            progress.phase(f"the range, every step x{factor:.3f} ({k} of 2)")
        other = copy.copy(setup)
        other.cost_model = ScaledCost(setup.cost_model, factor)
        scaled.append(_study(quiet, other, capacity=False, progress=progress)[0].summaries)
    for i, summary in enumerate(study.summaries):
        summary["range"] = run_range(summary, [runs[i] for runs in scaled])
    study.header["range_model"] = error_model()


def _run_once(args: argparse.Namespace, setup: Any, capacity: bool = True) -> tuple[Experiment, list[Any]]:
    """The study of the setup as it stands (one replica or the cluster), and per result its
    ClusterResult (None for a single replica). A run with prefix caching is marked
    config["prefix_caching"], which gives its files the "-cache" tag."""
    clusters: list[Any]
    if _is_cluster(args):
        study, cluster = _run_cluster(args, setup, capacity)
        clusters = [cluster]
    else:
        study = run_experiment(
            setup,
            batching=list(BATCHING_MODES) if args.compare else args.batching,
            budget=args.token_budget,
            step_time_target=args.step_time_target,
            check=args.check,
            slo_ttft=args.slo_ttft,
            slo_tpot=args.slo_tpot,
            capacity=capacity,
        )
        clusters = [None] * len(study.results)
    if setup.prefix_caching:
        for res, summary in zip(study.results, study.summaries, strict=True):
            res.config["prefix_caching"] = summary["prefix_caching"] = True
    if setup.cpu_kv_tokens:
        for summary in study.summaries:
            summary["cpu_kv_tokens"] = setup.cpu_kv_tokens
    return study, clusters


#: Flags of --disaggregate P:D alone.
_DISAGG_FLAGS = (
    ("--prefill-tp", "prefill_tp"), ("--decode-tp", "decode_tp"), ("--interconnect", "interconnect"),
    ("--prefill-budget", "prefill_budget"), ("--decode-budget", "decode_budget"),
    ("--link-bandwidth", "link_bandwidth"), ("--link-latency", "link_latency"),
)
#: Flags of --router prefix-affinity alone.
_AFFINITY_FLAGS = (
    ("--prefix-affinity-threshold", "prefix_affinity_threshold", 0),
    ("--affinity-load-factor", "affinity_load_factor", 1),
    ("--affinity-load-margin", "affinity_load_margin", 0),
)


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse, before anything runs or is written, values out of range and flags of another mode
    given explicitly (usage errors, exit 2: a flag that would be ignored is never silent)."""
    autoscale_cli.check_flags(args)
    check_partial_prefill_flags(args)
    check_synthetic_flags(args)
    sessions = args.synthetic == "sessions"
    if args.concurrency is None and args.think_time and not sessions:
        raise CliError("--think-time applies to closed-loop load or --synthetic sessions: add --concurrency N", 2)
    if args.concurrency is not None and not isinstance(args.think_time, float):
        raise CliError(f"--think-time {args.think_time}: closed-loop load takes one duration; a distribution "
                       "goes with --synthetic sessions", 2)
    if sessions and args.concurrency is not None:
        raise CliError("--concurrency does not apply to --synthetic sessions: each turn is sent after the last "
                       "one's answer and its think time", 2)
    if args.concurrency is not None and args.rate_scale is not None:
        raise CliError("--rate-scale scales open-loop arrivals; with --concurrency the arrivals follow the "
                       "finishes: drop --rate-scale", 2)
    for flag, name, low in _AFFINITY_FLAGS:
        value = getattr(args, name)
        if value is not None and not value >= low:
            raise CliError(f"{flag} {value:g}: must be >= {low}", 2)
    if args.link_bandwidth is not None and not 0 < args.link_bandwidth < math.inf:
        raise CliError(f"--link-bandwidth {args.link_bandwidth:g}: must be a number of GB/s > 0", 2)
    if args.link_latency is not None and not 0 <= args.link_latency < math.inf:
        raise CliError(f"--link-latency {args.link_latency:g}: must be a number of us >= 0", 2)
    disagg = args.disaggregate is not None
    if not disagg:
        for flag, name in _DISAGG_FLAGS:
            if getattr(args, name) is not None:
                raise CliError(f"{flag} applies to --disaggregate P:D (or search): add it or drop {flag}", 2)
    router = args.router or ("least-outstanding" if disagg or args.replicas > 1 else None)
    for flag, name, _ in _AFFINITY_FLAGS:
        # The load cap is session-affinity's and adapter-affinity's too; the cached-prefix threshold is
        # prefix-affinity's alone.
        takes = ("prefix-affinity",) if name == "prefix_affinity_threshold" else ("prefix-affinity", "session-affinity",
                                                                                 "adapter-affinity")
        if getattr(args, name) is not None and (router not in takes or disagg):
            where = "without --disaggregate" if disagg else f"(the router is {router or 'none: one replica'})"
            raise CliError(f"{flag} applies to --router {' or '.join(takes)} {where}: drop {flag}", 2)
    if args.max_loras is not None and (disagg or args.compare or args.batching != "chunked"):
        raise CliError("--max-loras (LoRA adapters) runs chunked batching on one or more replicas: drop "
                       "--disaggregate, --compare and --batching", 2)
    if args.router_seed is not None and router != "random":
        raise CliError(f"--router-seed applies to --router random (the router is {router or 'none: one replica'})"
                       ": drop --router-seed", 2)
    if args.compare and _is_cluster(args) and not disagg:
        raise CliError("--compare runs one replica: drop --replicas and --router", 2)
    if not disagg:
        return
    search = args.disaggregate == "search"
    if args.compare or (args.replicas > 1 and not search) or args.step_time_target is not None \
            or args.batching != "chunked":
        raise CliError("--disaggregate P:D sets the replicas and runs chunked batching: drop --compare, --replicas, "
                       "--batching and --step-time-target (--replicas N goes with --disaggregate search)", 2)
    if search and (args.records or args.out):
        raise CliError("--records and --out write one run: give --disaggregate P:D, not search", 2)
    unsupported = [
        ("--enable-prefix-caching", args.enable_prefix_caching), ("--compare-caching", args.compare_caching),
        ("--max-num-partial-prefills", args.max_num_partial_prefills != 1),
        ("--cpu-kv-tokens", args.cpu_kv_tokens is not None),
        ("--kv-offloading-size", args.kv_offloading_size is not None),
    ]
    for flag, asked in unsupported:
        if asked:
            raise CliError(f"--disaggregate does not take {flag} in this version: drop {flag}", 2)


def _add_load_flags(sim: Any) -> None:
    """--concurrency and --think-time: closed-loop load (docs/simulator.md)."""
    c = sim.add_argument_group("closed-loop load (default: open loop, the workload's arrival times)")
    c.add_argument(
        "--concurrency", type=positive_int, metavar="N",
        help="keep N requests in flight: the next (in workload order, with its lengths) is sent when one "
        "ends; arrival times are ignored. With --num-requests and --prompt-len/--output-len (fixed:N ...)",
    )
    c.add_argument(
        "--think-time", type=think_time, default=0.0, metavar="T",
        help="--concurrency: time from a request's end to its client's next request (100ms, 1s; bare = ms); "
        "--synthetic sessions: the think or tool time before each later turn, a duration or a distribution "
        "in seconds (fixed:S, uniform:LO,HI, exponential:MEAN, lognormal:MEDIAN,SIGMA)",
    )


def _add_cluster_flags(sim: Any) -> None:

    c = sim.add_argument_group("cluster (docs/cluster.md)")
    c.add_argument("--replicas", type=positive_int, default=1, help="replicas behind the router (default 1)")
    c.add_argument(
        "--router", default=None, metavar="NAME", choices=ROUTERS,
        help=f"{' | '.join(ROUTERS)} (default least-outstanding when --replicas > 1)",
    )
    c.add_argument("--router-seed", type=int, default=None,
                   help=f"random router: its seed (default {DEFAULT_ROUTER_SEED})")
    c.add_argument(
        "--prefix-affinity-threshold", type=int, default=None, metavar="TOKENS",
        help="prefix-affinity: cached-prefix tokens a replica needs to win a request "
        f"(default {DEFAULT_PREFIX_THRESHOLD})",
    )
    c.add_argument(
        "--affinity-load-factor", type=float, default=None, metavar="F",
        help="prefix-affinity, session-affinity: a replica wins on its cache only while its unfinished requests are <= "
        f"max(F x the least loaded's, that + --affinity-load-margin) (default {DEFAULT_AFFINITY_LOAD_FACTOR:g}; "
        f"session-affinity: a session leaves its replica past it, default {DEFAULT_SESSION_LOAD_FACTOR:g}; "
        "inf: no cap)",
    )
    c.add_argument(
        "--affinity-load-margin", type=int, default=None, metavar="N",
        help="prefix-affinity, session-affinity: the cap's absolute margin, requests "
        f"(default {DEFAULT_AFFINITY_LOAD_MARGIN}; session-affinity {DEFAULT_SESSION_LOAD_MARGIN})",
    )

    c.add_argument(
        "--disaggregate", metavar="P:D",
        help="P prefill replicas and D decode replicas (KV moved between); 'search' with --replicas N and an SLO: "
        "every P:D with P + D = N against N aggregated replicas, each over a small grid of token budgets "
        "(--max-num-batched-tokens N: that budget only), in goodput per GPU",
    )
    c.add_argument("--prefill-tp", type=positive_int, help="GPUs per prefill replica (default: --tp)")
    c.add_argument("--decode-tp", type=positive_int, help="GPUs per decode replica (default: --tp)")
    c.add_argument(
        "--interconnect", choices=sorted(INTERCONNECTS), default=None,
        help=f"the link KV crosses (default {DEFAULT_INTERCONNECT}: "
        f"{INTERCONNECTS[DEFAULT_INTERCONNECT].bandwidth_bytes_per_s / 1e9:g} GB/s, "
        f"{INTERCONNECTS[DEFAULT_INTERCONNECT].latency_s * 1e6:g} us per transfer)",
    )

    c.add_argument(
        "--prefill-budget", type=token_count_list, metavar="N[,N...]",
        help="prefill side's token budget per step (default: --max-num-batched-tokens); with --disaggregate "
        f"search, the grid searched (default {','.join(map(str, DEFAULT_PREFILL_BUDGETS))}; "
        "--max-num-batched-tokens N: N only)",
    )
    c.add_argument(
        "--decode-budget", type=token_count_list, metavar="N[,N...]",
        help="decode side's, as --prefill-budget (search default "
        f"{','.join(map(str, DEFAULT_DECODE_BUDGETS))})",
    )
    c.add_argument("--link-bandwidth", type=float, metavar="GB_PER_S", help="overrides the interconnect's GB/s")
    c.add_argument("--link-latency", type=float, metavar="US", help="overrides the interconnect's latency, us")


def _run_disagg(args: argparse.Namespace, setup: Any) -> int:
    search = args.disaggregate == "search"
    base = INTERCONNECTS[args.interconnect or DEFAULT_INTERCONNECT]
    link = Interconnect(
        base.name if args.link_bandwidth is None and args.link_latency is None else "custom",
        base.bandwidth_bytes_per_s if args.link_bandwidth is None else args.link_bandwidth * 1e9,
        base.latency_s if args.link_latency is None else args.link_latency * 1e-6,
    )
    if search:
        return _search(args, setup, link)
    try:
        p, d = parse_disaggregate(args.disaggregate)
    except ClusterError as exc:
        raise CliError(flag_message(exc), 2) from None
    side_budgets = []
    for flag, values in (("--prefill-budget", args.prefill_budget), ("--decode-budget", args.decode_budget)):
        if values is not None and len(values) > 1:
            raise CliError(f"{flag}: one budget for a P:D run, got {','.join(map(str, values))} "
                           "(a list goes with --disaggregate search)", 2)
        side_budgets.append(values[0] if values else None)
    header, summary, res = run_disagg_experiment(
        setup, prefill=p, decode=d, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, link=link,
        router=args.router or "least-outstanding", budget=args.token_budget, check=args.check,
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, prefill_budget=side_budgets[0],
        decode_budget=side_budgets[1],
    )
    if args.json:
        print(json.dumps({"header": header, "runs": [summary]}, indent=1))
    else:
        print(f"{header['workload']}: {header['requests']:,} requests; disaggregated {p} prefill x "
              f"{summary['prefill_tp']} GPUs, {d} decode x {summary['decode_tp']} GPUs ({summary['num_gpus']} GPUs)")
        print(f"KV moved over {link.name}: {link.bandwidth_bytes_per_s / 1e9:g} GB/s, {link.latency_s * 1e6:g} us "
              f"per transfer, {header['kv_bytes_per_token']:,} bytes per token")
        print(f"{header['hardware']}; {header['behaviour']}")
        print_table([summary])
    if res.rejected:
        print(rejection_warning(summary["label"], len(setup.workload), summary["rejected_by_reason"],
                                res.rejected[0][1]), file=sys.stderr)
    if args.records:
        write_disagg_records(res, setup.workload, args.records)
    if args.out:
        names = write_disagg_out(args.out, header, summary, res, setup.workload)
        print(f"wrote {args.out}/{', '.join(names)}", file=sys.stderr if args.json else sys.stdout)
    return served_nothing("simulate", [summary]) or 0


def _search(args: argparse.Namespace, setup: Any, link: Any) -> int:

    if args.prefill_tp is not None or args.decode_tp is not None:
        raise CliError("--disaggregate search splits replicas of --tp GPUs: drop --prefill-tp and --decode-tp", 2)
    fixed = (args.token_budget,) if args.token_budget is not None else None
    try:
        aggs, rows = search_plan(
            setup, args.replicas, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, link=link,
            router=args.router or "least-outstanding", aggregated_budgets=fixed,
            prefill_budgets=args.prefill_budget or fixed, decode_budgets=args.decode_budget or fixed,
        )
    except ClusterError as exc:
        raise CliError(flag_message(exc), 2) from None
    from stallfree.sim.verdict import disagg_verdict

    line, verdict = disagg_verdict(aggs[0], rows[0], len(setup.workload))
    sides, left = sides_behaviour(setup)
    if args.json:
        print(json.dumps({"header": setup.header() | {"offered_rate": None, "disaggregated_behaviour": sides,
                                                      "disaggregation_not_modelled": left},
                          "runs": [*aggs, *rows], "verdict": verdict | {"line": line}}, indent=1))
        return 0
    agg, best = aggs[0], rows[0]
    print(f"{setup.workload.name}: {len(setup.workload):,} requests on {agg['num_gpus']} GPUs; goodput per GPU "
          f"({len(aggs)} aggregated and {len(rows)} disaggregated configurations):")
    print(f"aggregated: {setup.behaviour()}; disaggregated, {sides}")
    for s in [*aggs, *rows]:
        print(f"  {s['label']:>30}: {s['goodput_per_gpu']:.3f} req/s/GPU (goodput {s['request_goodput'] or 0:.2f} "
              f"req/s, p99 TTFT {s.get('p99_ttft_ms') or 0:,.0f} ms, p99 TPOT {s.get('p99_tpot_ms') or 0:.1f} ms)")
    print(f"best aggregated: {agg['goodput_per_gpu']:.3f} req/s/GPU ({agg['label']}); best disaggregated: "
          f"{best['goodput_per_gpu']:.3f} req/s/GPU ({best['label']})")
    print_table([agg, best], title="best aggregated and best disaggregated")
    print(line)
    return 0


def _is_cluster(args: argparse.Namespace) -> bool:
    return args.replicas > 1 or args.router is not None or args.autoscale is not None


def _run_cluster(args: argparse.Namespace, setup: Any, capacity: bool = True) -> tuple[Experiment, Any]:

    name = args.router or "least-outstanding"

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        # A fresh router per run: round-robin and random keep state.
        router = make_router(
            name, given(args.router_seed, DEFAULT_ROUTER_SEED),
            given(args.prefix_affinity_threshold, DEFAULT_PREFIX_THRESHOLD),
            args.affinity_load_factor, args.affinity_load_margin,  # None: the router's own default
            given(args.max_loras, DEFAULT_ADAPTER_SLOTS),
        )
    except ClusterError as exc:
        raise CliError(f"--router: {exc}", 2) from None
    group, fleets, replicas = autoscale_cli.group(args, setup)
    study, cluster = run_cluster_study(
        setup, replicas=replicas, router=router, budget=args.token_budget, step_time_target=args.step_time_target,
        check=args.check, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, capacity=capacity, group=group,
    )
    if fleets:
        autoscale_cli.fleet_figures(args, setup, study.summaries[0], cluster, fleets[0])
    study.header["router"] = name
    study.summaries[0]["label"] = study.results[0].label = f"{study.results[0].label} {name}"
    study.summaries[0]["router"] = name
    study.results[0].config["router"] = name
    return study, cluster


def _suffixed(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.stem}-{tag}{path.suffix}")


def _budget_text(header: dict[str, Any]) -> str:
    if header.get("step_time_target_s") is None:
        return f"budget {header['token_budget']:,}"
    return f"step time target {header['step_time_target_s'] * 1e3:g} ms (budget cap {header['token_budget']:,})"


def _load_text(summary: dict[str, Any]) -> str:
    """The utilisation clause of the header, never 'nan%' nor 'inf req/s'."""
    capacity, load = summary.get("capacity_req_s"), summary.get("load")
    achieved = summary.get("achieved_request_rate")
    if achieved is not None:
        return f"achieved {achieved:,.2f} req/s; " + _load_text({k: v for k, v in summary.items()
                                                              if k != "achieved_request_rate"})
    if capacity is None:
        return "capacity unknown (no request was served)"
    if load is None:
        return f"every request arrives at once (capacity ~{capacity:,.1f} req/s when saturated)"
    return f"utilization {load:.0%} of capacity (~{capacity:,.1f} req/s when saturated)"


def print_header(header: dict[str, Any], summaries: list[dict[str, Any]]) -> None:
    """Print the workload, the replica, each run's utilisation and the workload's notes."""
    n = header["requests"]
    wl = f"{header['workload']}: {n:,} request{'s' if n != 1 else ''}"
    rate = header["offered_rate"]
    offered = f"{rate:,.2f} req/s offered" if rate is not None and math.isfinite(rate) else "all at one instant"
    scale = f"rate scale {header['rate_scale']:g} ({offered})"
    if header.get("sessions") is not None:
        srate = header["session_rate"]
        scale = (f"{header['sessions']:,} sessions" + (f" starting at {srate:,.3g}/s" if srate else "")
                 + ", each turn sent after the last one's answer")
    if header.get("concurrency") is not None:
        think = header["think_time_s"]
        scale = f"closed loop: {header['concurrency']} in flight"
        scale += f", think time {think * 1e3:g} ms" if think else ""
    print(f"{wl}, {scale}")
    print(
        f"{header['hardware']}; KV {header['kv_tokens']:,} tokens; max_seqs {header['max_seqs']}; "
        + _budget_text(header) + (f"; max_tokens {header['max_tokens']}" if header["max_tokens"] else "")
        + (f"; context {header['max_model_len']:,} tokens" if header.get("max_model_len") else "")
        + (f"; {header['behaviour']}" if header.get("behaviour") else "")
    )
    for s in summaries:
        print(
            f"{s['label']}: {_load_text(s)}; requests waiting after {s.get('queued_fraction') or 0:.0%} of steps"
            + (f"; {s['budget_utilization']:.0%} of the token budget used" if s.get("budget_utilization") else "")
        )
        if s.get("saturated"):
            from stallfree.sim.overload import saturation_line

            print(saturation_line(s["label"], s))
    for note in header["notes"]:
        print(f"note: {note}")


def _add_static(args: argparse.Namespace, setup: Any, study: Experiment, clusters: list[Any]) -> None:
    """--autoscale: the same trace on the static fleet of MAX replicas, beside the autoscaled run."""
    import copy

    def run_static() -> tuple[dict[str, Any], Any]:
        static = copy.copy(args)
        static.autoscale, static.replicas = None, args.autoscale_config.max_replicas
        if static.replicas == 1 and static.router is None:
            static.router = "least-outstanding"
        study, cluster = _run_cluster(static, setup, capacity=False)
        return study.summaries[0], cluster

    autoscale_cli.static_figures(args, setup, study.summaries[0], clusters[0], run_static)


def _write_out(out: Path, study: Experiment, clusters: list[Any], *, quiet_stdout: bool = False) -> None:
    names = write_experiment(out, study, clusters)
    if "static" in study.summaries[0]:
        names.append(autoscale_cli.write_plot(out, study.summaries[0]))
    print(f"wrote {out}/{', '.join(names)}", file=sys.stderr if quiet_stdout else sys.stdout)
