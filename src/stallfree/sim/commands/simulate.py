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
from typing import TYPE_CHECKING, Any

from stallfree.flags import given
from stallfree.sim.commands import autoscale as autoscale_cli
from stallfree.sim.commands.common import (
    OUT_FILES,
    CliError,
    ProgressLine,
    ensure_writable_dir,
    ensure_writable_file,
    flag_message,
    guard,
    rate_text,
    refuse_writing_the_trace,
    rejection_warning,
    served_nothing,
    share_text,
)
from stallfree.sim.commands.setup_args import (
    add_common,
    setup_from_args,
)
from stallfree.sim.commands.simulate_flags import (
    _add_batching_flags,
    _add_cluster_flags,
    _add_load_flags,
    _check_flags,
    _check_mode_flags,
    _has_cpu_tier,
    _is_cluster,
)
from stallfree.sim.defaults import (
    BATCHING_MODES,
    DEFAULT_ADAPTER_SLOTS,
    DEFAULT_PREFIX_THRESHOLD,
    DEFAULT_ROUTER_SEED,
)
from stallfree.sim.run.disagg_link import DEFAULT_INTERCONNECT, INTERCONNECTS, Interconnect

if TYPE_CHECKING:
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.studies.experiment import Experiment

# The simulator (setup, runs, studies, writers) is imported inside the functions that run it, so that
# `stallfree simulate --help` builds its parser without importing it.

__all__ = [
    "register",
    "run",
]


def run_experiment(*args: Any, **kwargs: Any) -> Any:
    """stallfree.sim.studies.experiment.run_experiment, imported when a run starts (a name here, so that
    tests can replace it)."""
    from stallfree.sim.studies.experiment import run_experiment as run

    return run(*args, **kwargs)


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


def _check_resolved(args: argparse.Namespace, setup: Setup) -> None:
    """Refuse what does not go with the run the engine's defaults resolved (the paged-only flags are refused
    by setup_from_args): --async-scheduling typed with --step-time-target; the engine's default of it is
    left out, and said.

    Raises:
        CliError: --async-scheduling typed with --step-time-target (exit 2).
    """
    if args.step_time_target is not None and setup.async_scheduling:
        # A time budget per step plans each step from the step before it: not modelled with the step
        # planned ahead. Typed, refused; the engine's default is left out, and said.
        if given(args, "async_scheduling"):
            raise CliError("--async-scheduling is not modelled with --step-time-target: drop one of them", 2)
        why = setup.engine_behaviour.pop("async_scheduling", {}).get("source", "")
        setup.async_scheduling = False
        print(f"note: asynchronous scheduling ({why}) is not modelled with --step-time-target: the run schedules "
              "synchronously", file=sys.stderr)


def _study(args: argparse.Namespace, setup: Setup, capacity: bool = True,
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
    from stallfree.sim.outputs.table import print_table

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
    from stallfree.sim.inputs.sessions import SessionWorkload
    from stallfree.sim.outputs.writers import write_records
    from stallfree.sim.studies.experiment import run_tag

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
    if not args.keep_records:
        wl = setup.workload
        what = "tenants" if wl.tenants is not None else "LoRA adapters" if wl.loras is not None else None
        if what is not None:
            raise CliError(f"--no-records: {wl.name} names {what}, whose figures read per-request records: keep "
                           "the records (drop --no-records)", 2)
        setup.keep_records = False
    if args.max_queue_time is not None:
        if args.compare or args.batching != "chunked" or args.step_time_target is not None:
            raise CliError("--max-queue-time applies to chunked batching without --compare or --step-time-target", 2)
        setup.max_queue_time_s = args.max_queue_time
    sessions = isinstance(setup.workload, SessionWorkload)
    if caching and setup.workload.prefix_ids is None and not sessions:
        flag = "--compare-caching" if args.compare_caching else given(args, "enable_prefix_caching")
        print(f"note: {flag}: {setup.workload.name} has no prompt block hashes (prefix ids), so nothing can hit "
              "the cache (--trace mooncake or a Mooncake JSONL has them)", file=sys.stderr)
    if args.fairness == "vtc" and getattr(setup.workload, "tenants", None) is None:
        print(f"note: --fairness vtc: {setup.workload.name} has no tenant column, so every request is the tenant "
              "'default' and admission is first come, first served (a CSV trace's `tenant` column or a JSONL "
              "trace's `tenant` field names them)", file=sys.stderr)
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
    from stallfree.sim.outputs.overload import annotate

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
    """--compare and --compare-caching: the verdict (sim/outputs/verdict.py) of each run against the first."""
    from stallfree.sim.outputs.verdict import compare_verdict

    if not (args.compare or args.compare_caching) or len(study.results) < 2:
        return None
    what = "prefix caching" if args.compare_caching else "chunked prefill against the baselines"
    line, figures = compare_verdict(study.results, [s["label"] for s in study.summaries], what)
    return {"line": line, "figures": figures}


def _add_ranges(args: argparse.Namespace, setup: Setup, study: Experiment,
                progress: ProgressLine | None = None) -> None:
    """Give each run of the study its "range" (stallfree.sim.studies.ranges): the same study replayed with every
    step scaled to the error model's low and high factor (no capacity measured), and the error model
    in the header."""
    import copy

    from stallfree.sim.studies.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, error_model, run_range

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


def _run_once(args: argparse.Namespace, setup: Setup, capacity: bool = True) -> tuple[Experiment, list[Any]]:
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


def _run_disagg(args: argparse.Namespace, setup: Setup) -> int:
    from stallfree.sim.outputs.table import print_table
    from stallfree.sim.outputs.writers import write_disagg_out, write_disagg_records
    from stallfree.sim.run.disagg import parse_disaggregate
    from stallfree.sim.run.result import ClusterError
    from stallfree.sim.studies.disagg_search import run_disagg_experiment

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


def _search(args: argparse.Namespace, setup: Setup, link: Any) -> int:

    from stallfree.sim.outputs.table import print_table
    from stallfree.sim.run.result import ClusterError
    from stallfree.sim.studies.disagg_search import search_plan, sides_behaviour

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
    from stallfree.sim.outputs.verdict import disagg_verdict, offered_load_note

    line, verdict = disagg_verdict(aggs[0], rows[0], len(setup.workload))
    note = offered_load_note(aggs, rows[0], setup.workload.mean_rate)
    verdict["offered_load_note"] = note
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
        print(f"  {s['label']:>30}: {rate_text(s['goodput_per_gpu'], 3)} req/s/GPU (goodput "
              f"{rate_text(s['request_goodput'] or 0)} req/s, p99 TTFT {s.get('p99_ttft_ms') or 0:,.0f} ms, p99 TPOT "
              f"{s.get('p99_tpot_ms') or 0:.1f} ms)")
    print(f"best aggregated: {rate_text(agg['goodput_per_gpu'], 3)} req/s/GPU ({agg['label']}); best disaggregated: "
          f"{rate_text(best['goodput_per_gpu'], 3)} req/s/GPU ({best['label']})")
    print_table([agg, best], title="best aggregated and best disaggregated")
    print(line)
    if note:
        print(note)
    return 0


def _run_cluster(args: argparse.Namespace, setup: Setup, capacity: bool = True) -> tuple[Experiment, Any]:

    from stallfree.sim.run.result import ClusterError
    from stallfree.sim.run.routers import make_router
    from stallfree.sim.studies.cluster_study import run_cluster_study

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
    from stallfree.sim.run.autoscale import AutoscaleError

    try:
        study, cluster = run_cluster_study(
            setup, replicas=replicas, router=router, budget=args.token_budget, step_time_target=args.step_time_target,
            check=args.check, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, capacity=capacity, group=group,
        )
    except AutoscaleError as exc:  # too many scaling decisions for the run (the fleet's own check)
        raise CliError(str(exc), 2) from None
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
        return f"achieved {rate_text(achieved)} req/s; " + _load_text({k: v for k, v in summary.items()
                                                              if k != "achieved_request_rate"})
    if capacity is None:
        return "capacity unknown (no request was served)"
    if load is None:
        return f"every request arrives at once (capacity ~{capacity:,.1f} req/s when saturated)"
    return f"utilization {share_text(load)} of capacity (~{capacity:,.1f} req/s when saturated)"


def print_header(header: dict[str, Any], summaries: list[dict[str, Any]]) -> None:
    """Print the workload, the replica, each run's utilisation and the workload's notes."""
    n = header["requests"]
    wl = f"{header['workload']}: {n:,} request{'s' if n != 1 else ''}"
    rate = header["offered_rate"]
    offered = f"{rate_text(rate)} req/s offered" if rate is not None and math.isfinite(rate) else "all at one instant"
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
        # An autoscaled run's capacity is its most replicas' (the label's xN too), not the fleet it ran.
        auto = s.get("autoscale")
        fleet = (f" at {auto['max']} replicas, the autoscaler's maximum (its peak: {s['replicas_peak']})"
                 if auto and s.get("capacity_req_s") is not None else "")
        print(
            f"{s['label']}: {_load_text(s)}{fleet}; requests were left waiting after "
            f"{share_text(s.get('queued_fraction') or 0)} of the steps"
            + (f"; {share_text(s['budget_utilization'])} of the token budget used"
               if s.get("budget_utilization") else "")
            # Only prefill-first and no-chunk batching pass the budget: they run a whole prompt in one step.
            + (" (above 100%: this batching runs a whole prompt longer than the budget in one step)"
               if (s.get("budget_utilization") or 0) > 1 else "")
        )
        if s.get("saturated"):
            from stallfree.sim.outputs.overload import saturation_line

            print(saturation_line(s["label"], s))
    for note in header["notes"]:
        print(f"note: {note}")


def _add_static(args: argparse.Namespace, setup: Setup, study: Experiment, clusters: list[Any]) -> None:
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
    from stallfree.sim.outputs.writers import write_experiment

    names = write_experiment(out, study, clusters)
    if "static" in study.summaries[0]:
        names.append(autoscale_cli.write_plot(out, study.summaries[0]))
    print(f"wrote {out}/{', '.join(names)}", file=sys.stderr if quiet_stdout else sys.stdout)
