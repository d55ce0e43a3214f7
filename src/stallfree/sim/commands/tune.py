"""`stallfree tune`: bound the token budget with the cost model, search around it by simulation, and
print the choice with its serve flags; exits 3 when the best candidate serves fewer than --slo-attainment
of the requests within the SLOs (its last line says by how much, and to try `stallfree plan`).

Imports allowed: the standard library, stallfree._argtypes and stallfree.sim; rich lazily.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stallfree._argtypes import int_between, int_list, partial_prefill_flag_problem, positive_int, token_count_list
from stallfree.sim.commands.common import (
    OUT_FILES,
    CliError,
    add_executor_flags,
    counted,
    ensure_writable_dir,
    executor_from_args,
    guard,
    progress_bar,
    rate_text,
    refuse_writing_the_trace,
    served_nothing,
    warn_rejections,
)
from stallfree.sim.commands.setup_args import add_common, setup_from_args
from stallfree.sim.defaults import DEFAULT_ATTAINMENT, DEFAULT_TIE_TOLERANCE, JOBS_LIMIT

if TYPE_CHECKING:
    from stallfree.sim.studies.tune import TuneResult

# The simulator (the tuner, its report and writer, the console) is imported inside the functions that run
# it, so that building the parser (any command's --help) does not import it.

__all__ = ["EXIT_NO_CANDIDATE_MEETS_SLO", "register", "run"]

#: The exit status of `tune` when the best candidate serves fewer than --slo-attainment of the requests
#: within both SLOs (1 is an error, 2 a usage error; plan's 3 too): the best found is still printed,
#: with its attainment and the shortfall.
EXIT_NO_CANDIDATE_MEETS_SLO = 3


def register(subparsers: Any) -> None:
    """Add the `tune` subcommand."""
    p = subparsers.add_parser(
        "tune",
        help="pick the token budget and max_seqs that maximise goodput under TTFT and TPOT SLOs",
        description="Bound the token budget with the cost model (the largest whose step stays under the "
        "TPOT target at the workload's expected load), then simulate candidates around it in parallel "
        "and pick the highest goodput (ties: lower p99 TPOT, then larger budget). Prints the serve flags. "
        f"Exits {EXIT_NO_CANDIDATE_MEETS_SLO} when the best candidate serves fewer than --slo-attainment of the "
        "requests within the SLOs.",
    )
    add_common(p)
    t = p.add_argument_group("search")
    t.add_argument("--slo-attainment", type=float, default=DEFAULT_ATTAINMENT, metavar="F",
                   help=f"share of all requests the best candidate must serve within both SLOs, else exit "
                   f"{EXIT_NO_CANDIDATE_MEETS_SLO} (default {DEFAULT_ATTAINMENT:g}, as plan's)")
    t.add_argument("--budgets", type=token_count_list, metavar="LIST", help="simulate these budgets only (no bound)")
    t.add_argument(
        "--max-seqs-candidates",
        type=int_list,  # counts of sequences, as --max-num-seqs: no token suffixes
        metavar="LIST",
        help="max_seqs values tried at the best budget (default: half and double --max-num-seqs)",
    )
    t.add_argument("--jobs", type=int_between(1, JOBS_LIMIT), metavar="N", help="worker processes (default: CPUs)")
    t.add_argument(
        "--tie-tolerance",
        type=float,
        default=DEFAULT_TIE_TOLERANCE,
        metavar="F",
        help=f"goodputs within this fraction of the best are tied, and the lower p99 TPOT wins "
        f"(default {DEFAULT_TIE_TOLERANCE:g}; 0.01 trades up to 1%% of goodput for TPOT headroom)",
    )
    t.add_argument(
        "--search-partial-prefills",
        action="store_true",
        help="then try concurrent partial prefills at the best budget: K 2 or 4, L K or 1, T budget/8 or "
        "budget/4 (docs/tuning.md)",
    )
    t.add_argument("--top", type=positive_int, default=6, metavar="N", help="rows to print (default 6)")
    t.add_argument("--range", action="store_true",
                   help="a range on the chosen candidate's latencies: it is replayed twice more, each step at the "
                   "10th and 90th percentile of the measured step-time error (docs/simulator.md, \"Ranges\")")
    add_executor_flags(p)
    p.set_defaults(func=guard(run))


def run(args: argparse.Namespace) -> int:
    """Run `stallfree tune` on parsed arguments; returns the exit status (3: no candidate meets the SLOs)."""
    from stallfree.sim.outputs.writers import write_tune
    from stallfree.sim.studies.tune import tune
    from stallfree.sim.studies.tune_bound import TargetBelowFloor
    from stallfree.sim.studies.tune_report import tune_report

    if args.slo_ttft is None or args.slo_tpot is None:
        raise CliError("tune needs both --slo-ttft and --slo-tpot", 2)
    if not 0 < args.slo_attainment <= 1:
        raise CliError(f"--slo-attainment {args.slo_attainment:g}: must be in (0, 1]", 2)
    if args.synthetic == "sessions" or args.trace_format == "sessions":
        raise CliError("tune searches at an offered request rate; sessions have none in advance (each turn "
                       "waits for the last one's answer): run `stallfree simulate` on them", 2)
    if not 0 <= args.tie_tolerance < 1:
        raise CliError(f"--tie-tolerance must be in [0, 1), got {args.tie_tolerance!r}", 2)
    problem = partial_prefill_flag_problem(
        args.max_num_partial_prefills, args.max_long_partial_prefills, args.long_prefill_token_threshold
    )
    if problem is not None:
        raise CliError(problem, 2)
    if args.out:
        refuse_writing_the_trace(args, args.out, "--out", OUT_FILES["tune"])
        ensure_writable_dir(args.out, "--out")
    setup = setup_from_args(args)
    limits = setup.scheduler_config.partial_prefill_limits  # T defaults to 4% of the context length
    fixed_pp = (limits[0], limits[1], int(limits[2] or 1)) if limits[0] > 1 else None  # (K, L, T) of every run
    with progress_bar() as bar:
        task = bar.add_task("tune", total=None)
        try:
            result = tune(
                setup.workload,
                setup.kv_tokens,
                setup.cost_model,
                args.slo_ttft,
                args.slo_tpot,
                max_seqs=args.max_seqs,
                max_seqs_candidates=args.max_seqs_candidates,
                budgets=args.budgets,
                max_tokens=args.max_tokens,
                jobs=executor_from_args(args),
                tie_tolerance=args.tie_tolerance,
                progress=lambda k, n: bar.update(task, completed=k, total=n),
                max_model_len=setup.context_length,
                cut_output_to_fit=setup.workload_options.cut_output_to_fit,
                search_partial_prefills=args.search_partial_prefills,
                partial_prefills=fixed_pp,
                async_scheduling=setup.async_scheduling,
                scheduler=setup.scheduler_config,
            )
        except TargetBelowFloor as exc:
            raise CliError(str(exc), 2) from None
    result.attainment_target = args.slo_attainment
    header = setup.header()
    if args.range:
        from stallfree.sim.studies.ranges import error_model
        from stallfree.sim.studies.tune import chosen_range

        result.best["range"] = chosen_range(
            result, setup.workload, setup.kv_tokens, setup.cost_model, max_tokens=args.max_tokens,
            jobs=executor_from_args(args), max_model_len=setup.context_length,
            cut_output_to_fit=setup.workload_options.cut_output_to_fit, async_scheduling=setup.async_scheduling,
            scheduler=setup.scheduler_config)
        header["range_model"] = error_model()
    warn_rejections(result.rows, header["requests"])
    from stallfree.sim.studies.tune_report import best_by_kind

    kinds = best_by_kind(result.rows, args.max_seqs)
    vllm_serve = _serve_of(result, args)["vllm"]
    if args.json:
        print(json.dumps(tune_report(result, header, vllm_serve) | {"best_by_kind": kinds}, indent=1))
        if not result.slo_met:
            best = result.best
            print(
                f"stallfree tune: no candidate meets the SLOs; best found: token budget {best['token_budget']:,}, "
                f"max_seqs {best['max_seqs']}, {best.get('slo_attainment') or 0:.1%} within the SLOs",
                file=sys.stderr,
            )
    else:
        print_result(result, header, args.top, args.tie_tolerance, args)
        if args.range:
            span = result.best["range"]
            print("range of the chosen (every step x"
                  f"{header['range_model']['step_time_low']:g} to x{header['range_model']['step_time_high']:g}): "
                  + ", ".join(f"{name} {span[key][0]:,.1f}-{span[key][1]:,.1f} ms" for key, name in (
                      ("p99_ttft_ms", "TTFT p99"), ("p99_tpot_ms", "TPOT p99"), ("mean_e2el_ms", "E2E mean"))
                              if span.get(key)))
        print("best of each kind searched: " + "; ".join(_kind_text(k) for k in kinds))
    if args.out:
        names = write_tune(args.out, result, header, vllm_serve)
        print(f"wrote {args.out}/{', '.join(names)}", file=sys.stderr if args.json else sys.stdout)
    nothing = served_nothing("tune", result.rows)
    if nothing:
        return nothing
    if result.slo_met and not result.attainment_met:
        # The last line, so that a script reading the tail (or a person) sees the miss, not the serve line.
        print(miss_line(result), file=sys.stderr if args.json else sys.stdout)
    return 0 if result.attainment_met else EXIT_NO_CANDIDATE_MEETS_SLO


def miss_line(result: TuneResult) -> str:
    """The line that says the best candidate misses the attainment target: by how many points, and
    what to try (more replicas: `stallfree plan`)."""
    got, want = result.attainment, result.attainment_target
    return (f"stallfree tune: the best candidate misses the SLO target: {got:.2%} of requests within the SLOs, "
            f"{(want - got) * 100:.2f} points below --slo-attainment {want:g} (exit {EXIT_NO_CANDIDATE_MEETS_SLO}); "
            "one replica cannot serve this load within the SLOs at any budget tried: try `stallfree plan` with the "
            "same flags for more replicas, or loosen the SLOs")


def _serve_of(result: TuneResult, args: argparse.Namespace) -> dict[str, Any]:
    """The serve lines of the best candidate on the simulated replica (plan.serve_lines: "vllm", and
    "stallfree" where the replica is one GPU), with its partial-prefill flags."""
    from stallfree.sim.commands.plan import serve_lines
    from stallfree.sim.studies.tune_report import partial_prefill_flags

    best = result.best
    tp = int(args.tp[0] if isinstance(args.tp, list) else args.tp)
    return serve_lines(args, best["token_budget"], best["max_seqs"], tp, partial_prefill_flags(best))


def print_result(result: TuneResult, header: dict[str, Any], top: int, tie_tolerance: float,
                 args: argparse.Namespace) -> None:
    """Print the SLOs, the bound, the candidates' table (best first), the choice and its serve line: plan's
    `vllm serve` line for the simulated replica (its model, tp and dtype), with `stallfree serve`'s only
    where the replica is one GPU. A choice below --slo-attainment is called the best found, not one that
    meets the SLOs.

    When no candidate meets the SLOs, say so instead of recommending a serve line.
    """
    from stallfree.sim.commands.plan_text import print_serve

    print(
        f"{header['workload']}: {header['requests']:,} requests, rate scale {header['rate_scale']:g} "
        f"({rate_text(header['offered_rate'])} req/s offered); {header['hardware']}; "
        f"KV {header['kv_tokens']:,} tokens; {header['behaviour']}"
    )
    print(f"SLOs: TTFT <= {result.slo_ttft * 1e3:g} ms, TPOT <= {result.slo_tpot * 1e3:g} ms")
    if result.bound is not None:
        b = result.bound
        print(
            f"cost-model bound: token budget {b.token_budget:,} (a full step {b.step_s * 1e3:.1f} ms at "
            f"{b.num_decodes} decodes x {b.decode_context:,} tokens of context, chunks at offset "
            f"{b.chunk_start:,}; decode-only {b.decode_floor_s * 1e3:.1f} ms)"
        )
    print(f"simulated {counted(len(result.rows), 'candidate')} in {result.wall_s:.1f} s")
    _print_candidates(result, top)
    print(
        f"ranking: goodputs within {tie_tolerance:.1%} of the highest are tied (--tie-tolerance); among "
        "them the lower TPOT p99 ranks first, then the larger budget"
    )
    best = result.best
    if not result.slo_met:
        print(
            f"no candidate meets the SLOs: none of the {len(result.rows)} serves any request within "
            f"TTFT <= {result.slo_ttft * 1e3:g} ms and TPOT <= {result.slo_tpot * 1e3:g} ms. Best found: "
            f"token budget {best['token_budget']:,}, max_seqs {best['max_seqs']}, "
            f"{best.get('slo_attainment') or 0:.1%} within the SLOs; p99 TTFT "
            f"{_ms(best.get('p99_ttft_ms'))}, p99 TPOT {_ms(best.get('p99_tpot_ms'))} "
            f"(loosen the SLOs, lower the rate or add replicas)"
        )
        return
    print(
        f"chosen: token budget {best['token_budget']:,}, max_seqs {best['max_seqs']}: goodput "
        f"{rate_text(best.get('request_goodput') or 0)} req/s ({best.get('slo_attainment') or 0:.1%} within the SLOs)"
    )
    tp = int(args.tp[0] if isinstance(args.tp, list) else args.tp)
    serve = _serve_of(result, args)
    who = ("serve it" if result.attainment_met else
           f"best found, not one that meets the SLO target (--slo-attainment {result.attainment_target:g})")
    print_serve(serve, args, tp, who=who)


def _kind_text(k: dict[str, Any]) -> str:
    """One kind of best_by_kind: its best value, how many were tried, its goodput."""
    names = {"token_budget": "token budget", "max_seqs": "max_seqs", "partial_prefills": "partial prefills K/L/T"}
    value = "/".join(map(str, k["value"])) if k["kind"] == "partial_prefills" else f"{k['value']:,}"
    return (f"{names[k['kind']]} {value} (of {len(k['tried'])} tried; goodput "
            f"{rate_text(k['request_goodput'] or 0)} req/s, {k['slo_attainment'] or 0:.1%} in SLO)")
def _print_candidates(result: TuneResult, top: int) -> None:
    """The candidates' table, best first, the first `top` rows."""
    from rich.table import Table

    from stallfree.sim.outputs.table import console

    cols: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
        ("token_budget", "budget", "{:,}".format),
        ("max_seqs", "max_seqs", "{:,}".format),
        ("request_goodput", "goodput", rate_text),
        ("slo_attainment", "in SLO", "{:.1%}".format),
        ("median_ttft_ms", "TTFT p50", "{:,.0f}".format),
        ("p99_ttft_ms", "TTFT p99", "{:,.0f}".format),
        ("median_tpot_ms", "TPOT p50", "{:,.1f}".format),
        ("p99_tpot_ms", "TPOT p99", "{:,.1f}".format),
    )
    if any(r.get("partial_prefills") for r in result.rows):
        cols = (*cols[:2], ("partial_prefills", "K/L/T", "{0[0]}/{0[1]}/{0[2]}".format), *cols[2:])
    table = Table(title="candidates, best first (goodput in req/s, latencies in ms)", title_justify="left")
    table.add_column("")
    for _, name, _ in cols:
        table.add_column(name, justify="right", no_wrap=True)
    for i, row in enumerate(result.rows[:top]):
        cells = ("-" if row.get(k) is None else text(row[k]) for k, _, text in cols)
        table.add_row("chosen" if i == 0 else f"#{i + 1}", *cells)
    console().print(table)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"
