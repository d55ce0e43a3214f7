"""`stallfree plan`: how many replicas, behind which router, meet the SLOs on a workload, and whether
disaggregated prefill/decode does it on fewer GPUs; the answer in one line above the table of every
cluster simulated. Exits 3 when no count up to --max-replicas meets the SLOs.

Imports allowed: the standard library, stallfree._argtypes and stallfree.sim; rich lazily.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from stallfree._argtypes import positive_int
from stallfree.flags import add_scheduler_flags, given
from stallfree.sim.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_ROUTERS,
    PlanResult,
    plan,
    plan_report,
)
from stallfree.sim.commands.common import (
    CliError,
    add_common,
    add_executor_flags,
    executor_from_args,
    guard,
    progress_bar,
    served_nothing,
    setup_from_args,
)
from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.disagg import sides_behaviour

__all__ = ["EXIT_NOT_MET", "register", "run"]

#: No replica count up to --max-replicas meets the SLOs (as tune's 3).
EXIT_NOT_MET = 3


def register(subparsers: Any) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="the fewest replicas, and the router, that meet the SLOs on a workload (and whether "
        "disaggregated prefill/decode needs fewer)",
        description="Find the smallest number of replicas whose cluster serves at least --slo-attainment of the "
        "requests within both SLOs: start from the count one replica's saturated throughput implies, gallop up or "
        "down, then bisect; then try the other routers one count lower, and disaggregated P:D splits on fewer "
        "replicas (docs/cluster.md, 'How many replicas'). Simulations run on --executor. "
        f"Exits {EXIT_NOT_MET} when no count up to --max-replicas meets the SLOs.",
    )
    add_common(p)
    g = p.add_argument_group("plan")
    g.add_argument("--slo-attainment", type=float, default=DEFAULT_ATTAINMENT, metavar="F",
                   help=f"share of all requests that must meet both SLOs (default {DEFAULT_ATTAINMENT:g})")
    g.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), metavar="LIST",
                   help=f"routers to try, the first leading the search (default {','.join(DEFAULT_ROUTERS)})")
    add_scheduler_flags(g, {"token_budget": DEFAULT_TOKEN_BUDGET},
                        why={"token_budget": f"default {DEFAULT_TOKEN_BUDGET:,}: every replica's, as simulate's"})
    g.add_argument("--max-replicas", type=positive_int, default=DEFAULT_MAX_REPLICAS, metavar="N",
                   help=f"the largest count tried (default {DEFAULT_MAX_REPLICAS})")
    g.add_argument("--no-disaggregate", action="store_true",
                   help="skip the disaggregated prefill/decode splits")
    g.add_argument("--jobs", type=positive_int, metavar="N", help="worker processes (default: CPUs)")
    add_executor_flags(p)
    p.set_defaults(func=guard(run))


def run(args: argparse.Namespace) -> int:
    """Run `stallfree plan` on parsed arguments; returns the exit status (3: no count meets the SLOs)."""
    from stallfree.sim.routers import ROUTERS

    if args.slo_ttft is None and args.slo_tpot is None:
        raise CliError("plan needs an SLO: give --slo-ttft and/or --slo-tpot", 2)
    if not 0 < args.slo_attainment <= 1:
        raise CliError(f"--slo-attainment {args.slo_attainment:g}: must be in (0, 1]", 2)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if not routers or bad:
        raise CliError(f"--routers {args.routers!r}: choose from {', '.join(ROUTERS)}", 2)
    if args.out:
        raise CliError("plan writes no files: drop --out (--json prints the report)", 2)
    executor = executor_from_args(args)
    width = args.jobs or os.cpu_count() or 1
    setup = setup_from_args(args)
    if given(args, "async_scheduling") and args.async_scheduling and not args.no_disaggregate:
        raise CliError("--async-scheduling is not modelled for the disaggregated splits plan searches: add "
                       "--no-disaggregate", 2)
    with _progress() as progress:
        result = plan(
            setup, args.slo_ttft, args.slo_tpot, attainment=args.slo_attainment, routers=routers,
            budget=args.token_budget, max_replicas=args.max_replicas, executor=executor,
            width=width if executor.name != "serial" else 1, disaggregate=not args.no_disaggregate,
            progress=progress,
        )
    header = setup.header()
    if not args.no_disaggregate:
        header["disaggregated_behaviour"], header["disaggregation_not_modelled"] = sides_behaviour(setup)
    if args.json:
        report = plan_report(result, header, args.slo_ttft, args.slo_tpot)
        report["serve"] = serve_commands(args, header) if result.replicas is not None else None
        print(json.dumps(report, indent=1))
    else:
        print_plan(result, header, args)
    return served_nothing("plan", result.rows) or (0 if result.replicas is not None else EXIT_NOT_MET)


def _slo_text(args: argparse.Namespace) -> str:
    parts = []
    if args.slo_ttft is not None:
        parts.append(f"TTFT <= {args.slo_ttft * 1e3:,g} ms")
    if args.slo_tpot is not None:
        parts.append(f"TPOT <= {args.slo_tpot * 1e3:,g} ms")
    return " and ".join(parts)


def answer_line(result: PlanResult, args: argparse.Namespace) -> str:
    """The one answer line: the count, router and GPUs, the attainment, the count below, and disaggregation."""
    slo = f"{_slo_text(args)} (target {result.attainment:.2%})"
    if result.replicas is None:
        best = max(result.rows, key=lambda r: r["attainment"]) if result.rows else None
        got = f"; best {best['label']}: {best['attainment']:.2%}" if best else ""
        return f"answer: no count up to {args.max_replicas} replicas meets {slo}{got} (exit {EXIT_NOT_MET})"
    row = result.answer_row
    assert row is not None
    below = [r for r in result.rows if r["kind"] == "aggregated" and r["replicas"] == result.replicas - 1]
    below_text = ""
    if below:
        b = max(below, key=lambda r: r["attainment"])
        n = result.replicas - 1
        below_text = f"; {n} replica{'s reach' if n != 1 else ' reaches'} {b['attainment']:.2%} ({b['router']})"
    line = (f"answer: {result.replicas} replica{'s' if result.replicas != 1 else ''} ({row['num_gpus']} GPUs), "
            f"router {result.router}: {row['attainment']:.2%} of requests within {slo}{below_text}. ")
    return line + _disagg_text(result)


def _disagg_text(result: PlanResult) -> str:
    if not result.disagg_tried:
        return "Disaggregation not searched (--no-disaggregate)."
    d = result.disaggregated
    if d is not None:
        assert result.replicas is not None
        saved = (result.replicas - d["replicas"]) * result.gpus_per_replica
        return (f"Disaggregated {d['label']} beats it per GPU: {d['attainment']:.2%} on {d['num_gpus']} GPUs, "
                f"{saved} fewer.")
    assert result.replicas is not None
    n = result.replicas - 1
    tried = [r for r in result.rows if r["kind"] == "disaggregated"]
    if n < 2:
        return "Disaggregation cannot beat it on fewer GPUs: 1 replica cannot be split into prefill and decode."
    if not tried:
        b = result.split_bound
        need = f" (prefill needs {b.p_min}, decode {b.d_min} at the mean rate)" if b is not None else ""
        return f"Disaggregation cannot beat it: no P:D split of at most {n} replicas has the capacity{need}."
    best = max(tried, key=lambda r: r["attainment"])
    return (f"Disaggregation does not beat it per GPU: no P:D split of at most {n} replicas meets the SLOs "
            f"(best {best['label']}: {best['attainment']:.2%}).")


def print_plan(result: PlanResult, header: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the workload line, the answer line, the table of every cluster simulated and how the search went."""
    from rich.table import Table

    from stallfree.sim.report import console

    rate = header["offered_rate"]
    offered = f"{rate:,.2f} req/s offered" if rate is not None else "closed loop"
    print(f"{header['workload']}: {header['requests']:,} requests, rate scale {header['rate_scale']:g} ({offered}); "
          f"{header['hardware']}; budget {args.token_budget:,}; max_seqs {header['max_seqs']}")
    print(f"aggregated replicas: {header['behaviour']}"
          + (f"; disaggregated splits, {header['disaggregated_behaviour']}" if "disaggregated_behaviour" in header
             else ""))
    print(answer_line(result, args))
    cols = (("attainment", "in SLO", "{:.2%}"), ("request_goodput", "goodput", "{:,.2f}"),
            ("goodput_per_gpu", "per GPU", "{:,.3f}"), ("median_ttft_ms", "TTFT p50", "{:,.0f}"),
            ("p99_ttft_ms", "TTFT p99", "{:,.0f}"), ("median_tpot_ms", "TPOT p50", "{:,.1f}"),
            ("p99_tpot_ms", "TPOT p99", "{:,.1f}"))
    table = Table(title="clusters simulated (goodput in req/s, latencies in ms)", title_justify="left")
    for name in ("cluster", "GPUs", *(c[1] for c in cols), ""):
        table.add_column(name, justify="left" if name == "cluster" else "right", no_wrap=True)
    rows = sorted(result.rows, key=lambda r: (r["kind"] != "aggregated", r["replicas"], r["router"], r["label"]))
    for r in rows:
        met = "meets" if r["attainment"] >= result.attainment else ""
        chosen = r is result.answer_row or r is result.disaggregated
        cells = ["-" if r.get(k) is None else spec.format(r[k]) for k, _, spec in cols]
        table.add_row(r["label"], str(r["num_gpus"]), *cells, ("chosen" if chosen else met))
    console().print(table)
    print(f"search: one replica sustains ~{result.single_capacity:,.2f} req/s saturated, so {result.offered_rate:,.2f} "
          f"req/s needs at least ~{result.bound} (the start); {len(result.rows)} simulations in {result.wall_s:,.1f} s")
    if result.replicas is not None:
        serve = serve_commands(args, header)
        note = f"  (MODEL: the checkpoint of {args.model})" if "/" not in args.model else ""
        print(f"each replica: {serve['vllm']}{note}")
        if serve["stallfree"] is not None:
            print(f"  or, on stallfree's engine: {serve['stallfree']}")
        else:
            print(f"  (stallfree serve runs on one device: a replica of {args.tp} GPUs needs a tensor-parallel "
                  "engine such as vLLM)")


def serve_commands(args: argparse.Namespace, header: dict[str, Any]) -> dict[str, str | None]:
    """The serve lines of the chosen replica: "vllm" (vLLM's flags: tensor parallelism, token budget as
    --max-num-batched-tokens, --max-num-seqs; MODEL stands for the checkpoint when --model is a preset
    name rather than a Hugging Face id) and "stallfree" (`stallfree serve`, None when a replica spans
    more than one GPU: that engine runs on one device)."""
    model = args.model if "/" in args.model else "MODEL"
    vllm = (f"vllm serve {model} --tensor-parallel-size {args.tp} --max-num-batched-tokens {args.token_budget} "
            f"--max-num-seqs {header['max_seqs']}")
    own = f"stallfree serve --max-num-batched-tokens {args.token_budget} --max-num-seqs {header['max_seqs']}"
    return {"vllm": vllm, "stallfree": own if args.tp == 1 else None}


@contextmanager
def _progress() -> Iterator[Callable[[int, int], None]]:
    """The search's progress callback (finished, planned simulations): a transient bar on a terminal;
    otherwise (stderr to a file or a pipe, where a bar shows nothing) one plain line per finished
    simulation, so a long search is seen to move."""
    if sys.stderr.isatty():
        with progress_bar() as bar:
            task = bar.add_task("plan", total=None)
            yield lambda k, n: bar.update(task, completed=k, total=n)
        return
    t0, last = time.perf_counter(), [0]

    def line(k: int, n: int) -> None:
        if k > last[0]:
            last[0] = k
            print(f"plan: simulation {k} done ({n} planned so far; {time.perf_counter() - t0:,.1f} s)",
                  file=sys.stderr, flush=True)

    yield line
