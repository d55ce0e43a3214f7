"""`stallfree plan`: the cheapest fleet meeting the SLOs on a workload: how many replicas, behind which
router, aggregated or as a P:D split, of which GPU type and tensor parallelism (--gpu and --tp lists),
in dollars per hour with prices (--gpu-price, --prices) or in GPUs without; the answer in one line, why
(the mean load and the busiest minute against the capacity), the table of every cluster simulated and the
runner-ups. Exits 3 when no fleet up to --max-replicas (and --max-gpus) meets the SLOs.

Imports allowed: the standard library, stallfree._argtypes and stallfree.sim; rich lazily.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from stallfree._argtypes import int_between, list_items, token_count
from stallfree.flags import add_scheduler_flags, given
from stallfree.sim.commands.common import (
    EXIT_SERVED_NOTHING,
    OUT_FILES,
    CliError,
    add_executor_flags,
    ensure_writable_dir,
    executor_from_args,
    flag_message,
    guard,
    progress_bar,
    refuse_writing_the_trace,
    rejection_warning,
    served_nothing,
)
from stallfree.sim.commands.plan_text import (
    EXIT_NOT_MET,
    answer_line,
    answer_outcome,
    answer_shape,
    print_plan,
    print_serve,
)
from stallfree.sim.commands.setup_args import add_common, setup_from_args
from stallfree.sim.defaults import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_ROUTERS,
    DEFAULT_TOKEN_BUDGET,
    JOBS_LIMIT,
    REPLICA_LIMIT,
)

if TYPE_CHECKING:
    from stallfree.sim.inputs.prices import GpuPrice
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.studies.fleet import FleetResult, Shape

# The simulator (prices, setups, the capacity and fleet searches) is imported inside the functions that
# run it, so that building the parser (any command's --help) does not import it.

__all__ = ["EXIT_NOT_MET", "answer_line", "register", "run"]


def register(subparsers: Any) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="the cheapest fleet (replicas, router, GPU type, tensor parallelism, aggregated or P:D) that "
        "meets the SLOs on a workload",
        description="Find the cheapest fleet whose cluster serves at least --slo-attainment of the requests "
        "within both SLOs, over the GPU types of --gpu and the tensor parallelism of --tp (lists): bound each "
        "shape by one replica's saturated throughput, search the cheapest bound first, gallop up or down the "
        "replica count then bisect; try the other routers one count lower, and P:D splits (P from 1 to N-1, "
        "bounded by each side's capacity) on fewer replicas (docs/cluster.md, 'How many replicas'). With "
        "--gpu-price or --prices the cost is US dollars per hour, else GPUs. Simulations run on --executor. "
        f"Exits {EXIT_NOT_MET} when no fleet up to --max-replicas meets the SLOs.",
    )
    add_common(p, hardware_lists=True)
    g = p.add_argument_group("plan")
    g.add_argument("--slo-attainment", type=float, default=DEFAULT_ATTAINMENT, metavar="F",
                   help=f"share of all requests that must meet both SLOs (default {DEFAULT_ATTAINMENT:g})")
    g.add_argument("--routers", default=None, metavar="LIST",
                   help=f"routers to try, the first leading the search (default {','.join(DEFAULT_ROUTERS)})")
    add_scheduler_flags(g, {"token_budget": DEFAULT_TOKEN_BUDGET},
                        why={"token_budget": f"default {DEFAULT_TOKEN_BUDGET:,}: every replica's, as simulate's"})
    g.add_argument("--max-replicas", type=int_between(1, REPLICA_LIMIT), default=DEFAULT_MAX_REPLICAS,
                   metavar="N", help=f"the largest count tried per shape (default {DEFAULT_MAX_REPLICAS}, at most "
                   f"{REPLICA_LIMIT:,})")
    g.add_argument("--no-disaggregate", action="store_true",
                   help="skip the disaggregated prefill/decode splits")
    g.add_argument("--prefill-budget", type=token_count, metavar="N",
                   help="the splits' prefill side's token budget per step (default --max-num-batched-tokens; no "
                   "decode shares its steps, so a larger one costs no TPOT)")
    g.add_argument("--decode-budget", type=token_count, metavar="N",
                   help="the splits' decode side's token budget per step (default --max-num-batched-tokens)")
    g.add_argument("--gpu-price", metavar="NAME=USD,...",
                   help="US dollars per GPU-hour of each GPU searched (h100-sxm=2.99,h200=3.79): the answer is "
                   "then the cheapest fleet in dollars; no price is built in")
    g.add_argument("--prices", metavar="FILE",
                   help='prices from a file: CSV gpu,usd_per_hour[,source,date] or JSON {"h100-sxm": 2.99}')
    g.add_argument("--max-gpus", metavar="NAME=N,...", help="the most GPUs of a type a fleet may use")
    g.add_argument("--jobs", type=int_between(1, JOBS_LIMIT), metavar="N", help="worker processes (default: CPUs)")
    g.add_argument("--range", action="store_true",
                   help="a range on the answer's latencies: its cluster replayed twice more, each step at the 10th "
                   "and 90th percentile of the measured step-time error (docs/simulator.md, \"Ranges\")")
    add_executor_flags(p)
    p.set_defaults(func=guard(run))


def _served_none(setup: Any) -> bool:
    """Whether every request of `setup`'s workload is over its context length (max_model_len): then no
    fleet serves one, and a search would simulate up to 64 replicas for nothing. Says so on stderr, with
    the first request's reason, as simulate's rejection line does."""
    from array import array

    from stallfree.sim.run.simulator import context_overflows

    wl, opts = setup.workload, setup.workload_options
    n = len(wl)
    max_new = array("q", wl.output_lens) if opts.max_tokens is None else array("q", (opts.max_tokens,)) * n
    refused = context_overflows(wl, max_new, setup.context_length, opts.cut_output_to_fit)  # type: ignore[arg-type]
    if not n or len(refused) < n:
        return False
    print(rejection_warning("plan", n, {"context_length": n}, refused[0]), file=sys.stderr)
    print(f"stallfree plan: error: every request is over the context length ({setup.context_length:,} tokens, "
          f"{setup.context_length_source}): no fleet serves one; raise --max-model-len or shorten the requests "
          f"(exit {EXIT_SERVED_NOTHING})", file=sys.stderr)
    return True


def run(args: argparse.Namespace) -> int:
    """Run `stallfree plan` on parsed arguments; returns the exit status (3: no fleet meets the SLOs)."""
    from stallfree.sim.run.routers import ROUTERS
    from stallfree.sim.studies.disagg_search import sides_behaviour
    from stallfree.sim.studies.executors import reusing_workers
    from stallfree.sim.studies.fleet import plan_fleet

    if args.slo_ttft is None and args.slo_tpot is None:
        raise CliError("plan needs an SLO: give --slo-ttft and/or --slo-tpot", 2)
    if args.synthetic == "sessions" or args.trace_format == "sessions":
        raise CliError("plan sizes a cluster for an offered request rate; sessions have none in advance (each "
                       "turn waits for the last one's answer): run `stallfree simulate --replicas N` on them", 2)
    if not 0 < args.slo_attainment <= 1:
        raise CliError(f"--slo-attainment {args.slo_attainment:g}: must be in (0, 1]", 2)
    for flag, value in (("--prefill-budget", args.prefill_budget), ("--decode-budget", args.decode_budget)):
        if value is not None and args.no_disaggregate:
            raise CliError(f"{flag} sets a disaggregated split's side; --no-disaggregate searches none: drop one of "
                           "them", 2)
    if args.routers is not None and args.max_replicas == 1:
        # One replica takes every request whichever router is named: the list would only relabel the answer.
        raise CliError(f"--routers {args.routers!r}: a router chooses between replicas and --max-replicas 1 tries "
                       "one replica: raise --max-replicas or drop --routers", 2)
    text = ",".join(DEFAULT_ROUTERS) if args.routers is None else args.routers
    try:
        routers = list_items(text)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--routers: {exc}", 2) from None
    bad = [r for r in routers if r not in ROUTERS]
    if not routers or bad:
        raise CliError(f"--routers {text!r}: choose from {', '.join(ROUTERS)}", 2)
    shapes = _shapes(args)
    prices, max_gpus = _prices(args, shapes)
    if args.out:
        refuse_writing_the_trace(args, args.out, "--out", OUT_FILES["plan"])
        ensure_writable_dir(args.out, "--out")
    executor = executor_from_args(args)
    width = args.jobs or os.cpu_count() or 1
    setups, skipped, notes = _setups(args, shapes)
    first = setups[0][1]
    if _served_none(first):
        return EXIT_SERVED_NOTHING
    if given(args, "async_scheduling") and args.async_scheduling and not args.no_disaggregate:
        raise CliError("--async-scheduling is not modelled for the disaggregated splits plan searches: add "
                       "--no-disaggregate", 2)
    with _progress() as progress, reusing_workers(executor):
        fleet = plan_fleet(
            setups, args.slo_ttft, args.slo_tpot, prices={k: v.usd_per_hour for k, v in prices.items()} or None,
            max_gpus=max_gpus or None, attainment=args.slo_attainment, routers=routers, budget=args.token_budget,
            max_replicas=args.max_replicas, executor=executor, width=width if executor.name != "serial" else 1,
            disaggregate=not args.no_disaggregate, progress=progress, skipped=skipped, notes=notes,
            side_budgets=_side_budgets(args),
        )
    answer_setup = next((st for sh, st in setups if fleet.answer is not None
                         and sh == answer_shape(fleet.answer)), first)
    header = answer_setup.header()
    if args.range and fleet.answer is not None:
        _add_range(answer_setup, fleet, args)
        from stallfree.sim.studies.ranges import error_model

        header["range_model"] = error_model()
    if not args.no_disaggregate:
        header["disaggregated_behaviour"], header["disaggregation_not_modelled"] = sides_behaviour(answer_setup)
    report = _report(fleet, header, args, prices, answer_setup)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_plan(fleet, report, header, args)
    if args.out:
        from stallfree.sim.outputs.writers import write_plan

        names = write_plan(args.out, report, fleet.rows, args.slo_attainment)
        print(f"wrote {args.out}/{', '.join(names)}", file=sys.stderr)
        if not args.json:
            print_serve(report["serve"], args, report["gpus_per_replica"])
    refused = min((int(r.get("rejected") or 0) for r in fleet.rows), default=0)
    if refused:
        print(f"warning: plan: every fleet rejected at least {refused:,} of {len(first.workload):,} requests at "
              "admission (over the context length, or never fitting one replica's KV cache): more replicas serve "
              "none of them, and they count against the SLO attainment; `stallfree simulate` with the same "
              "options names the reasons", file=sys.stderr)
    return served_nothing("plan", fleet.rows) or (0 if fleet.answer is not None else EXIT_NOT_MET)


def _add_range(setup: Setup, fleet: FleetResult, args: argparse.Namespace) -> None:
    """Give the answer's row its "range" (stallfree.sim.studies.ranges): its cluster replayed with every step at the
    error model's low and high factor. An aggregated answer only: a P:D split's row says why it has none."""
    import copy

    from stallfree.sim.studies.capacity import PlanPoint, run_plan_point
    from stallfree.sim.studies.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, run_range

    row = fleet.answer
    assert row is not None
    if row["kind"] != "aggregated":
        row["range"] = None
        row["range_note"] = "no range for a P:D split: --range replays aggregated replicas only"
        return
    scaled = []
    for factor in (STEP_TIME_LOW, STEP_TIME_HIGH):
        other = copy.copy(setup)
        other.cost_model = ScaledCost(setup.cost_model, factor)
        scaled.append(run_plan_point(PlanPoint(other, row["replicas"], row["router"], args.token_budget,
                                               args.slo_ttft, args.slo_tpot)))
    span = run_range(row, scaled)
    row["range"] = {k: v for k, v in span.items() if k in row}


def _side_budgets(args: argparse.Namespace) -> tuple[int, int] | None:
    """(prefill, decode) token budgets of the splits, or None when neither flag is given."""
    if args.prefill_budget is None and args.decode_budget is None:
        return None
    return (args.prefill_budget or args.token_budget, args.decode_budget or args.token_budget)


def _shapes(args: argparse.Namespace) -> list[Shape]:
    """The (GPU, TP) shapes of --gpu and --tp, each GPU a known preset (or a spec file) and each TP a
    divisor of the model's attention heads, refused before anything runs.

    Raises:
        CliError: an unknown GPU, a TP that does not divide the heads, a GPU or TP given twice (exit 2).
    """
    from stallfree.costmodel import CostModelError
    from stallfree.costmodel.model import get_model
    from stallfree.costmodel.names import gpu_match, resolve_model
    from stallfree.sim.inputs.prices import PriceError, gpu_key
    from stallfree.sim.studies.fleet import Shape

    try:
        names = list_items(str(args.gpu))
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--gpu: {exc}", 2) from None
    if not names:
        raise CliError(f"--gpu {args.gpu!r}: give one or more GPU names", 2)
    tps = list(args.tp)
    if len(set(tps)) != len(tps):
        raise CliError(f"--tp {','.join(map(str, tps))}: a value given twice", 2)
    gpus = []
    for name in names:
        if name.endswith(".json") or len(names) == 1:
            gpus.append(name)  # one GPU: as simulate reads it (a spec file, a device name); Setup names errors
            continue
        try:
            gpus.append(gpu_key(gpu_match(name)[0]))
        except PriceError as exc:
            raise CliError(f"--gpu {name}: {exc}", 2) from None
    if len(set(gpus)) != len(gpus):
        raise CliError(f"--gpu {args.gpu}: a GPU given twice", 2)
    try:
        heads = get_model(resolve_model(str(args.model))[0]).num_heads
    except (CostModelError, ValueError):
        heads = None  # an unknown model: Setup names it, with the known ones
    if heads is not None:
        for tp in tps:
            if heads % tp:
                raise CliError(f"--tp {tp} does not divide the {heads} attention heads of {args.model}; use a "
                               f"divisor of {heads}", 2)
    return [Shape(g, tp) for g in gpus for tp in tps]


def _prices(args: argparse.Namespace, shapes: list[Shape]) -> tuple[dict[str, GpuPrice], dict[str, int]]:
    """--gpu-price or --prices, and --max-gpus, by preset name; every GPU searched priced when any is.

    Raises:
        CliError: both price options, an unknown GPU, a bad price or cap, a file without a needed column,
            a GPU searched without a price (exit 2).
    """
    from stallfree.sim.inputs.prices import PriceError, load_prices, parse_gpu_prices, parse_max_gpus

    if args.gpu_price and args.prices:
        raise CliError("--gpu-price and --prices both give prices: use one", 2)
    try:
        prices = (parse_gpu_prices(args.gpu_price) if args.gpu_price
                  else load_prices(args.prices) if args.prices else {})
        caps = parse_max_gpus(args.max_gpus) if args.max_gpus else {}
    except PriceError as exc:
        raise CliError(str(exc), 2) from None
    if prices:
        missing = sorted({s.gpu for s in shapes if _key_or_name(s.gpu) not in prices})
        if missing:
            flag = "--gpu-price" if args.gpu_price else f"--prices {args.prices}"
            raise CliError(f"{flag}: no price for {', '.join(missing)} (every GPU in --gpu needs one)", 2)
    return prices, caps


def _key_or_name(gpu: str) -> str:
    """Our preset name of `gpu` (a device name mapped as simulate maps it), or `gpu` itself (a spec file)."""
    from stallfree.costmodel.names import gpu_match
    from stallfree.sim.inputs.prices import PriceError, gpu_key

    try:
        return gpu_key(gpu_match(gpu)[0])
    except PriceError:
        return gpu


def _setups(args: argparse.Namespace, shapes: list[Shape]) -> tuple[
        list[tuple[Shape, Any]], list[tuple[Shape, str]], dict[Shape, str]]:
    """A Setup per shape whose weights and KV fit, the shapes that do not (with the reason), and what each
    shape's pricing says (fp8 weights on a GPU without FP8 units run as the GPU can: said).

    Raises:
        CliError, SetupError: as setup_from_args, when no shape can be set up (the first shape's error).
    """
    from stallfree.sim.inputs.options import SetupError
    from stallfree.sim.studies.fleet import Shape

    setups: list[tuple[Shape, Any]] = []
    skipped: list[tuple[Shape, str]] = []
    notes: dict[Shape, str] = {}
    first_error: SetupError | None = None
    for shape in shapes:
        one = copy.copy(args)
        one.gpu, one.tp = shape.gpu, shape.tp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                setup = setup_from_args(one)
            except SetupError as exc:
                if len(shapes) == 1:
                    raise
                first_error = first_error or exc
                skipped.append((Shape(_key_or_name(shape.gpu), shape.tp), f"skipped: {flag_message(exc)}"))
                continue
        key = Shape(_key_or_name(shape.gpu), shape.tp)
        said = sorted({str(w.message) for w in caught})
        if said:
            notes[key] = "; ".join(said)
        setups.append((key, setup))
    if not setups:
        assert first_error is not None
        raise first_error
    return setups, skipped, notes


def _report(fleet: FleetResult, header: dict[str, Any], args: argparse.Namespace, prices: dict[str, GpuPrice],
            setup: Setup) -> dict[str, Any]:
    """plan's --json report: today's keys (plan_report of the answer's shape: answer, bound,
    disaggregation, rows, simulations, wall_s, ...) with `answer` grown by the fleet's keys (answer_record),
    every simulated row with its gpu, tp and cost, and `runner_ups`, `shapes`, `load`, `priced`, `prices`,
    `bound_simulations` and `serve` (each side's lines for a split)."""
    from stallfree.sim.studies.capacity import PlanResult, plan_report
    from stallfree.sim.studies.fleet import answer_record, explain_load, shape_records

    outcome = answer_outcome(fleet)
    result = outcome.result if outcome is not None and outcome.result is not None else PlanResult(
        None, None, 0, 0.0, fleet.offered_rate, attainment=fleet.attainment)
    report = plan_report(result, header, args.slo_ttft, args.slo_tpot)
    report.update(
        answer=answer_record(fleet.answer), rows=fleet.rows, simulations=fleet.simulations,
        bound_simulations=fleet.bound_simulations, wall_s=fleet.wall_s, runner_ups=fleet.runner_ups,
        shapes=shape_records(fleet), load=explain_load(fleet, setup.workload.arrivals), priced=fleet.priced,
        prices={k: {"usd_per_hour": v.usd_per_hour, "source": v.source, "date": v.date} for k, v in prices.items()},
        cost_unit="usd_per_hour" if fleet.priced else "gpus",
        tokens_per_s={"input": fleet.input_tokens_per_s, "output": fleet.output_tokens_per_s},
    )
    report["gpus_per_replica"] = (answer_shape(fleet.answer).tp if fleet.answer is not None
                                  else result.gpus_per_replica)
    report["serve"] = serve_commands(args, header, fleet.answer) if fleet.answer is not None else None
    return report


def serve_lines(args: argparse.Namespace, budget: int, max_seqs: int, tp: int, extra: str = "") -> dict[str, Any]:
    """The serve lines of one replica of `tp` GPUs running `budget` tokens per step and `max_seqs`: "vllm"
    (`vllm serve`: --model when it is a Hugging Face id, else MODEL for the checkpoint; FP8 weights and KV
    as --quantization fp8 and --kv-cache-dtype fp8) and "stallfree" (`stallfree serve`, None when tp > 1:
    that engine runs on one device); `extra`, flags both engines take (tune's partial-prefill flags)."""
    model = args.model if "/" in args.model else "MODEL"
    # The weights and KV as planned: FP8 weights are vLLM's --quantization fp8 (a 4-bit dtype is the
    # checkpoint's own, which vLLM reads from it), an FP8 KV cache its --kv-cache-dtype fp8.
    precision = (" --quantization fp8" if str(args.dtype).lower() == "fp8" else "") + (
        " --kv-cache-dtype fp8" if str(getattr(args, "kv_dtype", None)).lower() == "fp8" else "")
    vllm = (f"vllm serve {model} --tensor-parallel-size {tp}{precision} --max-num-batched-tokens {budget} "
            f"--max-num-seqs {max_seqs}{extra}")
    own = f"stallfree serve --max-num-batched-tokens {budget} --max-num-seqs {max_seqs}{extra}"
    return {"vllm": vllm, "stallfree": own if tp == 1 else None}


def serve_commands(args: argparse.Namespace, header: dict[str, Any],
                   answer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The serve lines of the answer's replica: "vllm" (vLLM's flags: tensor parallelism, FP8 weights and KV as
    --quantization fp8 and --kv-cache-dtype fp8, token budget as --max-num-batched-tokens, --max-num-seqs;
    MODEL stands for the checkpoint when --model is a preset
    name rather than a Hugging Face id) and "stallfree" (`stallfree serve`, None when a replica spans
    more than one GPU: that engine runs on one device), with "tp"; for a P:D split, {"prefill": ...,
    "decode": ...}, each those keys plus "replicas"."""
    tp = answer_shape(answer).tp if answer is not None else int(args.tp[0] if isinstance(args.tp, list) else args.tp)

    def lines(budget: int, tp: int = tp) -> dict[str, Any]:
        return serve_lines(args, budget, header["max_seqs"], tp)

    if answer is None or answer["kind"] == "aggregated":
        return lines(args.token_budget)
    tp_p, tp_d = answer.get("prefill_tp") or tp, answer.get("decode_tp") or tp
    bp, bd = _side_budgets(args) or (args.token_budget, args.token_budget)
    return {"prefill": lines(bp, tp_p) | {"replicas": answer["prefill"], "tp": tp_p},
            "decode": lines(bd, tp_d) | {"replicas": answer["decode"], "tp": tp_d}}


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
