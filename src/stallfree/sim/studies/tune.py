"""SLO-driven tuning: the token budget and max_seqs that maximise goodput on a workload under a TTFT
and a TPOT objective, bounded by the cost model (stallfree.sim.studies.tune_bound) and then searched by
simulation. The command (stallfree.sim.commands.tune) prints the result; plots.plot_tune draws it.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim;
numpy lazily (the summaries).

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
4. Only with `search_partial_prefills=True`: concurrent partial prefills at the best budget and
   max_seqs so far, (K, L, T) in `partial_prefill_candidates(budget)`: K = 2 and 4 prompts
   partially prefilled at once, L = K or 1 of them long, T = budget / 8 or budget / 4 (a long
   prompt's share of a step with decodes; docs/scheduling.md, "Long prompts"). Short prompts then
   pass long ones, which helps the TTFT objective when prompts are long and mixed.

The best candidate has the highest goodput (DistServe's: requests per second meeting both SLOs);
candidates within `tie_tolerance` (relative) of the highest are tied, and among them the lower
p99 TPOT wins, then the larger budget, then the base max_seqs (nothing changes that does not
help), then no partial prefills before some (then fewer: smaller K, L, T), then the larger max_seqs.

Example (the Python API; docs/tuning.md has more)::

    from stallfree.sim.inputs.setup import HardwareOptions, Setup, WorkloadOptions
    from stallfree.sim.studies.tune import tune

    setup = Setup(WorkloadOptions(num_requests=500), HardwareOptions())
    result = tune(setup.workload, setup.kv_tokens, setup.cost_model, slo_ttft=1.0, slo_tpot=0.05)
    print(result.best["token_budget"], result.best["max_seqs"], result.slo_met)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stallfree.core.config import SchedulerConfig
from stallfree.core.errors import InvalidConfig
from stallfree.core.policies import check_partial_prefills
from stallfree.sim.defaults import DEFAULT_MAX_SEQS, DEFAULT_TIE_TOLERANCE
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.studies.executors import Executor
from stallfree.sim.studies.sweep import SweepPoint, run_points
from stallfree.sim.studies.tune_bound import (
    LADDER_EXPONENTS,
    MAX_CANDIDATE_BUDGET,
    BudgetBound,
    TargetBelowFloor,
    budget_bound,
    candidate_budgets,
    expected_load,
    nice_budget,
)

__all__ = [
    "BudgetBound",
    "DEFAULT_TIE_TOLERANCE",
    "LADDER_EXPONENTS",
    "MAX_CANDIDATE_BUDGET",
    "ROW_KEYS",
    "TargetBelowFloor",
    "TuneResult",
    "attainment_over_all",
    "budget_bound",
    "candidate_budgets",
    "check_partial_prefill_flags",
    "expected_load",
    "partial_prefill_candidates",
    "rank",
    "tune",
]

ROW_KEYS = (
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
    "rejected_by_reason",
    "partial_prefills",
)


def check_partial_prefill_flags(
    k: int, lng: int | None, thr: int | None, block_size: int | None = None
) -> str | None:
    """The partial-prefill options of a tune checked as the scheduler will
    (stallfree.core.policies.check_partial_prefills) before any run: K = max_num_partial_prefills,
    L = max_long_partial_prefills, T = long_prefill_token_threshold in tokens (a missing T with K > 1
    passes: the runs then take 4% of the context length), `block_size` the chunk alignment or None.

    Returns:
        None when they are fine, else the scheduler's message naming the fields and values (the
        commands word it in flags: stallfree._argtypes.partial_prefill_flag_problem).
    """
    try:
        check_partial_prefills(k, lng, thr if thr is not None or k == 1 else (block_size or 1), block_size)
    except InvalidConfig as exc:
        return str(exc)
    return None


def _refined(best: int, tried: Sequence[int]) -> list[int]:
    """Geometric midpoints between `best` and its nearest tried neighbours, if not tried yet."""
    lower = [b for b in tried if b < best]
    upper = [b for b in tried if b > best]
    out = []
    for other in (max(lower) if lower else None, min(upper) if upper else None):
        if other is not None:
            mid = nice_budget(math.sqrt(best * other))
            if mid not in tried and mid != best and mid not in out:
                out.append(mid)
    return out


def partial_prefill_candidates(token_budget: int) -> list[tuple[int, int, int]]:
    """The (K, L, T) settings stage 4 of `tune` simulates at a budget: (2, 2, T8), (4, 4, T8),
    (4, 1, T8), (4, 4, T4) with T8 = budget // 8 and T4 = budget // 4 (at least 1 token each);
    duplicates dropped, in that order.

    T is a fraction of the budget because it is the most a long prompt takes in a step with decodes:
    at budget / 8 a step carrying a chunk deep into a long prompt stays near a short-context step's
    time (the measurement in docs/scheduling.md, "Long prompts"); budget / 4 is the next rung.

    Raises:
        ValueError: token_budget < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget!r}")
    t8, t4 = max(1, token_budget // 8), max(1, token_budget // 4)
    out: list[tuple[int, int, int]] = []
    for c in ((2, 2, t8), (4, 4, t8), (4, 1, t8), (4, 4, t4)):
        if c not in out:
            out.append(c)
    return out


def rank(
    rows: Sequence[dict[str, Any]],
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    base_max_seqs: int | None = None,
) -> list[dict[str, Any]]:
    """Order candidates best first.

    The rows whose goodput is within `tie_tolerance` (relative) of the highest are tied and come
    first, by lower p99 TPOT, then larger token budget, then no partial prefills before some (then
    smaller (K, L, T)), then `base_max_seqs` before other max_seqs, then larger max_seqs; the others
    follow by goodput (highest first), with the same tie-breaks. A missing goodput counts as 0, a
    missing p99 TPOT as infinite.

    Args:
        rows: dicts with token_budget, max_seqs, request_goodput and p99_tpot_ms (and optionally
            partial_prefills: None or (K, L, T)).
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

    def key(row: dict[str, Any]) -> tuple[float, int, tuple[int, ...], bool, int]:
        tpot = row.get("p99_tpot_ms")
        m = row["max_seqs"]
        pp = row.get("partial_prefills")
        return (math.inf if tpot is None else tpot, -row["token_budget"], (1, *pp) if pp else (),
                m != base_max_seqs, -m)

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
        attainment_target: the share of all requests that must meet both SLOs for the best candidate
            to be recommended, in (0, 1] (`tune --slo-attainment`, as `plan`'s; default 0.99).
    """

    bound: BudgetBound | None
    rows: list[dict[str, Any]]
    slo_ttft: float
    slo_tpot: float
    wall_s: float = 0.0
    stages: list[int] = field(default_factory=list)
    attainment_target: float = 0.99

    @property
    def best(self) -> dict[str, Any]:
        """The chosen candidate's summary (the best found, even when it meets no SLO)."""
        return self.rows[0]

    @property
    def slo_met(self) -> bool:
        """Whether the best candidate serves any request within both SLOs (goodput > 0)."""
        return bool(self.rows) and (self.best.get("request_goodput") or 0.0) > 0.0

    @property
    def attainment(self) -> float:
        """The best candidate's share of all requests within both SLOs (a refused request misses):
        its slo_attainment (over completed requests) x completed / num_requests; 0 without rows."""
        if not self.rows:
            return 0.0
        return attainment_over_all(self.best)

    @property
    def attainment_met(self) -> bool:
        """Whether the best candidate's attainment reaches attainment_target (tune exits 3 otherwise)."""
        return self.slo_met and self.attainment >= self.attainment_target


def attainment_over_all(row: dict[str, Any]) -> float:
    """A summary's share of all its requests within both SLOs: slo_attainment x completed / num_requests
    (num_requests: completed + rejected when the summary has none); 0 for no request."""
    done = int(row.get("completed") or 0)
    n = int(row.get("num_requests") or done + int(row.get("rejected") or 0))
    return float(row.get("slo_attainment") or 0.0) * done / n if n else 0.0


def _max_seqs_tried(max_seqs: int, candidates: Sequence[int] | None) -> list[int]:
    """The max_seqs values of a tune, ascending: the base and `candidates` (default half and double it)."""
    others = list(candidates) if candidates is not None else [max(1, max_seqs // 2), max_seqs * 2]
    return sorted({max_seqs, *others})


def _grid_stage(runner: _Runner, budgets: Sequence[int], seqs_all: Sequence[int]) -> None:
    """tune with explicit budgets: every (budget, max_seqs) pair, with no bound and no refinement."""
    runner.planned = len(budgets) * len(seqs_all)
    runner.run([(b, m) for b in sorted(set(budgets)) for m in seqs_all])


def _partial_prefill_stage(runner: _Runner, tie_tolerance: float, max_seqs: int) -> None:
    """tune's last stage with search_partial_prefills: each of partial_prefill_candidates(budget) at the
    best budget and max_seqs ranked so far."""
    best_row = rank(runner.rows, tie_tolerance, max_seqs)[0]
    b, m = best_row["token_budget"], best_row["max_seqs"]
    runner.planned = runner.done + len(partial_prefill_candidates(b))
    runner.run([(b, m, c) for c in partial_prefill_candidates(b)])


def tune(
    workload: Workload, kv_tokens: int, cost_model: StepCostModel, slo_ttft: float, slo_tpot: float, *,
    max_seqs: int = DEFAULT_MAX_SEQS, max_seqs_candidates: Sequence[int] | None = None,
    budgets: Sequence[int] | None = None,
    max_tokens: int | None = None, jobs: int | Executor = 1, tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    progress: Callable[[int, int], None] | None = None, max_model_len: int | None = None,
    cut_output_to_fit: bool = False, search_partial_prefills: bool = False,
    partial_prefills: tuple[int, int, int] | None = None, async_scheduling: bool = False,
    scheduler: SchedulerConfig | None = None,
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
        jobs: worker processes, or a stallfree.sim.studies.executors executor.
        tie_tolerance: relative goodput difference counted as a tie (see rank).
        progress: called with (finished, planned) simulations after each one.
        max_model_len: the context length requests are checked against, tokens (over it: refused at
            arrival, kind "context_length"), or None for no limit.
        cut_output_to_fit: cut max_new to fit the context length instead of refusing.
        search_partial_prefills: also simulate partial_prefill_candidates(budget) at the best budget
            and max_seqs found (one more stage; rows carry partial_prefills = (K, L, T) or None).
        partial_prefills: (K, L, T) of every run but those of that stage, or None (one partial
            prefill, the contract).
        async_scheduling: every run's ReplicaConfig.async_scheduling (vLLM's asynchronous
            scheduling, docs/simulator.md); default off.
        scheduler: the SchedulerConfig every run starts from (its budget, max_seqs, KV capacity and
            partial-prefill limits are each run's; its other fields, e.g. the KV policy, are kept), or
            None for the contract's defaults.

    Returns:
        A TuneResult; its rows are ranked, the chosen one first.

    Raises:
        TargetBelowFloor: the TPOT target is below the decode-only floor (without explicit budgets).
        ValueError: an SLO <= 0, an empty workload, or an empty budget list.
    """
    _check_request(slo_ttft, slo_tpot, budgets)
    seqs_all = _max_seqs_tried(max_seqs, max_seqs_candidates)
    runner = _Runner(workload, kv_tokens, cost_model, slo_ttft, slo_tpot, max_tokens, jobs, progress)
    runner.context = (max_model_len, cut_output_to_fit)
    runner.partial_prefills = partial_prefills
    runner.async_scheduling = async_scheduling
    runner.base = scheduler or SchedulerConfig(1, 1, kv_tokens)
    t0 = time.perf_counter()
    bound = None
    if budgets is not None:
        _grid_stage(runner, budgets, seqs_all)
    else:
        bound = budget_bound(cost_model, workload, slo_tpot, max_seqs, kv_tokens, max_tokens)
        _search_ladder(runner, candidate_budgets(bound.token_budget), max_seqs, seqs_all, tie_tolerance)
    if search_partial_prefills:
        _partial_prefill_stage(runner, tie_tolerance, max_seqs)
    return TuneResult(bound=bound, rows=rank(runner.rows, tie_tolerance, max_seqs), slo_ttft=slo_ttft,
                      slo_tpot=slo_tpot, wall_s=time.perf_counter() - t0, stages=runner.stages)


def _check_request(slo_ttft: float, slo_tpot: float, budgets: Sequence[int] | None) -> None:
    """Raise ValueError for an SLO that is not > 0 s or an empty budget list."""
    for name, slo in (("slo_ttft", slo_ttft), ("slo_tpot", slo_tpot)):
        if not (isinstance(slo, int | float) and slo > 0):
            raise ValueError(f"{name} must be > 0 seconds, got {slo!r}")
    if budgets is not None and not budgets:
        raise ValueError("budgets: give at least one token budget")


def _search_ladder(
    runner: _Runner, ladder: list[int], max_seqs: int, seqs_all: list[int], tie_tolerance: float
) -> None:
    """Stages 1 and 2 of the search (module docstring): the ladder at the base max_seqs, then the
    midpoints around the best and the best budget at the other max_seqs."""
    runner.planned = len(ladder) + 2 + len([m for m in seqs_all if m != max_seqs])
    runner.run([(b, max_seqs) for b in ladder])
    best = rank(runner.rows, tie_tolerance, max_seqs)[0]["token_budget"]
    stage2 = [(b, max_seqs) for b in _refined(best, ladder)]
    stage2 += [(best, m) for m in seqs_all if m != max_seqs]
    runner.planned = runner.done + len(stage2)
    runner.run(stage2)


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
        jobs: int | Executor,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.workload, self.kv_tokens, self.cost_model = workload, kv_tokens, cost_model
        self.slo_ttft, self.slo_tpot, self.max_tokens = slo_ttft, slo_tpot, max_tokens
        self.jobs, self.progress = jobs, progress
        self.rows: list[dict[str, Any]] = []
        self.done = 0
        self.planned = 0
        self.stages: list[int] = []
        self.context: tuple[int | None, bool] = (None, False)
        self.partial_prefills: tuple[int, int, int] | None = None
        self.async_scheduling = False
        self.base = SchedulerConfig(1, 1, kv_tokens)

    def run(self, pairs: Sequence[tuple[int, int] | tuple[int, int, tuple[int, int, int]]]) -> None:
        """Simulate (budget, max_seqs[, (K, L, T)]) candidates and keep their summaries."""
        configs = [
            ReplicaConfig(self.base.replace(
                token_budget=p[0], max_seqs=p[1], kv_tokens=self.kv_tokens,
                **partial_prefill_options(p[2] if len(p) > 2 else self.partial_prefills)),
                async_scheduling=self.async_scheduling)
            for p in pairs
        ]
        points = [
            SweepPoint(
                self.workload,
                1.0,
                config,
                self.cost_model,
                self.max_tokens,
                self.slo_ttft,
                self.slo_tpot,
                *self.context,
            )
            for config in configs
        ]
        base = self.done

        def tick(k: int) -> None:
            self.done = base + k
            if self.progress:
                self.progress(self.done, max(self.planned, self.done))

        for config, row in zip(configs, run_points(points, self.jobs, tick), strict=True):
            row.pop("ttft_ms", None)
            row.pop("tpot_ms", None)
            limits = config.scheduler.partial_prefill_limits
            row["partial_prefills"] = limits if limits[0] > 1 else None
            self.rows.append(row)
        self.done = base + len(points)
        self.stages.append(len(points))


def chosen_range(
    result: TuneResult,
    workload: Workload,
    kv_tokens: int,
    cost_model: StepCostModel,
    *,
    max_tokens: int | None = None,
    jobs: int | Executor = 1,
    max_model_len: int | None = None,
    cut_output_to_fit: bool = False,
    async_scheduling: bool = False,
    scheduler: SchedulerConfig | None = None,
) -> dict[str, list[float] | None]:
    """The range of the chosen candidate's latencies (stallfree.sim.studies.ranges): the same configuration replayed
    with every step scaled by STEP_TIME_LOW and STEP_TIME_HIGH; arguments as tune's.

    Returns:
        {key: [low, high] (ms) or None} for each key of stallfree.sim.studies.ranges.RANGE_KEYS.
    """
    from stallfree.sim.studies.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, run_range

    best = result.best
    pp = best.get("partial_prefills")
    pair: tuple[int, int] | tuple[int, int, tuple[int, int, int]] = (
        (best["token_budget"], best["max_seqs"], (int(pp[0]), int(pp[1]), int(pp[2] or 1))) if pp
        else (best["token_budget"], best["max_seqs"]))
    scaled = []
    for factor in (STEP_TIME_LOW, STEP_TIME_HIGH):
        runner = _Runner(workload, kv_tokens, ScaledCost(cost_model, factor), result.slo_ttft, result.slo_tpot,
                         max_tokens, jobs, None)
        runner.context = (max_model_len, cut_output_to_fit)
        runner.async_scheduling = async_scheduling
        runner.base = scheduler or SchedulerConfig(1, 1, kv_tokens)
        runner.run([pair])
        scaled.append(runner.rows[0])
    return run_range(best, scaled)


def partial_prefill_options(limits: tuple[int, int, int] | None) -> dict[str, Any]:
    """SchedulerConfig's partial-prefill fields of (K, L, T), or the contract's (K = 1) for None."""
    if limits is None:
        return {"max_num_partial_prefills": 1, "max_long_partial_prefills": None, "long_prefill_token_threshold": None}
    k, lng, thr = limits
    return {"max_num_partial_prefills": k, "max_long_partial_prefills": lng, "long_prefill_token_threshold": thr}
