"""The buying question: the cheapest fleet meeting the SLOs across GPU types, tensor parallelism and
serving shapes (aggregated replicas or a P:D split), in dollars per hour, or in GPUs without prices.
`stallfree plan --gpu A,B --tp 1,2,4` prints it (stallfree.sim.commands.plan).

Imports allowed: the standard library and stallfree.sim.

The search (`plan_fleet`), over shapes (GPU type, TP) whose weights and KV fit:

1. Bound every shape before simulating: one replica's saturated throughput mu_1 gives
   N0 = ceil(rate / mu_1) replicas, so at least N0 x tp x price dollars per hour (capacity.plan's
   start).
   A shape's P:D splits are not cheaper than that bound either: P_min + D_min = ceil(rate / mu_p) +
   ceil(rate / mu_d) is not below N0, since one replica's work per request is its prefill's and its
   decodes' (1/mu_1 ~ 1/mu_p + 1/mu_d), so a shape pruned by N0 is pruned with its splits.
2. Visit the shapes cheapest bound first. A shape whose bound is not below the best fleet found so
   far is not simulated (said, with its bound). Otherwise stallfree.sim.studies.capacity.plan searches it with
   its replica count capped below the best cost (and by --max-gpus): the fewest aggregated replicas,
   the routers, then P:D splits on fewer replicas (or, with no aggregated answer under the cap, on up
   to the cap).
3. The answer is the cheapest row meeting the SLOs (ties: fewer GPUs, then aggregated, then the higher
   attainment); the runner-ups are the best aggregated and best disaggregated rows and the best of each
   GPU type, each with its cost.

Cost per token at the trace's load: usd_per_mtok_output = usd_per_hour / (output tokens per hour at the
mean rate / 1e6), the output tokens per second being the mean rate x the mean tokens generated per
request, all of the fleet's cost charged to output tokens; usd_per_mtok_input likewise for input (prompt)
tokens. They are two views of one bill, not two parts of it.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.run.simulator import saturated_throughput
from stallfree.sim.studies.capacity import (
    DEFAULT_ATTAINMENT,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_ROUTERS,
    PlanResult,
    SplitBound,
    plan,
    split_bound,
    walk_mixed_split,
)
from stallfree.sim.studies.executors import Executor
from stallfree.sim.studies.experiment import scheduler_for

__all__ = [
    "BURST_WINDOW_S",
    "FleetResult",
    "Shape",
    "ShapeOutcome",
    "answer_record",
    "busiest_window",
    "explain_load",
    "plan_fleet",
    "row_cost",
    "shape_records",
    "shape_text",
]

#: The window of the busiest-window rate the answer is explained by, s: a minute, long enough that a
#: queue built in it outlasts a TTFT objective of seconds (this project's choice).
BURST_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Shape:
    """One replica shape: a GPU type (our preset name) and its tensor parallelism (GPUs per replica)."""

    gpu: str
    tp: int

    @property
    def label(self) -> str:
        """"h100-sxm x4" (the GPU and the GPUs per replica)."""
        return f"{self.gpu} x{self.tp}"


@dataclass(slots=True)
class ShapeOutcome:
    """What the search did with one shape.

    Attributes:
        shape: the shape.
        usd_per_gpu_hour: its GPU's price (1.0 per GPU without prices: the cost is then GPUs).
        skipped: why it was not searched (weights do not fit, its bound is not below the answer), or None.
        single_capacity: mu_1, requests/s (None when not bounded).
        bound_replicas: N0 (None when not bounded).
        bound_cost: N0 x tp x price (None when not bounded).
        result: capacity.plan's result, or None when skipped.
        note: what the shape's pricing says about it (fp8 weights on a GPU without FP8), or "".
    """

    shape: Shape
    usd_per_gpu_hour: float
    skipped: str | None = None
    single_capacity: float | None = None
    bound_replicas: int | None = None
    bound_cost: float | None = None
    result: PlanResult | None = None
    note: str = ""


@dataclass(slots=True)
class FleetResult:
    """What plan_fleet found.

    Attributes:
        answer: the cheapest row meeting the SLOs (row_cost keys added), or None.
        runner_ups: the best aggregated, best disaggregated and best per GPU type rows other than the
            answer, each with `runner_up` saying which kind it is.
        outcomes: one ShapeOutcome per shape, in the order given.
        rows: every simulated row, with gpu, tp and its cost (row_cost keys).
        priced: whether prices were given (without, the cost is GPUs).
        offered_rate: the mean rate, requests/s; input_tokens_per_s, output_tokens_per_s at it.
        bound_simulations: the saturated-throughput runs of the bounds (mu_1 and, per P:D search, mu_p
            and mu_d), counted apart from the rows.
        wall_s: the whole search, s.
        attainment: the target share.
        split_bounds: the P:D capacity bound of each (GPU, TP) searched for splits.
    """

    answer: dict[str, Any] | None
    runner_ups: list[dict[str, Any]]
    outcomes: list[ShapeOutcome]
    rows: list[dict[str, Any]]
    priced: bool
    offered_rate: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    bound_simulations: int = 0
    wall_s: float = 0.0
    attainment: float = DEFAULT_ATTAINMENT
    split_bounds: dict[tuple[str, int], SplitBound] = field(default_factory=dict)

    @property
    def simulations(self) -> int:
        """Clusters simulated (the rows), not counting the bounds' saturated runs."""
        return len(self.rows)


def busiest_window(arrivals: Sequence[float], window_s: float = BURST_WINDOW_S) -> float:
    """The highest arrival rate over any `window_s` seconds starting at an arrival, requests/s: the most
    arrivals in [t_i, t_i + window_s) over window_s (two pointers over the sorted times). For a trace
    shorter than the window, its requests over the window. 0.0 for no arrivals.

    Raises:
        ValueError: window_s not > 0.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0 s, got {window_s!r}")
    most, j = 0, 0
    n = len(arrivals)
    for i in range(n):
        while j < n and arrivals[j] < arrivals[i] + window_s:
            j += 1
        most = max(most, j - i)
    return most / window_s


def row_cost(row: dict[str, Any], usd_per_gpu_hour: float, priced: bool, input_per_s: float,
             output_per_s: float) -> dict[str, Any]:
    """The cost keys of a row: `cost` (US dollars per hour with prices, else GPUs: what is minimised),
    usd_per_hour, usd_per_mtok_input and usd_per_mtok_output (None without prices or without tokens)."""
    gpus = int(row["num_gpus"])
    usd = gpus * usd_per_gpu_hour if priced else None

    def per_mtok(tokens_per_s: float) -> float | None:
        return usd / (tokens_per_s * 3600 / 1e6) if usd is not None and tokens_per_s > 0 else None

    return {"cost": usd if usd is not None else float(gpus), "usd_per_hour": usd,
            "usd_per_mtok_input": per_mtok(input_per_s), "usd_per_mtok_output": per_mtok(output_per_s)}


def _rank(row: dict[str, Any]) -> tuple[float, int, int, float]:
    """Cheaper first, then fewer GPUs, then aggregated, then the higher attainment."""
    return (round(row["cost"], 9), row["num_gpus"], row["kind"] != "aggregated", -row["attainment"])


def plan_fleet(
    setups: Sequence[tuple[Shape, Any]],
    slo_ttft: float | None,
    slo_tpot: float | None,
    *,
    prices: dict[str, float] | None = None,
    max_gpus: dict[str, int] | None = None,
    attainment: float = DEFAULT_ATTAINMENT,
    routers: Sequence[str] = DEFAULT_ROUTERS,
    budget: int = DEFAULT_TOKEN_BUDGET,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    executor: Executor | None = None,
    width: int = 1,
    disaggregate: bool = True,
    link: Any = None,
    progress: Callable[[int, int], None] | None = None,
    skipped: Sequence[tuple[Shape, str]] = (),
    notes: dict[Shape, str] | None = None,
    side_budgets: tuple[int, int] | None = None,
) -> FleetResult:
    """The cheapest fleet of the shapes meeting the SLOs (module docstring).

    Args:
        setups: (shape, stallfree.sim.inputs.setup.Setup) per shape to search; the same workload in each.
        slo_ttft, slo_tpot: the SLOs, s (at least one).
        prices: US dollars per GPU-hour by GPU name, covering every shape's GPU; None: minimise GPUs.
        max_gpus: the most GPUs of a type (a fleet of more is not tried), by GPU name.
        attainment, routers, budget, max_replicas, executor, width, disaggregate, link, progress: as
            stallfree.sim.studies.capacity.plan (max_replicas per shape).
        skipped: shapes left out before any simulation, with the reason (weights that do not fit).
        notes: per shape, what its pricing says (fp8 weights priced at the bf16 peak, ...).
        side_budgets: the P:D splits' (prefill, decode) token budgets per step, tokens, or None for `budget`.

    Returns:
        A FleetResult.

    Raises:
        ValueError: no shape to search, or a shape's GPU without a price when prices are given;
            otherwise as capacity.plan.
    """
    if not setups:
        raise ValueError("plan_fleet needs at least one shape whose weights fit")
    if prices is not None:
        missing = sorted({s.gpu for s, _ in setups} - set(prices))
        if missing:
            raise ValueError(f"no price for {', '.join(missing)}: give one for every GPU searched")
    t0 = time.perf_counter()
    priced = prices is not None
    wl = setups[0][1].workload
    rate = wl.mean_rate
    opts = setups[0][1].workload_options
    targets = [o if opts.max_tokens is None else min(o, opts.max_tokens) for o in wl.output_lens]
    # Tokens per second at the mean rate: the mean request's tokens x requests per second.
    known = math.isfinite(rate) and rate > 0 and len(wl) > 0
    in_per_s = rate * sum(wl.prompt_lens) / len(wl) if known else 0.0
    out_per_s = rate * sum(targets) / len(wl) if known else 0.0
    outcomes = [ShapeOutcome(s, 1.0, why) for s, why in skipped]
    searched: list[tuple[ShapeOutcome, Any]] = []
    for shape, setup in setups:
        price = prices[shape.gpu] if prices is not None else 1.0
        out = ShapeOutcome(shape, price, note=(notes or {}).get(shape, ""))
        mu1 = saturated_throughput(setup.workload, scheduler_for(setup, "chunked", budget, None), setup.cost_model,
                                   opts.max_tokens, max_model_len=setup.context_length,
                                   cut_output_to_fit=opts.cut_output_to_fit)
        n0 = math.ceil(rate / mu1 - 1e-9) if math.isfinite(rate) and mu1 > 0 and math.isfinite(mu1) else 1
        out.single_capacity, out.bound_replicas = mu1, max(1, n0)
        out.bound_cost = out.bound_replicas * shape.tp * price
        outcomes.append(out)
        searched.append((out, setup))
    bound_sims = len(searched)
    best: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = []
    order = sorted(searched, key=lambda o: (o[0].bound_cost or 0.0, (o[0].bound_replicas or 1) * o[0].shape.tp))
    for out, setup in order:
        shape, price = out.shape, out.usd_per_gpu_hour
        by_gpus = max_gpus[shape.gpu] // shape.tp if max_gpus and shape.gpu in max_gpus else max_replicas
        # Only a strictly cheaper fleet can beat the answer: at most (cost - epsilon) / (tp x price) replicas.
        by_cost = (math.ceil(best["cost"] / (shape.tp * price) - 1e-9) - 1 if best is not None and price > 0
                   else max_replicas)
        cap = min(max_replicas, by_gpus, by_cost)
        assert out.bound_replicas is not None
        # Under --max-replicas alone the bound is not trusted (plan simulates N0 clamped to it, as a finite
        # trace whose SLOs allow a queue may need fewer); a price or a --max-gpus cap is.
        if cap < 1 or (out.bound_replicas > cap and cap < max_replicas):
            unit = "$/h" if priced else "GPUs"
            plural = "s" if out.bound_replicas != 1 else ""
            need = (f"not simulated: its mean load needs at least {out.bound_replicas} replica{plural} "
                    f"({_fmt(out.bound_cost, priced)} {unit})")
            if max_gpus and shape.gpu in max_gpus and by_gpus < min(by_cost, max_replicas):
                out.skipped = f"{need}, more than --max-gpus {shape.gpu}={max_gpus[shape.gpu]} allows"
            elif best is not None and by_cost < max_replicas:
                out.skipped = f"{need}, not below the answer's {_fmt(best['cost'], priced)} {unit}"
            else:
                out.skipped = f"{need}, more than --max-gpus or the answer's cost allows"
            continue
        res = plan(setup, slo_ttft, slo_tpot, attainment=attainment, routers=routers, budget=budget,
                   max_replicas=cap, executor=executor, width=width, disaggregate=disaggregate, link=link,
                   progress=progress, disagg_max_replicas=cap if best is not None else None,
                   single_capacity=out.single_capacity, side_budgets=side_budgets)
        out.result = res
        bound_sims += 2 if res.split_bound is not None else 0
        for r in res.rows:
            r.update(gpu=shape.gpu, tp=shape.tp, **row_cost(r, price, priced, in_per_s, out_per_s))
            rows.append(r)
        for cand in _answers(res):
            if best is None or _rank(cand) < _rank(best):
                best = cand
    fr = FleetResult(best, [], outcomes, rows, priced, rate, in_per_s, out_per_s, bound_sims, 0.0, attainment)
    for o, _ in searched:
        if o.result is not None and o.result.split_bound is not None:
            fr.split_bounds[(o.shape.gpu, o.shape.tp)] = o.result.split_bound
    if disaggregate:
        _mixed_splits(fr, searched, (slo_ttft, slo_tpot), max_gpus or {}, max_replicas,
                      dict(router=routers[0], budget=budget, executor=executor, link=link, progress=progress,
                           attainment=attainment, side_budgets=side_budgets))
    fr.runner_ups = _runner_ups(fr.rows, fr.answer, attainment)
    fr.wall_s = time.perf_counter() - t0
    return fr


def _mixed_splits(fr: FleetResult, searched: list[tuple[ShapeOutcome, Any]], slo: tuple[float | None, float | None],
                  max_gpus: dict[str, int], max_replicas: int, kw: dict[str, Any]) -> None:
    """Step 4 with different TP on the two sides: for each GPU type, each ordered pair of its TPs whose
    capacity bound (P_min at the prefill TP, D_min at the decode TP) costs less than the answer, a
    greedy walk from that bound (capacity.walk_mixed_split), capped below the answer's cost."""
    by_gpu: dict[str, list[tuple[ShapeOutcome, Any]]] = {}
    for o, setup in searched:
        by_gpu.setdefault(o.shape.gpu, []).append((o, setup))
    for gpu, group in by_gpu.items():
        for (op, sp), (od, sd) in permutations(group, 2):
            tp_p, tp_d, price = op.shape.tp, od.shape.tp, op.usd_per_gpu_hour

            def under(p: int, d: int, tp_p: int = tp_p, tp_d: int = tp_d, price: float = price,
                      gpu: str = gpu) -> bool:
                gpus = p * tp_p + d * tp_d
                best = fr.answer
                return (gpus <= max_gpus.get(gpu, gpus) and p + d <= max_replicas
                        and (best is None or gpus * (price if fr.priced else 1.0) < best["cost"] - 1e-9))

            if not under(1, 1):
                continue
            # The prefill side's bound first (usually known from its shape's search): P_min with one
            # decode replica may already cost too much, and the decode side's bound is not needed.
            b_p = _split_bound(fr, op, sp, kw["budget"], kw["side_budgets"])
            if not under(b_p.p_min, 1):
                continue
            b_d = _split_bound(fr, od, sd, kw["budget"], kw["side_budgets"])
            start = (b_p.p_min, b_d.d_min)
            if not under(*start):
                continue
            row, new = walk_mixed_split(sp, slo, (tp_p, tp_d), start, fits=under, **kw)
            for r in new:
                r.update(gpu=gpu, tp=None, **row_cost(r, price, fr.priced, fr.input_tokens_per_s,
                                                      fr.output_tokens_per_s))
                fr.rows.append(r)
            if row is not None and (fr.answer is None or _rank(row) < _rank(fr.answer)):
                fr.answer = row


def _split_bound(fr: FleetResult, out: ShapeOutcome, setup: Setup, budget: int,
                 side_budgets: tuple[int, int] | None) -> SplitBound:
    """The shape's P:D bound, computed (two saturated runs, counted) when its search did not."""
    key = (out.shape.gpu, out.shape.tp)
    if key not in fr.split_bounds:
        with warnings.catch_warnings():
            # The shape's pricing warnings (fp8 on a GPU without FP8 units) are its note already.
            warnings.simplefilter("ignore")
            fr.split_bounds[key] = split_bound(setup, budget, side_budgets)
        fr.bound_simulations += 2
    return fr.split_bounds[key]


def shape_text(row: dict[str, Any]) -> str:
    """A row's shape: "h100-sxm x4", or "h100-sxm x2/x8" for a split whose prefill and decode TP differ."""
    if row.get("tp") is None:
        return f"{row['gpu']} x{row['prefill_tp']}/x{row['decode_tp']}"
    return f"{row['gpu']} x{row['tp']}"


def _answers(res: PlanResult) -> list[dict[str, Any]]:
    """A shape's rows meeting the SLOs that plan chose: its aggregated answer and its best split."""
    out = [r for r in (res.answer_row, res.disaggregated) if r is not None]
    return out


def _on_gpu(gpu: str) -> Callable[[dict[str, Any]], bool]:
    return lambda r: bool(r["gpu"] == gpu)


def _fmt(value: float | None, priced: bool) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if priced else f"{value:,.0f}"


def _runner_ups(rows: list[dict[str, Any]], best: dict[str, Any] | None, attainment: float) -> list[dict[str, Any]]:
    """The best meeting row of each kind (aggregated, disaggregated, each GPU type) other than the answer."""
    meeting = sorted((r for r in rows if r["attainment"] >= attainment), key=_rank)
    picks: list[dict[str, Any]] = []
    seen: set[int] = {id(best)} if best is not None else set()
    kinds: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
        ("best aggregated", lambda r: r["kind"] == "aggregated"),
        ("best disaggregated", lambda r: r["kind"] == "disaggregated"),
    ]
    for gpu in dict.fromkeys(r["gpu"] for r in rows):
        kinds.append((f"best on {gpu}", _on_gpu(gpu)))
    for name, test in kinds:
        hit = next((r for r in meeting if test(r)), None)
        if hit is not None and id(hit) not in seen:
            seen.add(id(hit))
            picks.append(hit | {"runner_up": name})
    return picks


def explain_load(fr: FleetResult, arrivals: Sequence[float]) -> dict[str, Any] | None:
    """Why the answer's count: the mean load against the answer's capacity bound, and the busiest
    BURST_WINDOW_S window's rate against the mean (module docstring). None without an answer.

    Returns:
        {"mean_rate", "busiest_window_s", "busiest_rate", "burst_ratio", "capacity_req_s" (one aggregated
        replica's mu_1, or the split's side capacities), "replicas_at_mean", "replicas_at_busiest",
        "replicas", "set_by": "mean load" | "bursts" | "latency"}: the count the mean load needs, the
        count the busiest window needs at the same capacity, and which of them (or neither: the SLOs
        need headroom past the busiest window's capacity) the answer's count matches.
    """
    row = fr.answer
    if row is None:
        return None
    rate = fr.offered_rate
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    # A trace shorter than the window has no busier minute than its whole: its mean.
    window = min(BURST_WINDOW_S, span) if span > 0 else BURST_WINDOW_S
    peak = busiest_window(arrivals, window) if span >= BURST_WINDOW_S else rate
    if row["kind"] == "aggregated":
        out = next(o for o in fr.outcomes if o.shape == Shape(row["gpu"], row["tp"]))
        mu = out.single_capacity or math.inf
        at_mean, at_peak = _need(rate, mu), _need(peak, mu)
        capacity: Any = mu
    else:
        mu_p = fr.split_bounds[(row["gpu"], row["prefill_tp"])].prefill_capacity
        mu_d = fr.split_bounds[(row["gpu"], row["decode_tp"])].decode_capacity
        at_mean = _need(rate, mu_p) + _need(rate, mu_d)
        at_peak = _need(peak, mu_p) + _need(peak, mu_d)
        capacity = {"prefill": mu_p, "decode": mu_d}
    n = int(row["replicas"])
    set_by = "mean load" if n <= at_mean else ("bursts" if n <= at_peak else "latency")
    return {"mean_rate": rate, "busiest_window_s": window, "busiest_rate": peak,
            "burst_ratio": peak / rate if rate > 0 and math.isfinite(rate) else None, "capacity_req_s": capacity,
            "replicas_at_mean": at_mean, "replicas_at_busiest": at_peak, "replicas": n, "set_by": set_by}


def _need(rate: float, capacity: float) -> int:
    """ceil(rate / capacity) replicas, at least 1."""
    if not (math.isfinite(rate) and rate > 0 and capacity > 0 and math.isfinite(capacity)):
        return 1
    return max(1, math.ceil(rate / capacity - 1e-9))


def answer_record(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `answer` of plan's --json: replicas (P + D for a split), router, num_gpus, row (as before),
    and gpu, tp (None for a split whose sides' TP differ), kind, prefill, decode, prefill_tp, decode_tp
    (None when aggregated), attainment, usd_per_hour,
    usd_per_mtok_input, usd_per_mtok_output (None without prices)."""
    if row is None:
        return None
    keys = ("replicas", "router", "num_gpus", "gpu", "tp", "kind", "prefill", "decode", "prefill_tp", "decode_tp",
            "attainment",
            "usd_per_hour", "usd_per_mtok_input", "usd_per_mtok_output")
    return {k: row.get(k) for k in keys} | {"row": row}


def shape_records(fr: FleetResult) -> list[dict[str, Any]]:
    """One record per shape for --json: gpu, tp, usd_per_gpu_hour (None without prices), skipped (why,
    or None), note, the bound (single_capacity_req_s, bound_replicas, bound_cost) and what it found
    (aggregated_replicas, disaggregated label)."""
    out = []
    for o in fr.outcomes:
        res = o.result
        out.append({
            "gpu": o.shape.gpu, "tp": o.shape.tp, "usd_per_gpu_hour": o.usd_per_gpu_hour if fr.priced else None,
            "skipped": o.skipped, "note": o.note or None, "single_capacity_req_s": o.single_capacity,
            "bound_replicas": o.bound_replicas, "bound_cost": o.bound_cost,
            "aggregated_replicas": res.replicas if res is not None else None,
            "disaggregated": (res.disaggregated or {}).get("label") if res is not None else None,
        })
    return out
