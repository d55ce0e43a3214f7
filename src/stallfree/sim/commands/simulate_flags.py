"""The flags of `stallfree simulate` beyond the shared ones (KV, batching, load, cluster and disaggregation)
and the checks of their combinations, each refused in one line before anything runs.

Imports allowed: the standard library, stallfree._argtypes, stallfree.flags and stallfree.sim.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from stallfree._argtypes import int_between, positive_int, token_count_list
from stallfree.core.config import SchedulerConfig
from stallfree.flags import add_scheduler_flags, given
from stallfree.sim.commands import autoscale as autoscale_cli
from stallfree.sim.commands.common import (
    CliError,
    positive_duration,
    think_time,
)
from stallfree.sim.commands.setup_args import (
    check_partial_prefill_flags,
    check_synthetic_flags,
)
from stallfree.sim.defaults import (
    BATCHING_MODES,
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_AFFINITY_LOAD_MARGIN,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DECODE_BUDGETS,
    DEFAULT_PREFILL_BUDGETS,
    DEFAULT_PREFIX_THRESHOLD,
    DEFAULT_ROUTER_SEED,
    DEFAULT_SESSION_LOAD_FACTOR,
    DEFAULT_SESSION_LOAD_MARGIN,
    DEFAULT_TOKEN_BUDGET,
    REPLICA_LIMIT,
    ROUTERS,
    SEARCH_REPLICA_LIMIT,
    TIME_BUDGET_CAP,
)
from stallfree.sim.run.disagg_link import DEFAULT_INTERCONNECT, INTERCONNECTS


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
    g.add_argument(
        "--no-records", dest="keep_records", action="store_false",
        help="keep no per-step or per-request records: the summary is built as the run goes, in memory that "
        "grows with the requests in flight (for runs of millions of requests); percentiles within 0.1%% "
        "(a quantile sketch), no overload analysis (docs/simulator.md, \"Runs without records\")",
    )


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
    if not args.keep_records:
        _check_no_records(args)


def _check_no_records(args: argparse.Namespace) -> None:
    """--no-records: refuse what reads the records it does not keep (usage errors, exit 2)."""
    clashes = [
        ("--records", args.records is not None), ("--out", args.out is not None), ("--check", args.check),
        ("--compare", args.compare), ("--compare-caching", args.compare_caching),
        ("--batching", args.batching != "chunked"), ("--step-time-target", args.step_time_target is not None),
        ("--disaggregate", args.disaggregate is not None), ("--autoscale", args.autoscale is not None),
        ("--concurrency", args.concurrency is not None), ("--max-loras", args.max_loras is not None),
        ("--synthetic sessions", args.synthetic == "sessions"),
    ]
    for flag, given_ in clashes:
        if given_:
            raise CliError(f"--no-records keeps no records, and {flag} reads or writes them: drop one of them", 2)


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


def _check_disaggregate_value(value: str | None) -> None:
    """Refuse a --disaggregate that is neither P:D nor search, or a P:D of more than REPLICA_LIMIT replicas,
    before any check of the flags it goes with (a misspelt value is named as such, not taken for a P:D that
    wants other flags dropped)."""
    if value is None or value == "search":
        return
    from stallfree.sim.run.disagg import parse_disaggregate
    from stallfree.sim.run.result import ClusterError

    try:
        p, d = parse_disaggregate(value)
    except ClusterError:
        raise CliError(f"--disaggregate wants P:D with P, D >= 1 replicas, or search; got {value!r}", 2) from None
    if p + d > REPLICA_LIMIT:
        raise CliError(f"--disaggregate {value}: P + D is {p + d:,} replicas, more than the {REPLICA_LIMIT:,} "
                       "allowed", 2)


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse, before anything runs or is written, values out of range and flags of another mode
    given explicitly (usage errors, exit 2: a flag that would be ignored is never silent)."""
    _check_disaggregate_value(args.disaggregate)
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
    most = args.autoscale_range[1] if args.autoscale is not None else args.replicas
    if args.router is not None and most == 1 and not disagg and not args.compare:
        # Every request goes to the one replica whichever router is named, so the flag would change
        # nothing but the run's label (--compare's own refusal below names --router too).
        runs = ("--replicas 1 runs one replica: add --replicas N (N >= 2)" if args.autoscale is None else
                f"--autoscale {args.autoscale} runs at most one replica: raise its MAX")
        raise CliError(f"--router {args.router}: a router chooses between replicas and {runs} or drop --router", 2)
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
    if args.max_num_partial_prefills != 1 and args.batching != "chunked" and not args.compare:
        raise CliError(f"--max-num-partial-prefills applies to chunked batching (a prompt prefilled in chunks); "
                       f"--batching {args.batching} prefills whole prompts: drop one of them", 2)
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
    if search and args.replicas > SEARCH_REPLICA_LIMIT:
        raise CliError(f"--replicas {args.replicas}: --disaggregate search simulates every P:D split of the replicas "
                       f"over a grid of budgets, so it takes at most {SEARCH_REPLICA_LIMIT} replicas (`stallfree plan` "
                       "searches larger fleets)", 2)
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
    c.add_argument("--replicas", type=int_between(1, REPLICA_LIMIT), default=1,
                   help=f"replicas behind the router (default 1, at most {REPLICA_LIMIT:,})")
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


def _is_cluster(args: argparse.Namespace) -> bool:
    return args.replicas > 1 or args.router is not None or args.autoscale is not None
