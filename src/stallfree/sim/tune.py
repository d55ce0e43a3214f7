"""SLO-driven tuning: the token budget and max_seqs that maximise goodput on a workload under a TTFT
and a TPOT objective, bounded by the cost model and then searched by simulation.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim;
numpy, matplotlib and rich lazily (the command's table, progress bar and plot).

The search (`tune`):

1. Bound. The expected load under the TPOT target: by Little's law the running decodes are
   N = arrival rate x mean decode steps per request x TPOT target (a request spends (output - 1)
   steps decoding, each at most the target), capped by max_seqs and by the requests whose KV
   reservation fits; their mean context is C = sum (o - 1)(p + (o - 2)/2) / sum (o - 1) tokens
   (a decode's context runs from p to p + o - 2; p prompt, o output tokens); a prefill chunk's
   expected offset is the token-weighted mean offset of the prompts' chunks at that budget (a fixed
   point, three rounds from offset 0). The bound is the cost model's most tokens per step within the
   TPOT target at that load: max_tokens_within(slo_tpot, N, N x C, offset). A target under the
   decode-only step time of N decodes at C tokens (the floor) is refused: no budget can meet it.
2. Candidates: the bound times 2^(k/2), k = -6..2 (1/8 to 2 times), simulated at the base max_seqs.
   The bound is an estimate (steps are not always full, and TPOT is a mean over a request's
   steps), so the ladder reaches past it.
3. Refinement around the best: the geometric midpoints to its neighbours on the ladder, and the
   best budget at the other max_seqs candidates (half and double the base by default).

The best candidate has the highest goodput (DistServe's: requests per second meeting both SLOs);
candidates within `tie_tolerance` (relative) of the highest are tied, and among them the lower
p99 TPOT wins, then the larger budget, then the base max_seqs (nothing changes that does not
help), then the larger max_seqs.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallfree._argtypes import int_list, positive_int
from stallfree.sim.costs import StepCostModel
from stallfree.sim.simulator import SchedulerConfig
from stallfree.sim.sweep import SweepPoint, run_points
from stallfree.sim.time_budget import TimeBudgetModel, time_model
from stallfree.sim.workload import Workload

__all__ = [
    "BudgetBound",
    "TargetBelowFloor",
    "TuneResult",
    "budget_bound",
    "candidate_budgets",
    "expected_load",
    "plot_tune",
    "rank",
    "register_tune",
    "run_tune",
    "serve_command",
    "tune",
]

#: The ladder of stage 2: the bound times 2^(k/2) for these k.
LADDER_EXPONENTS = tuple(range(-6, 3))
#: Candidate budgets are never above this, tokens (a cost model may allow absurd steps for a loose target).
MAX_CANDIDATE_BUDGET = 1 << 20
#: Goodputs within this fraction of the highest are tied: the end of a trace (when the last request
#: finishes) moves goodput by a few parts in 10^4 between budgets that serve the same requests.
DEFAULT_TIE_TOLERANCE = 0.001
#: Rounds of the chunk-offset fixed point of the bound.
_OFFSET_ROUNDS = 3

_ROW_KEYS = (
    "token_budget",
    "max_seqs",
    "request_goodput",
    "slo_attainment",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
    "completed",
    "rejected",
)


class TargetBelowFloor(ValueError):
    """The TPOT target is below the decode-only step time at the expected load: no budget meets it.

    Attributes:
        floor_s: that decode-only step time, s.
    """

    def __init__(self, message: str, floor_s: float) -> None:
        super().__init__(message)
        self.floor_s = floor_s


@dataclass(frozen=True, slots=True)
class BudgetBound:
    """The cost model's token budget for a TPOT target, and the load it assumed.

    Attributes:
        token_budget: the most tokens per step within the TPOT target at that load, tokens.
        num_decodes: expected running decodes (Little's law, capped), >= 1.
        decode_context: expected context of a running decode, tokens.
        chunk_start: expected offset of a prefill chunk, tokens.
        decode_floor_s: the decode-only step time at that load, s.
        step_s: the predicted time of a full step at the bound, s (<= the target).
    """

    token_budget: int
    num_decodes: int
    decode_context: int
    chunk_start: int
    decode_floor_s: float
    step_s: float


def expected_load(
    workload: Workload,
    slo_tpot: float,
    max_seqs: int,
    kv_tokens: int,
    max_tokens: int | None = None,
) -> tuple[int, int]:
    """Return (expected running decodes, their mean context in tokens) under the TPOT target.

    N = mean_rate x mean(o - 1) x slo_tpot rounded up, at least 1, at most max_seqs and at most
    kv_tokens / mean(p + o) (the requests whose reservation fits at once); with every request
    arriving at once, N = min(requests, max_seqs). C = sum (o - 1)(p + (o - 2) / 2) / sum (o - 1),
    rounded. o is min(output, max_tokens).

    Raises:
        ValueError: an empty workload, or slo_tpot <= 0.
    """
    if not len(workload):
        raise ValueError("the workload has no requests")
    if not slo_tpot > 0:
        raise ValueError(f"slo_tpot must be > 0 seconds, got {slo_tpot!r}")
    outs = [min(o, max_tokens) if max_tokens else o for o in workload.output_lens]
    prompts = workload.prompt_lens
    n = len(outs)
    steps = sum(o - 1 for o in outs)
    rate = workload.mean_rate
    num = float(n) if math.isinf(rate) else rate * steps / n * slo_tpot
    fit = kv_tokens / ((sum(prompts) + sum(outs)) / n)
    num_decodes = max(1, min(math.ceil(num - 1e-9), max_seqs, max(1, int(fit))))
    if steps == 0:
        return num_decodes, round(sum(prompts) / n)
    ctx = sum((o - 1) * (p + (o - 2) / 2) for p, o in zip(prompts, outs, strict=True)) / steps
    return num_decodes, round(ctx)


def _mean_chunk_start(prompts: Sequence[int], chunk: int) -> int:
    """Token-weighted mean offset of the chunks of `chunk` tokens that cut each prompt, tokens."""
    total = weighted = 0
    for p in prompts:
        q, r = divmod(p, chunk)
        # full chunks start at 0, c, ..., (q-1)c; the remainder r starts at qc
        weighted += chunk * chunk * q * (q - 1) // 2 + r * q * chunk
        total += p
    return round(weighted / total) if total else 0


def budget_bound(
    cost_model: StepCostModel,
    workload: Workload,
    slo_tpot: float,
    max_seqs: int,
    kv_tokens: int,
    max_tokens: int | None = None,
) -> BudgetBound:
    """Return the cost model's token budget for the TPOT target at the workload's expected load.

    Raises:
        TargetBelowFloor: slo_tpot is below the decode-only step time at the expected load (the
            message names that floor in ms and the load).
        ValueError: an empty workload, or slo_tpot <= 0.
    """
    nd, ctx = expected_load(workload, slo_tpot, max_seqs, kv_tokens, max_tokens)
    tm: TimeBudgetModel = time_model(cost_model)
    floor = tm.decode_step_time(nd, ctx)
    if tm.max_tokens_within(slo_tpot, nd, nd * ctx, 0) == 0:
        raise TargetBelowFloor(
            f"TPOT target {slo_tpot * 1e3:g} ms is below the decode-only step time, {floor * 1e3:.1f} ms "
            f"({nd} decodes at {ctx:,} tokens of context, the expected load): no token budget can meet it",
            floor,
        )
    start, budget = 0, 0
    for _ in range(_OFFSET_ROUNDS):
        budget = max(tm.max_tokens_within(slo_tpot, nd, nd * ctx, start), nd)
        new_start = _mean_chunk_start(workload.prompt_lens, max(budget - nd, 1))
        if new_start == start:
            break
        start = new_start
    budget = max(tm.max_tokens_within(slo_tpot, nd, nd * ctx, start), 1)
    budget = min(budget, MAX_CANDIDATE_BUDGET)
    step = _full_step_time(tm, budget, nd, ctx, start)
    return BudgetBound(budget, nd, ctx, start, floor, step)


def _full_step_time(tm: TimeBudgetModel, budget: int, nd: int, ctx: int, start: int) -> float:
    from stallfree.core.plan import ScheduledChunk, StepPlan

    chunk = budget - nd
    prefills = (ScheduledChunk(None, chunk, True, start, True),) if chunk > 0 else ()
    plan = StepPlan(0, (None,) * nd, (0,) * nd, prefills, max(budget, nd), nd * ctx, max(budget, nd))
    return tm.step_time(plan)


def _nice(x: float) -> int:
    """Round a budget for display and reuse: to 16 tokens from 128 up, else to a token."""
    return max(16, int(round(x / 16)) * 16) if x >= 128 else max(1, int(round(x)))


def candidate_budgets(bound: int) -> list[int]:
    """Return the stage-2 ladder: the bound itself and bound x 2^(k/2), k = -6..2, rounded, distinct,
    ascending, at most MAX_CANDIDATE_BUDGET.

    Raises:
        ValueError: bound < 1.
    """
    if bound < 1:
        raise ValueError(f"bound must be >= 1 token, got {bound!r}")
    out = {bound}
    for k in LADDER_EXPONENTS:
        if k:
            out.add(_nice(bound * 2 ** (k / 2)))
    return sorted(b for b in out if b <= MAX_CANDIDATE_BUDGET)


def _refined(best: int, tried: Sequence[int]) -> list[int]:
    """Geometric midpoints between `best` and its nearest tried neighbours, if not tried yet."""
    lower = [b for b in tried if b < best]
    upper = [b for b in tried if b > best]
    out = []
    for other in (max(lower) if lower else None, min(upper) if upper else None):
        if other is not None:
            mid = _nice(math.sqrt(best * other))
            if mid not in tried and mid != best and mid not in out:
                out.append(mid)
    return out


def rank(
    rows: Sequence[dict[str, Any]],
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    base_max_seqs: int | None = None,
) -> list[dict[str, Any]]:
    """Order candidates best first.

    The rows whose goodput is within `tie_tolerance` (relative) of the highest are tied and come
    first, by lower p99 TPOT, then larger token budget, then `base_max_seqs` before other max_seqs,
    then larger max_seqs; the others follow by goodput (highest first), with the same tie-breaks.
    A missing goodput counts as 0, a missing p99 TPOT as infinite.

    Args:
        rows: dicts with token_budget, max_seqs, request_goodput and p99_tpot_ms.
        tie_tolerance: in [0, 1).
        base_max_seqs: the max_seqs kept when others do no better (the user's own), or None.

    Raises:
        ValueError: tie_tolerance outside [0, 1).
    """
    if not 0 <= tie_tolerance < 1:
        raise ValueError(f"tie_tolerance must be in [0, 1), got {tie_tolerance!r}")
    if not rows:
        return []

    def goodput(row: dict[str, Any]) -> float:
        return float(row.get("request_goodput") or 0.0)

    def key(row: dict[str, Any]) -> tuple[float, int, bool, int]:
        tpot = row.get("p99_tpot_ms")
        m = row["max_seqs"]
        return (math.inf if tpot is None else tpot, -row["token_budget"], m != base_max_seqs, -m)

    top = max(goodput(r) for r in rows)
    tied = [r for r in rows if goodput(r) >= top * (1 - tie_tolerance)]
    rest = [r for r in rows if goodput(r) < top * (1 - tie_tolerance)]
    return sorted(tied, key=key) + sorted(rest, key=lambda r: (-goodput(r), *key(r)))


@dataclass(slots=True)
class TuneResult:
    """What `tune` found.

    Attributes:
        bound: the cost model's bound (None when the budgets were given).
        rows: one summary per simulated candidate (report.summarize_result keys plus token_budget
            and max_seqs), ranked best first.
        slo_ttft: the TTFT objective, s.
        slo_tpot: the TPOT objective, s.
        wall_s: time spent simulating, s.
        stages: simulations per stage, in order (the ladder, then the refinement; one stage for
            explicit budgets).
    """

    bound: BudgetBound | None
    rows: list[dict[str, Any]]
    slo_ttft: float
    slo_tpot: float
    wall_s: float = 0.0
    stages: list[int] = field(default_factory=list)

    @property
    def best(self) -> dict[str, Any]:
        """The chosen candidate's summary."""
        return self.rows[0]


def tune(
    workload: Workload,
    kv_tokens: int,
    cost_model: StepCostModel,
    slo_ttft: float,
    slo_tpot: float,
    *,
    max_seqs: int = 256,
    max_seqs_candidates: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
    max_tokens: int | None = None,
    jobs: int = 1,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    """Find the token budget and max_seqs with the highest goodput under the SLOs (module docstring).

    Args:
        workload: the requests at the rate to tune for.
        kv_tokens: KV cache capacity, tokens.
        cost_model: prices steps, s (a CostModel, or any step_time model: see time_budget.time_model).
        slo_ttft: TTFT objective, s (> 0).
        slo_tpot: TPOT objective, s (> 0).
        max_seqs: the base max_seqs of the budget ladder.
        max_seqs_candidates: max_seqs values tried at the best budget (default: half and double
            the base).
        budgets: explicit budgets, tokens: then every (budget, max_seqs) pair is simulated, with no
            bound and no refinement.
        max_tokens: every request's max_new, or None for its output length.
        jobs: worker processes.
        tie_tolerance: relative goodput difference counted as a tie (see rank).
        progress: called with (finished, planned) simulations after each one.

    Returns:
        A TuneResult; its rows are ranked, the chosen one first.

    Raises:
        TargetBelowFloor: the TPOT target is below the decode-only floor (without explicit budgets).
        ValueError: an SLO <= 0, an empty workload, or an empty budget list.
    """
    for name, slo in (("slo_ttft", slo_ttft), ("slo_tpot", slo_tpot)):
        if not (isinstance(slo, int | float) and slo > 0):
            raise ValueError(f"{name} must be > 0 seconds, got {slo!r}")
    if budgets is not None and not budgets:
        raise ValueError("budgets: give at least one token budget")
    others = list(max_seqs_candidates) if max_seqs_candidates is not None else [max(1, max_seqs // 2), max_seqs * 2]
    seqs_all = sorted({max_seqs, *others})
    runner = _Runner(workload, kv_tokens, cost_model, slo_ttft, slo_tpot, max_tokens, jobs, progress)
    t0 = time.perf_counter()
    bound = None
    if budgets is not None:
        runner.planned = len(budgets) * len(seqs_all)
        runner.run([(b, m) for b in sorted(set(budgets)) for m in seqs_all])
    else:
        bound = budget_bound(cost_model, workload, slo_tpot, max_seqs, kv_tokens, max_tokens)
        ladder = candidate_budgets(bound.token_budget)
        runner.planned = len(ladder) + 2 + len([m for m in seqs_all if m != max_seqs])
        runner.run([(b, max_seqs) for b in ladder])
        best = rank(runner.rows, tie_tolerance, max_seqs)[0]["token_budget"]
        stage2 = [(b, max_seqs) for b in _refined(best, ladder)]
        stage2 += [(best, m) for m in seqs_all if m != max_seqs]
        runner.planned = runner.done + len(stage2)
        runner.run(stage2)
    return TuneResult(
        bound=bound,
        rows=rank(runner.rows, tie_tolerance, max_seqs),
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
        wall_s=time.perf_counter() - t0,
        stages=runner.stages,
    )


class _Runner:
    """Runs batches of (budget, max_seqs) candidates through the sweep's worker pool."""

    def __init__(
        self,
        workload: Workload,
        kv_tokens: int,
        cost_model: StepCostModel,
        slo_ttft: float,
        slo_tpot: float,
        max_tokens: int | None,
        jobs: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.workload, self.kv_tokens, self.cost_model = workload, kv_tokens, cost_model
        self.slo_ttft, self.slo_tpot, self.max_tokens = slo_ttft, slo_tpot, max_tokens
        self.jobs, self.progress = jobs, progress
        self.rows: list[dict[str, Any]] = []
        self.done = 0
        self.planned = 0
        self.stages: list[int] = []

    def run(self, pairs: Sequence[tuple[int, int]]) -> None:
        points = [
            SweepPoint(
                self.workload,
                1.0,
                SchedulerConfig(self.kv_tokens, b, m),
                self.cost_model,
                self.max_tokens,
                self.slo_ttft,
                self.slo_tpot,
            )
            for b, m in pairs
        ]
        base = self.done

        def tick(k: int) -> None:
            self.done = base + k
            if self.progress:
                self.progress(self.done, max(self.planned, self.done))

        for row in run_points(points, self.jobs, tick):
            row.pop("ttft_ms", None)
            row.pop("tpot_ms", None)
            self.rows.append(row)
        self.done = base + len(points)
        self.stages.append(len(points))


# ------------------------------------------------------------------------------------ the command


def register_tune(subparsers: Any) -> None:
    """Add the `tune` subcommand (called by stallfree.sim.cli.register)."""
    from stallfree.sim import cli

    p = subparsers.add_parser(
        "tune",
        help="pick the token budget and max_seqs that maximise goodput under TTFT and TPOT SLOs",
        description="Bound the token budget with the cost model (the largest whose step stays under the "
        "TPOT target at the workload's expected load), then simulate candidates around it in parallel "
        "and pick the highest goodput (ties: lower p99 TPOT, then larger budget). Prints the serve flags.",
    )
    cli._add_common(p)
    t = p.add_argument_group("search")
    t.add_argument("--budgets", type=int_list, metavar="LIST", help="simulate these budgets only (no bound)")
    t.add_argument(
        "--max-seqs-candidates",
        type=int_list,
        metavar="LIST",
        help="max_seqs values tried at the best budget (default: half and double --max-seqs)",
    )
    t.add_argument("--jobs", type=positive_int, metavar="N", help="worker processes (default: CPUs)")
    t.add_argument(
        "--tie-tolerance",
        type=float,
        default=DEFAULT_TIE_TOLERANCE,
        metavar="F",
        help=f"goodputs within this fraction of the best are tied, and the lower p99 TPOT wins "
        f"(default {DEFAULT_TIE_TOLERANCE:g}; 0.01 trades up to 1%% of goodput for TPOT headroom)",
    )
    t.add_argument("--top", type=positive_int, default=6, metavar="N", help="rows to print (default 6)")
    p.set_defaults(func=cli._guard(run_tune))


def run_tune(args: argparse.Namespace) -> int:
    """`stallfree tune`: bound, search, print the choice and the runners-up; --out writes a plot."""
    import json
    import os

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stallfree.sim.cli import CliError, Setup

    if args.slo_ttft is None or args.slo_tpot is None:
        raise CliError("tune needs both --slo-ttft and --slo-tpot", 2)
    if not 0 <= args.tie_tolerance < 1:
        raise CliError(f"--tie-tolerance must be in [0, 1), got {args.tie_tolerance!r}", 2)
    setup = Setup(args)
    jobs = args.jobs or os.cpu_count() or 1
    with Progress(
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
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
                jobs=jobs,
                tie_tolerance=args.tie_tolerance,
                progress=lambda k, n: bar.update(task, completed=k, total=n),
            )
        except TargetBelowFloor as exc:
            raise CliError(str(exc), 2) from None
    header = setup.header()
    if args.json:
        print(json.dumps(_report(result, header), indent=1))
    else:
        _print_result(result, header, args.top)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.json").write_text(json.dumps(_report(result, header), indent=1) + "\n")
        plot_tune(result, args.out / "tune.png")
        print(f"wrote {args.out}/tune.json, tune.png")
    return 0


def serve_command(row: dict[str, Any]) -> str:
    """The `stallfree serve` flags of a chosen candidate."""
    return f"stallfree serve --token-budget {row['token_budget']} --max-seqs {row['max_seqs']}"


def _report(result: TuneResult, header: dict[str, Any]) -> dict[str, Any]:
    bound = None
    if result.bound is not None:
        b = result.bound
        bound = {
            "token_budget": b.token_budget,
            "num_decodes": b.num_decodes,
            "decode_context": b.decode_context,
            "chunk_start": b.chunk_start,
            "decode_floor_ms": b.decode_floor_s * 1e3,
            "step_ms": b.step_s * 1e3,
        }
    return {
        "header": header,
        "slo_ttft_s": result.slo_ttft,
        "slo_tpot_s": result.slo_tpot,
        "bound": bound,
        "chosen": {k: result.best.get(k) for k in _ROW_KEYS},
        "serve": serve_command(result.best),
        "rows": [{k: r.get(k) for k in _ROW_KEYS} for r in result.rows],
        "wall_s": result.wall_s,
    }


def _print_result(result: TuneResult, header: dict[str, Any], top: int) -> None:
    from rich.table import Table

    from stallfree.sim.report import console

    print(
        f"{header['workload']}: {header['requests']:,} requests, rate scale {header['rate_scale']:g} "
        f"({header['offered_rate']:.2f} req/s offered); {header['hardware']}; KV {header['kv_tokens']:,} tokens"
    )
    print(f"SLOs: TTFT <= {result.slo_ttft * 1e3:g} ms, TPOT <= {result.slo_tpot * 1e3:g} ms")
    if result.bound is not None:
        b = result.bound
        print(
            f"cost-model bound: token budget {b.token_budget:,} (a full step {b.step_s * 1e3:.1f} ms at "
            f"{b.num_decodes} decodes x {b.decode_context:,} tokens of context, chunks at offset "
            f"{b.chunk_start:,}; decode-only {b.decode_floor_s * 1e3:.1f} ms)"
        )
    print(f"simulated {len(result.rows)} candidates in {result.wall_s:.1f} s")
    cols = (
        ("token_budget", "budget", "{:,}"),
        ("max_seqs", "max_seqs", "{:,}"),
        ("request_goodput", "goodput", "{:.2f}"),
        ("slo_attainment", "in SLO", "{:.1%}"),
        ("median_ttft_ms", "TTFT p50", "{:,.0f}"),
        ("p99_ttft_ms", "TTFT p99", "{:,.0f}"),
        ("median_tpot_ms", "TPOT p50", "{:.1f}"),
        ("p99_tpot_ms", "TPOT p99", "{:.1f}"),
    )
    table = Table(title="candidates, best first (goodput in req/s, latencies in ms)", title_justify="left")
    table.add_column("")
    for _, name, _ in cols:
        table.add_column(name, justify="right", no_wrap=True)
    for i, row in enumerate(result.rows[:top]):
        cells = ("-" if row.get(k) is None else spec.format(row[k]) for k, _, spec in cols)
        table.add_row("chosen" if i == 0 else f"#{i + 1}", *cells)
    console().print(table)
    best = result.best
    print(
        f"chosen: token budget {best['token_budget']:,}, max_seqs {best['max_seqs']}: goodput "
        f"{best.get('request_goodput') or 0:.2f} req/s ({best.get('slo_attainment') or 0:.1%} within the SLOs)"
    )
    print(serve_command(best))


def plot_tune(result: TuneResult, path: Path) -> None:
    """Write goodput and p99 TPOT against the token budget (a line per max_seqs) to `path` (PNG).

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (ax_g, ax_t) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    for m in sorted({r["max_seqs"] for r in result.rows}):
        rows = sorted((r for r in result.rows if r["max_seqs"] == m), key=lambda r: r["token_budget"])
        xs = [r["token_budget"] for r in rows]
        style = "o-" if len(rows) > 1 else "s"
        ax_g.plot(xs, [r.get("request_goodput") or 0 for r in rows], style, label=f"max_seqs {m}")
        ax_t.plot(xs, [r.get("p99_tpot_ms") or math.nan for r in rows], style, label=f"max_seqs {m}")
    best = result.best
    ax_g.plot(
        [best["token_budget"]],
        [best.get("request_goodput") or 0],
        "*",
        ms=16,
        color="black",
        label=f"chosen: {best['token_budget']:,} / {best['max_seqs']}",
    )
    ax_t.axhline(result.slo_tpot * 1e3, ls="--", color="gray", label="TPOT SLO")
    if result.bound is not None:
        for ax in (ax_g, ax_t):
            ax.axvline(result.bound.token_budget, ls=":", color="tab:red")
        ax_g.plot([], [], ls=":", color="tab:red", label=f"cost-model bound {result.bound.token_budget:,}")
    ax_g.set_ylabel("goodput (req/s within both SLOs)")
    ax_t.set_ylabel("p99 TPOT (ms)")
    ax_t.set_xlabel("token budget (tokens per step)")
    ax_t.set_xscale("log")
    ax_t.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_t.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_t.xaxis.set_minor_formatter(NullFormatter())
    ax_g.set_title(f"tune: TTFT <= {result.slo_ttft * 1e3:g} ms, TPOT <= {result.slo_tpot * 1e3:g} ms")
    for ax in (ax_g, ax_t):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
