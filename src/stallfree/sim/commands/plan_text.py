"""How `stallfree plan` words its answer: the answer line, why, the tables of clusters and runner-ups and
the serve lines (stallfree.sim.commands.plan runs the search).

Imports allowed: the standard library and stallfree.sim; rich lazily.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stallfree.sim.commands.common import counted, rate_text, share_text

if TYPE_CHECKING:
    from stallfree.sim.studies.capacity import PlanResult
    from stallfree.sim.studies.fleet import FleetResult, Shape

__all__ = [
    "EXIT_NOT_MET",
    "answer_line",
    "answer_outcome",
    "answer_shape",
    "fleet_answer_line",
    "print_plan",
    "print_serve",
    "why_line",
]

#: No fleet up to --max-replicas meets the SLOs (as tune's 3).
EXIT_NOT_MET = 3


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
        return f"answer: no count up to {counted(args.max_replicas, 'replica')} meets {slo}{got} (exit {EXIT_NOT_MET})"
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


def answer_outcome(fleet: FleetResult) -> Any:
    """The ShapeOutcome of the answer's shape (of the first searched shape without an answer)."""
    if fleet.answer is not None:
        return next(o for o in fleet.outcomes if o.shape == answer_shape(fleet.answer))
    return next((o for o in fleet.outcomes if o.result is not None), None)


def answer_shape(row: dict[str, Any]) -> Shape:
    """The shape a row belongs to (a split with different TP per side: its prefill side's)."""
    from stallfree.sim.studies.fleet import Shape

    return Shape(row["gpu"], row["tp"] if row.get("tp") is not None else row["prefill_tp"])


def _money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def fleet_answer_line(fleet: FleetResult, args: argparse.Namespace) -> str:
    """The answer in one line: the fleet (kind, counts, router, GPU type and TP, GPUs), its attainment,
    and its cost (dollars per hour and per million output and input tokens at the trace's load; or GPUs,
    saying that no prices were given)."""
    from stallfree.sim.studies.fleet import shape_text

    slo = f"{_slo_text(args)} (target {fleet.attainment:.2%})"
    row = fleet.answer
    if row is None:
        best = max(fleet.rows, key=lambda r: r["attainment"]) if fleet.rows else None
        got = f"; best {best['label']} on {shape_text(best)}: {best['attainment']:.2%}" if best else ""
        return (f"answer: no fleet up to {counted(args.max_replicas, 'replica')} per shape meets {slo}{got} "
                f"(exit {EXIT_NOT_MET})")
    what = (f"{row['replicas']} replica{'s' if row['replicas'] != 1 else ''}" if row["kind"] == "aggregated"
            else f"disaggregated {row['prefill']} prefill + {row['decode']} decode replicas")
    line = (f"answer: {what} of {shape_text(row)} ({row['num_gpus']} GPUs), router {row['router']}: "
            f"{row['attainment']:.2%} of requests within {slo}; ")
    if fleet.priced:
        return line + (f"{_money(row['usd_per_hour'])}/h, {_money(row['usd_per_mtok_output'])} per million output "
                       f"tokens ({_money(row['usd_per_mtok_input'])} per million input) at the trace's load.")
    return line + "the fewest GPUs (no prices given: --gpu-price or --prices for dollars)."


def why_line(load: dict[str, Any] | None, fleet: FleetResult) -> str | None:
    """Why the answer's count: the mean load against the capacity, the busiest minute against the mean."""
    from stallfree.sim.studies.fleet import BURST_WINDOW_S

    if load is None or fleet.answer is None:
        return None
    cap = load["capacity_req_s"]
    row = fleet.answer
    if isinstance(cap, dict):
        capacity = (f"one prefill replica sustains ~{rate_text(cap['prefill'])} req/s and one decode replica "
                    f"~{rate_text(cap['decode'])} req/s")
    else:
        capacity = (f"one replica sustains ~{rate_text(cap)} req/s "
                    f"(the mean load is {share_text(load['mean_rate'] / cap)} of it)")
    ratio = f", {load['burst_ratio']:.1f}x the mean" if load["burst_ratio"] else ""
    window_s = load["busiest_window_s"]
    # A trace shorter than the window is timed over its own span, seconds to the last arrival: a tenth
    # of a second is as fine as the rest of the report gives seconds.
    window = (f"{window_s:,.0f} s" if window_s == round(window_s) else f"{window_s:,.1f} s") + (
        " (the whole trace)" if window_s < BURST_WINDOW_S else "")
    verdict = {"mean load": "the mean load sets the count",
               "bursts": "bursts, not the mean load, set the count",
               "latency": "the SLOs, not the load, set the count: it needs headroom past the busiest minute"}
    return (f"why: {rate_text(load['mean_rate'])} req/s offered on average; {capacity}: {load['replicas_at_mean']} "
            f"replica{'s' if load['replicas_at_mean'] != 1 else ''} at the mean; the busiest {window} bring "
            f"{rate_text(load['busiest_rate'])} req/s{ratio}: {load['replicas_at_busiest']} at that rate; "
            f"the answer's {row['replicas']}: {verdict[load['set_by']]}.")


def print_plan(fleet: FleetResult, report: dict[str, Any], header: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the workload line, the answer, why, the table of every cluster simulated, the runner-ups,
    the shapes skipped and how the search went, then the serve lines."""
    rate = header["offered_rate"]
    offered = f"{rate_text(rate)} req/s offered" if rate is not None else "closed loop"
    many = len(fleet.outcomes) > 1
    hardware = (f"shapes {', '.join(o.shape.label for o in fleet.outcomes)} of {args.model}" if many
                else header["hardware"])
    print(f"{header['workload']}: {header['requests']:,} requests, rate scale {header['rate_scale']:g} ({offered}); "
          f"{hardware}; budget {args.token_budget:,}; max_seqs {header['max_seqs']}")
    print(f"aggregated replicas: {header['behaviour']}"
          + (f"; disaggregated splits, {header['disaggregated_behaviour']}" if "disaggregated_behaviour" in header
             else ""))
    print(fleet_answer_line(fleet, args))
    answer = fleet.answer or {}
    span = answer.get("range")
    if span:
        print("range of the answer (every step at the 10th to 90th percentile of the measured step-time error): "
              + ", ".join(f"{name} {span[k][0]:,.1f}-{span[k][1]:,.1f} ms" for k, name in (
                  ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50"),
                  ("p99_tpot_ms", "TPOT p99")) if span.get(k)))
    elif answer.get("range_note"):
        print(answer["range_note"])
    outcome = answer_outcome(fleet)
    if outcome is not None and outcome.result is not None and outcome.result.replicas is not None:
        print(f"  {outcome.shape.label}: " + answer_line(outcome.result, args).removeprefix("answer: "))
    why = why_line(report["load"], fleet)
    if why:
        print(why)
    _print_rows(fleet, many)
    if fleet.runner_ups:
        _print_runner_ups(fleet)
    for o in fleet.outcomes:
        if o.skipped:
            print(f"{o.shape.label}: {o.skipped}")
        if o.note:
            print(f"{o.shape.label}: {o.note}")
    if not many and outcome is not None and outcome.result is not None:
        res = outcome.result
        sustains = (f"one replica sustains ~{rate_text(res.single_capacity)} req/s saturated, so "
                    f"{rate_text(res.offered_rate)} req/s needs at least ~{res.bound} (the start)"
                    if math.isfinite(res.single_capacity) else
                    "one replica ran no step when saturated (every request it was given was rejected), so the "
                    f"search started at {res.bound}")
        print(f"search: {sustains}; {_runs_text(fleet)}")
    else:
        print(f"search: {counted(len(fleet.outcomes), 'shape')} bounded by their saturated throughput; "
              + _runs_text(fleet))
    if report["serve"] is not None and not args.out:
        print_serve(report["serve"], args, report["gpus_per_replica"])


def _runs_text(fleet: FleetResult) -> str:
    return (f"{counted(fleet.simulations, 'simulation')} in {fleet.wall_s:,.1f} s (and "
            f"{counted(fleet.bound_simulations, 'saturated run')} for the bounds)")


def _print_rows(fleet: FleetResult, many: bool) -> None:
    """The table of every cluster simulated."""
    from rich.table import Table

    from stallfree.sim.outputs.table import console
    from stallfree.sim.studies.fleet import shape_text

    cols: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
        ("attainment", "in SLO", "{:.2%}".format), ("request_goodput", "goodput", rate_text),
        ("goodput_per_gpu", "per GPU", lambda v: rate_text(v, 3)), ("median_ttft_ms", "TTFT p50", "{:,.0f}".format),
        ("p99_ttft_ms", "TTFT p99", "{:,.0f}".format), ("median_tpot_ms", "TPOT p50", "{:,.1f}".format),
        ("p99_tpot_ms", "TPOT p99", "{:,.1f}".format))
    if fleet.priced:
        cols = (("usd_per_hour", "$/h", "{:,.2f}".format), *cols)
    # The last column's marks, said under the table (a reader meets "shape best" nowhere else).
    caption = ("answer: the plan's answer; shape best: a shape's own answers (its fewest aggregated replicas "
               "meeting the target, its best P:D split meeting it); meets: at or above the target share within "
               "the SLOs")
    table = Table(title="clusters simulated (goodput in req/s, latencies in ms)", title_justify="left",
                  caption=caption, caption_justify="left")
    names = ("cluster", *(("shape",) if many else ()), "GPUs", *(c[1] for c in cols), "")
    for name in names:
        table.add_column(name, justify="left" if name in ("cluster", "shape") else "right", no_wrap=True)
    rows = sorted(fleet.rows, key=lambda r: (r["gpu"], r["tp"] or 0, r["kind"] != "aggregated", r["replicas"],
                                             r["router"], r["label"]))
    chosen = {id(r) for o in fleet.outcomes if o.result is not None
              for r in (o.result.answer_row, o.result.disaggregated) if r is not None}
    for r in rows:
        met = "meets" if r["attainment"] >= fleet.attainment else ""
        mark = "answer" if r is fleet.answer else ("shape best" if id(r) in chosen else met)
        cells = ["-" if r.get(k) is None else text(r[k]) for k, _, text in cols]
        table.add_row(r["label"], *((shape_text(r),) if many else ()), str(r["num_gpus"]), *cells, mark)
    console().print(table)


def _print_runner_ups(fleet: FleetResult) -> None:
    """The runner-ups' table: best aggregated, best disaggregated, best per GPU type, with the cost."""
    from rich.table import Table

    from stallfree.sim.outputs.table import console
    from stallfree.sim.studies.fleet import shape_text

    table = Table(title="runner-ups (meeting the SLOs; the answer excluded)", title_justify="left")
    for name in ("", "cluster", "shape", "GPUs", "in SLO", "$/h", "$/M out", "$/M in"):
        table.add_column(name, justify="left" if name in ("", "cluster", "shape") else "right", no_wrap=True)
    for r in fleet.runner_ups:
        table.add_row(r["runner_up"], r["label"], shape_text(r), str(r["num_gpus"]),
                      f"{r['attainment']:.2%}", _money(r["usd_per_hour"]), _money(r["usd_per_mtok_output"]),
                      _money(r["usd_per_mtok_input"]))
    console().print(table)


def print_serve(serve: dict[str, Any] | None, args: argparse.Namespace, tp: int, who: str = "each replica") -> None:
    """The serve lines of the answer: one per replica kind (a split's prefill and decode sides); `who`
    leads the line of an aggregated answer."""
    if serve is None:
        return
    note = f"  (MODEL: the checkpoint of {args.model})" if "/" not in args.model else ""
    sides = [(who, serve)] if "vllm" in serve else [
        (_each(serve["prefill"]["replicas"], "prefill"), serve["prefill"]),
        (_each(serve["decode"]["replicas"], "decode"), serve["decode"])]
    for k, (who, lines) in enumerate(sides):
        print(f"{who}: {lines['vllm']}{note if k == 0 else ''}")
        if lines["stallfree"] is not None:
            print(f"  or, on stallfree's engine: {lines['stallfree']}")
        else:
            print(f"  (stallfree serve runs on one device: a replica of {lines.get('tp', tp)} GPUs needs a "
                  "tensor-parallel engine such as vLLM)")
    if "vllm" not in serve:
        print("  (the two sides pass each request's KV from prefill to decode: vLLM's --kv-transfer-config with a "
              "KV connector)")


def _each(n: int, side: str) -> str:
    return f"the {side} replica" if n == 1 else f"each of the {n} {side} replicas"
