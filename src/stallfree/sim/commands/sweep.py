"""`stallfree sweep`: a grid of token budgets (and rate scales, batching modes) simulated in worker
processes; prints the table, and with --out writes the CSV, JSON and plots.

Imports allowed: the standard library, stallfree._argtypes and stallfree.sim; rich lazily.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stallfree._argtypes import (
    int_between,
    parse_token_count,
    partial_prefill_flag_problem,
    positive_float_list,
    token_count_list,
)
from stallfree.flags import add_scheduler_flags
from stallfree.sim.commands.common import (
    OUT_FILES,
    CliError,
    add_executor_flags,
    ensure_writable_dir,
    executor_from_args,
    flag_message,
    guard,
    modes,
    progress_bar,
    refuse_writing_the_trace,
    served_nothing,
    warn_rejections,
)
from stallfree.sim.commands.setup_args import add_common, setup_from_args
from stallfree.sim.defaults import BATCHING_MODES, DEFAULT_BLOCK_SIZE, DEFAULT_TOKEN_BUDGET, JOBS_LIMIT

# The simulator (the sweeps, their writers, the console) is imported inside the functions that run it, so
# that building the parser (any command's --help) does not import it.


def sweep(*args: Any, **kwargs: Any) -> Any:
    """stallfree.sim.studies.sweep.sweep, imported when a sweep starts (a name here, so that tests can
    replace it)."""
    from stallfree.sim.studies.sweep import sweep as run

    return run(*args, **kwargs)

__all__ = ["register", "run"]

#: The budgets a plain sweep simulates; a KV sweep runs one, KV_SWEEP_BUDGET unless --budgets says.
DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
KV_SWEEP_BUDGET = DEFAULT_TOKEN_BUDGET


def _sizes(text: str) -> list[int]:
    """A comma-separated list of token counts >= 0 (CPU tier sizes; 0: no tier), with vLLM's suffixes."""
    try:
        values = [parse_token_count(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 0, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def register(subparsers: Any) -> None:
    """Add the `sweep` subcommand."""
    p = subparsers.add_parser(
        "sweep",
        help="simulate a grid of token budgets (and rate scales, batching modes) in parallel",
        description="One simulation per (batching mode, rate scale, budget), in parallel processes; "
        "a table, and with --out a CSV and PNGs of p99 TPOT against p99 TTFT and of TTFT/TPOT CDFs.",
    )
    add_common(p)
    p.add_argument(
        "--budgets",
        type=token_count_list,
        metavar="LIST",
        help="token budgets to simulate (default 256,512,1024,2048,4096,8192; with a --kv-tokens list, "
        "one budget, default 2048)",
    )
    p.add_argument("--rate-scales", type=positive_float_list, metavar="LIST",
                   help="default: the --rate-scale default (with a --kv-tokens list, one value at most)")
    p.add_argument(
        "--batching",
        type=modes,
        metavar="LIST",
        help="comma-separated modes (default all three; with a --kv-tokens list, one, default chunked)",
    )
    p.add_argument("--jobs", type=int_between(1, JOBS_LIMIT), metavar="N", help="worker processes (default: CPUs)")
    p.add_argument("--range", action="store_true",
                   help="a range on each point's latencies: every point replayed twice more, each step at the "
                   "10th and 90th percentile of the measured step-time error (3x the work; docs/simulator.md, "
                   "\"Ranges\")")
    add_executor_flags(p)
    for action in p._actions:
        if action.dest == "kv_tokens":
            # Here a list: with more than one size, sweep KV capacity instead of budgets.
            action.type = token_count_list
            action.metavar = "LIST"
            action.help = ("KV capacity, tokens; a comma-separated list sweeps capacity (one run per size at "
                           "one --budgets value, default 2048, chunked batching) and plots TTFT, and with "
                           "--enable-prefix-caching the hit rate, against it")
    add_scheduler_flags(p, {"kv_policy": None, "enable_prefix_caching": None, "block_size": None},
                        why={"kv_policy": "default: the pricing engine's (vLLM: paged), reserve under --kernels none; "
                                          "paged with --enable-prefix-caching",
                             "enable_prefix_caching": "paged KV; default: on where the pricing engine caches "
                                                      "prefixes (vLLM); hits need a trace with prefix ids: --trace "
                                                      "mooncake",
                             "block_size": f"paged; default {DEFAULT_BLOCK_SIZE}"})
    p.add_argument("--cpu-kv-tokens", type=_sizes, metavar="LIST",
                   help="with --enable-prefix-caching: sweep the size of a CPU KV tier (tokens, 0 = none) at one KV "
                   "size, budget and rate scale; the table, and with --out cpu_tier_sweep.json and .png")
    p.set_defaults(func=guard(run))


def run(args: argparse.Namespace) -> int:
    """Run `stallfree sweep` on parsed arguments; returns the exit status."""
    from stallfree.sim.outputs.writers import write_sweep

    kv_list = args.kv_tokens
    for flag, values in (("--budgets", args.budgets), ("--rate-scales", args.rate_scales),
                         ("--batching", args.batching), ("--kv-tokens", kv_list)):
        if isinstance(values, list):
            twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
            if twice is not None:
                raise CliError(f"{flag} {_join(values)}: {twice} is given twice; give each value once", code=2)
    if isinstance(kv_list, list) and len(kv_list) > 1:
        for flag, values in (("--budgets", args.budgets), ("--rate-scales", args.rate_scales),
                             ("--batching", args.batching)):
            if values is not None and len(values) > 1:
                raise CliError(f"{flag} {_join(values)}: a --kv-tokens list sweeps KV capacity at one value; "
                               "give one", code=2)
    if args.enable_prefix_caching:
        args.kv_policy = "paged"
    paged = args.kv_policy == "paged"
    problem = partial_prefill_flag_problem(args.max_num_partial_prefills, args.max_long_partial_prefills,
                                           args.long_prefill_token_threshold, args.block_size if paged else None)
    if problem is not None:
        raise CliError(problem, code=2)
    if args.out:
        refuse_writing_the_trace(args, args.out, "--out", OUT_FILES["sweep"])
        ensure_writable_dir(args.out, "--out")
    if args.cpu_kv_tokens is not None:
        return _run_tier_sweep(args)
    if isinstance(kv_list, list) and len(kv_list) > 1:
        return _run_kv_sweep(args, kv_list)
    if args.budgets is None:
        args.budgets = list(DEFAULT_BUDGETS)
    if args.batching is None:
        # The baselines have no adapter limit: with LoRA adapters the sweep is chunked batching's alone.
        args.batching = ["chunked"] if args.max_loras is not None else list(BATCHING_MODES)
    elif args.max_loras is not None and args.batching != ["chunked"]:
        raise CliError("--max-loras (LoRA adapters) runs chunked batching only: drop --batching or give "
                       "--batching chunked", 2)
    args.kv_tokens = kv_list[0] if isinstance(kv_list, list) else kv_list
    setup = setup_from_args(args)
    with progress_bar() as bar:
        task = bar.add_task("sweep", total=None)
        result = sweep(
            setup,
            args.budgets,
            batching=args.batching,
            rate_scales=args.rate_scales,
            slo_ttft=args.slo_ttft,
            slo_tpot=args.slo_tpot,
            jobs=executor_from_args(args),
            progress=lambda k, n: bar.update(task, completed=k, total=n),
            ranges=args.range,
        )
    header = result.header
    if args.json:
        print(json.dumps({"header": header, "rows": result.table_rows}, indent=1))
    else:
        print(
            f"{header['workload']}: {header['requests']:,} requests; {header['hardware']}; "
            f"KV {header['kv_tokens']:,} tokens; max_seqs {header['max_seqs']}; {header['behaviour']}"
        )
        print_rows(result.table_rows)
    warn_rejections(result.table_rows, header["requests"])
    if args.out:
        names = write_sweep(args.out, result)
        print(f"wrote {args.out}/" + ", ".join(names), file=sys.stderr if args.json else sys.stdout)
    return served_nothing("sweep", result.table_rows) or 0


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    """Print the sweep's table (latencies in ms); a caption explains a "budget use" above 100%."""
    from rich.table import Table

    from stallfree.sim.outputs.table import console
    from stallfree.sim.outputs.wording import rate_text

    cols: tuple[tuple[str, str, str | Callable[[Any], str]], ...] = (
        ("batching", "batching", "{}"),
        ("rate_scale", "rate x", "{:g}"),
        ("token_budget", "budget", "{:,}"),
        ("request_throughput", "req/s", rate_text),  # two decimals, two significant digits at a light load
        ("request_goodput", "goodput", rate_text),
        ("median_ttft_ms", "TTFT p50", "{:,.0f}"),
        ("p99_ttft_ms", "TTFT p99", "{:,.0f}"),
        ("median_tpot_ms", "TPOT p50", "{:,.1f}"),
        ("p99_tpot_ms", "TPOT p99", "{:,.1f}"),
        ("p99_itl_ms", "ITL p99", "{:,.1f}"),
        ("budget_utilization", "budget use", "{:.0%}"),
        ("rejected", "rejected", "{:,}"),
    )
    over = any((row.get("budget_utilization") or 0) > 1 for row in rows)
    # Only prefill-first and no-chunk batching exceed the budget: they run a whole prompt in one step.
    caption = ("budget use: mean tokens per step / budget; above 100% where prefill-first or no-chunk "
               "runs a whole prompt longer than the budget in one step") if over else None
    table = Table(title="sweep (latencies in ms)", title_justify="left", caption=caption, caption_justify="left")
    for _, name, _ in cols:
        table.add_column(name, justify="left" if name == "batching" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*("-" if row.get(k) is None else _cell(spec, row[k]) + _span(row, k, spec)
                        for k, _, spec in cols))
    console().print(table)


def _cell(spec: str | Callable[[Any], str], value: Any) -> str:
    """A value by its column's format string, or by its function (rate_text)."""
    return spec(value) if callable(spec) else spec.format(value)


def _span(row: dict[str, Any], key: str, spec: str | Callable[[Any], str]) -> str:
    """" [low-high]" of a latency with --range, else ""."""
    span = (row.get("range") or {}).get(key)
    return f" [{_cell(spec, span[0])}-{_cell(spec, span[1])}]" if span else ""


def _run_tier_sweep(args: argparse.Namespace) -> int:
    """`sweep --enable-prefix-caching --cpu-kv-tokens LIST`: one run per CPU tier size, the rest fixed."""
    from stallfree.sim.inputs.options import SetupError
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.studies.tier_sweep import plot_tier_sweep, tier_sweep, tier_sweep_lines

    if not args.enable_prefix_caching:
        raise CliError("--cpu-kv-tokens sweeps a CPU tier of prefix-cache blocks: add --enable-prefix-caching",
                       code=2)
    if isinstance(args.kv_tokens, list) and len(args.kv_tokens) > 1:
        raise CliError("--cpu-kv-tokens sweeps the CPU tier at one --kv-tokens size: give one", code=2)
    for flag, values in (("--budgets", args.budgets), ("--rate-scales", args.rate_scales)):
        if values is not None and len(values) > 1:
            raise CliError(f"{flag} {_join(values)}: --cpu-kv-tokens sweeps at one value; give one", code=2)
    if any(v < 0 for v in args.cpu_kv_tokens):
        raise CliError(f"--cpu-kv-tokens {_join(args.cpu_kv_tokens)}: sizes must be >= 0 tokens", code=2)
    budget = args.budgets[0] if args.budgets else KV_SWEEP_BUDGET
    if args.rate_scales:
        args.rate_scale = args.rate_scales[0]
    if isinstance(args.kv_tokens, list):
        args.kv_tokens = args.kv_tokens[0]
    tiers, args.cpu_kv_tokens = args.cpu_kv_tokens, None
    base = _one_scale_setup(args)

    def make(cpu: int) -> Any:
        try:
            return Setup(base.workload_options, base.hardware_options,
                         {**base.scheduler_config.as_dict(), "cpu_kv_tokens": cpu})
        except SetupError as exc:
            raise CliError(flag_message(exc), 2) from None

    with progress_bar() as bar:
        task = bar.add_task("cpu tier sweep", total=len(tiers))
        rows = tier_sweep(make, tiers, budget,
                          progress=lambda k, n: bar.update(task, completed=k, total=n))
    title = (f"{base.workload.name}: {len(base.workload):,} requests, rate x{base.rate_scale:g}, budget {budget:,}, "
             f"GPU KV {base.kv_tokens:,} tokens, {base.block_size}-token blocks")
    if args.json:
        print(json.dumps({"token_budget": budget, "rows": rows}, indent=1))
    else:
        print("\n".join(tier_sweep_lines(rows, title)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu_tier_sweep.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        plot_tier_sweep(rows, args.out / "cpu_tier_sweep.png", title)
        print(f"wrote {args.out}/cpu_tier_sweep.json, cpu_tier_sweep.png", file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_kv_sweep(args: argparse.Namespace, sizes: list[int]) -> int:
    """`sweep --kv-tokens LIST`: one run per KV capacity at one budget, rate scale and batching mode;
    the table, and with --out kv_sweep.json and kv_sweep.png."""
    from stallfree.sim.outputs.writers import write_kv_sweep
    from stallfree.sim.studies.kv_sweep import kv_sweep, kv_sweep_lines, preemption_inflated

    budget = args.budgets[0] if args.budgets else KV_SWEEP_BUDGET
    batching = args.batching[0] if args.batching else "chunked"
    if args.rate_scales:
        args.rate_scale = args.rate_scales[0]
    made: list[Any] = []

    def make(kv: int) -> Any:
        args.kv_tokens = kv
        made.append(_one_scale_setup(args))
        return made[-1]

    with progress_bar() as bar:
        task = bar.add_task("kv sweep", total=len(sizes))
        rows = kv_sweep(make, sizes, budget, progress=lambda k, n: bar.update(task, completed=k, total=n),
                        batching=batching)
    requests = rows[0].get("num_requests") if rows else None
    trace = made[0].workload.name if made else Path(str(args.trace or "workload")).name
    title = f"{trace}: {requests:,} requests" if requests else trace
    title += f", rate x{made[0].rate_scale if made else args.rate_scale or 1:g}, budget {budget:,}"
    if batching != "chunked":
        title += f", {batching}"
    if made and made[0].prefix_caching:
        title += f", prefix caching, {made[0].block_size}-token blocks"
    if args.json:
        print(json.dumps({"token_budget": budget, "batching": batching, "rows": rows}, indent=1))
    else:
        print("\n".join(kv_sweep_lines(rows, title)))
    rejected = [f"{r['rejected']:,} at {r['kv_tokens']:,}" for r in rows if r.get("rejected")]
    if rejected:
        print(f"warning: of {requests or '?'} requests, rejected at KV tokens: " + ", ".join(rejected)
              + "; their latencies are left out, figures no request has are shown as -", file=sys.stderr)
    if args.json and any(preemption_inflated(r) for r in rows):
        print("note: rows with hit_rate_inflated_by_preemption count readmissions after preemption as lookups "
              "and hits; their hit rate can exceed the infinite-cache bound", file=sys.stderr)
    if args.out:
        names = write_kv_sweep(args.out, rows, title)
        print(f"wrote {args.out}/{', '.join(names)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _one_scale_setup(args: argparse.Namespace) -> Any:
    """setup_from_args for a sweep at the one value of --rate-scales (set as args.rate_scale): an error about
    that scale names --rate-scales, the flag given."""
    from stallfree.sim.inputs.options import SetupError

    try:
        return setup_from_args(args)
    except SetupError as exc:
        if args.rate_scales and "`rate_scale`" in str(exc):
            raise SetupError(str(exc).replace("`rate_scale`", "`rate_scales`"), usage=exc.usage) from None
        raise


def _join(values: Sequence[Any]) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
