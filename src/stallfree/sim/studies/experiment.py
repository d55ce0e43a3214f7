"""One simulation study, as `stallfree simulate` runs it: one batching mode (or all of them side by
side) on a Setup, each run summarized with its capacity and load (stallfree.sim.outputs.writers writes its files).

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim
(below stallfree.sim.outputs.writers and plots); numpy lazily (the summaries).

Example::

    from stallfree.sim.studies.experiment import run_experiment
    from stallfree.sim.inputs.setup import HardwareOptions, Setup, WorkloadOptions

    study = run_experiment(Setup(WorkloadOptions(num_requests=500), HardwareOptions()), budget=2048)
    print(study.summaries[0]["p99_tpot_ms"])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.options import SetupError
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.setup import TIME_BUDGET_CAP, Setup
from stallfree.sim.outputs.report import served_share, summarize_result
from stallfree.sim.run.config import BATCHING_MODES
from stallfree.sim.run.result import SchedulerLike, SimResult
from stallfree.sim.run.simulator import saturated_throughput, simulate
from stallfree.sim.run.time_budget import TimeBudgetConfig
from stallfree.sim.studies.ranges import ScaledCost

__all__ = [
    "Experiment",
    "check_options",
    "offered_rate",
    "record_capacity",
    "run_experiment",
    "run_tag",
    "scheduler_for",
    "study_header",
]


@dataclass(frozen=True, slots=True)
class Experiment:
    """The runs of one study.

    Attributes:
        header: the report's header (Setup.header plus token_budget and step_time_target_s).
        results: one SimResult per batching mode, in the order run.
        summaries: per run, report.summarize_result plus capacity_req_s (requests/s when
            saturated; None when no step ran) and load (offered rate / capacity; None when every
            request arrives at one instant or the capacity is unknown).
    """
    header: dict[str, Any]
    results: list[SimResult]
    summaries: list[dict[str, Any]]


def check_options(
    setup: Setup, modes: list[str], step_time_target: float | None, check: bool
) -> None:
    """Refuse options of a run that contradict each other.

    Raises:
        SetupError: an unknown batching mode, `check` or `scheduler`='paged' with a baseline, paged-only
            options without the paged scheduler, or a step time target with a baseline or with
            partial prefills (usage).
    """
    compare = len(modes) > 1
    for mode in modes:
        if mode not in BATCHING_MODES:
            raise SetupError(f"unknown batching mode {mode!r} (choose from {', '.join(BATCHING_MODES)})", usage=True)
    if check and modes != ["chunked"] and not compare:
        raise SetupError("`check` checks the contract's scheduler: use it with `batching`='chunked'", usage=True)
    if setup.paged and modes != ["chunked"] and not compare:
        raise SetupError("`kv_policy`='paged' runs chunked batching: drop `batching`", usage=True)
    if step_time_target is not None and modes != ["chunked"]:
        raise SetupError("`step_time_target` drives the chunked scheduler: drop `compare` and `batching`",
                         usage=True)
    if step_time_target is not None and setup.scheduler_config.max_num_partial_prefills != 1:
        raise SetupError("`step_time_target` does not take the partial-prefill options in this version: "
                         "drop `max_num_partial_prefills`", usage=True)


def run_experiment(
    setup: Setup,
    *,
    batching: str | list[str] = "chunked",
    budget: int | None = None,
    step_time_target: float | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    capacity: bool = True,
) -> Experiment:
    """Simulate the setup's workload under each batching mode asked for.

    Args:
        setup: the workload, cost model and scheduler options.
        batching: a mode of BATCHING_MODES, or a list of them (["chunked", "prefill-first",
            "no-chunk"] compares all three).
        budget: token budget per step, tokens; with step_time_target, the cap of each step's
            budget. Default 2048, or TIME_BUDGET_CAP with a step time target.
        step_time_target: time budget mode: each step's predicted time stays under this, s.
        check: check the scheduler's invariants after every step (chunked only).
        slo_ttft: TTFT objective for goodput, s, or None.
        slo_tpot: TPOT objective for goodput, s, or None.
        capacity: measure each run's capacity (capacity_req_s, load); False leaves both keys out (a
            replay whose latencies alone are read, as stallfree.sim.studies.ranges' scaled replays).

    Returns:
        An Experiment with one result and summary per mode.

    Raises:
        SetupError: options that contradict each other (usage).
        SimulationError: a scheduler that cannot finish the workload.
    """
    modes = [batching] if isinstance(batching, str) else list(batching)
    check_options(setup, modes, step_time_target, check)
    if budget is None:
        budget = DEFAULT_TOKEN_BUDGET if step_time_target is None else TIME_BUDGET_CAP
    results, summaries = [], []
    for mode in modes:
        res, summary = _run_mode(setup, mode, budget, step_time_target, check, slo_ttft, slo_tpot, capacity)
        results.append(res)
        summaries.append(summary)
    header = study_header(setup)
    header["token_budget"] = budget
    header["step_time_target_s"] = step_time_target
    return Experiment(header, results, summaries)


def _run_mode(
    setup: Setup, mode: str, budget: int, step_time_target: float | None, check: bool,
    slo_ttft: float | None, slo_tpot: float | None, capacity: bool = True,
) -> tuple[SimResult, dict[str, Any]]:
    """One mode of run_experiment: its SimResult and its summary with capacity_req_s and load."""
    max_tokens = setup.workload_options.max_tokens
    sched = scheduler_for(setup, mode, budget, step_time_target)
    res = simulate(
        setup.workload,
        sched,
        setup.cost_model,
        max_tokens=max_tokens,
        check=check and mode == "chunked",
        label=getattr(sched, "label", None),
        max_model_len=setup.context_length,
        cut_output_to_fit=setup.workload_options.cut_output_to_fit,
        closed_loop=setup.engine_closed_loop,
        records=setup.keep_records,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
    )
    if step_time_target is not None:
        # plan_run reads the KV policy off a ReplicaConfig only; a time-budget run's is its inner scheduler's.
        res.config.update(batching=mode, max_seqs=setup.max_seqs, step_time_target_s=step_time_target,
                          kv=sched.scheduler.kv_policy)
    summary = summarize_result(res, slo_ttft, slo_tpot)
    if not capacity:
        return res, summary
    saturated = saturated_throughput(
        setup.workload,
        sched,
        setup.cost_model,
        max_tokens,
        max_model_len=setup.context_length,
        cut_output_to_fit=setup.workload_options.cut_output_to_fit,
    )
    record_capacity(setup, summary, saturated)
    return res, summary


def record_capacity(setup: Setup, summary: dict[str, Any], capacity: float) -> None:
    """Set summary's capacity_req_s (`capacity`, requests/s when saturated) and load (the offered rate of
    the requests it could serve, offered_rate x report.served_share, over capacity); None for either when
    not finite, as JSON has no infinity: a capacity with no step run (everything refused), a load with every
    request arriving at one instant."""
    load = offered_rate(setup, summary) * served_share(summary) / capacity if capacity > 0 else math.inf
    summary["capacity_req_s"] = capacity if math.isfinite(capacity) else None
    summary["load"] = load if math.isfinite(load) else None


def study_header(setup: Setup) -> dict[str, Any]:
    """setup.header() with an offered rate that is not finite (every request at one instant) as None."""
    header = setup.header()
    if header["offered_rate"] is not None and not math.isfinite(header["offered_rate"]):
        header["offered_rate"] = None
    return header


def offered_rate(setup: Setup, summary: dict[str, Any]) -> float:
    """The request rate a run's load is judged by, requests/s: the workload's mean arrival rate
    (open loop), or the rate the closed-loop clients or the sessions achieved
    (summary["achieved_request_rate"]: requests sent / the run's duration; 0 when nothing finished)."""
    if setup.closed_loop is None and not isinstance(setup.workload, SessionWorkload):
        return setup.workload.mean_rate
    return float(summary.get("achieved_request_rate") or 0.0)


def scheduler_for(setup: Setup, mode: str, budget: int, step_time_target: float | None) -> Any:
    """The scheduler of one run: a ReplicaConfig, or a TimeBudgetConfig with a step time target."""
    if step_time_target is None:
        return setup.config(mode, budget)

    # The time budget plans with the model's prediction: a range's replay scales the steps as run (the
    # engine's real time), never the planner's estimate (stallfree.sim.studies.ranges).
    planning = setup.cost_model.inner if isinstance(setup.cost_model, ScaledCost) else setup.cost_model
    sched: SchedulerLike | Any = TimeBudgetConfig(
        setup.scheduler_config.replace(token_budget=budget), step_time_target, planning)
    return sched


def run_tag(res: SimResult) -> str:
    """The name of a run in file names: its batching mode and KV policy ("chunked-reserve",
    "chunked-paged", "no-chunk-reserve"), with "-time" in time budget mode and "-cache" for a run
    marked config["prefix_caching"] (simulate marks its runs with prefix caching on), then "-cpu" for a
    run with a CPU KV tier."""
    tag = f"{res.config.get('batching', res.label)}-{res.config.get('kv', 'reserve')}"
    tag += "-time" if res.config.get("step_time_target_s") is not None else ""
    tag += "-cache" if res.config.get("prefix_caching") else ""
    return tag + ("-cpu" if res.config.get("cpu_kv_tokens") else "")
