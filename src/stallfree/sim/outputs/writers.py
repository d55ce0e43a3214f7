"""Every file and plot the simulator's commands write under --out (and with --records): above the
studies (experiment, sweep, tune, kv_sweep, cluster, disagg) and the event loop, which write nothing.
The figures themselves are drawn by stallfree.sim.outputs.plots.

Imports allowed: the standard library and stallfree.sim; numpy and matplotlib only through
stallfree.sim.outputs.plots (lazily).

Example::

    from pathlib import Path
    from stallfree.sim.studies.experiment import run_experiment
    from stallfree.sim.inputs.setup import HardwareOptions, Setup, WorkloadOptions
    from stallfree.sim.outputs.writers import write_experiment

    study = run_experiment(Setup(WorkloadOptions(num_requests=500), HardwareOptions()), budget=2048)
    print(write_experiment(Path("out"), study))
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs import plots
from stallfree.sim.outputs.disagg_report import RECORD_FIELDS, disagg_records
from stallfree.sim.outputs.records import write_records, write_steps_csv
from stallfree.sim.run.cluster import ClusterResult
from stallfree.sim.run.disagg import DisaggResult
from stallfree.sim.studies.experiment import Experiment, run_tag
from stallfree.sim.studies.kv_sweep import kv_sweep_title
from stallfree.sim.studies.sweep import ROW_KEYS, SweepResult
from stallfree.sim.studies.tune import TuneResult
from stallfree.sim.studies.tune_report import tune_report

__all__ = [
    "write_disagg_out",
    "write_disagg_records",
    "write_experiment",
    "write_json",
    "write_kv_sweep",
    "write_records",
    "write_steps_csv",
    "write_sweep",
    "write_tune",
]


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON and a newline to `path` (UTF-8).

    Raises:
        OSError: the file cannot be written.
    """
    path.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")


def write_experiment(
    out: Path, study: Experiment, clusters: Sequence[ClusterResult | None] | None = None
) -> list[str]:
    """Write summary.json, requests-<tag>.csv, steps-<tag>.csv, cdf.png and timeline.png under `out`
    (tag: experiment.run_tag, the batching mode and KV policy actually run).

    Args:
        out: the directory (created if missing).
        study: the runs.
        clusters: per result, its ClusterResult or None (one replica): a cluster's records say
            which replica served each request and ran each step, and a lone cluster run's
            timeline has a line per replica instead of every replica's steps binned together.

    Returns:
        The names written, in order.

    Raises:
        OSError: `out` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", {"header": study.header, "runs": study.summaries})
    names = ["summary.json"]
    per_run = list(clusters) if clusters is not None else [None] * len(study.results)
    for res, cluster in zip(study.results, per_run, strict=True):
        tag = run_tag(res)
        routed, base = (cluster.routed, cluster.step_base) if cluster is not None else (None, None)
        write_records(res, out / f"requests-{tag}.csv", routed)
        write_steps_csv(res, out / f"steps-{tag}.csv", base)
        names += [f"requests-{tag}.csv", f"steps-{tag}.csv"]
    context = plots.plot_context(study.header)
    plots.plot_cdfs(study.results, out / "cdf.png", context)
    lone = per_run[0] if len(per_run) == 1 else None
    if lone is not None and len(lone.replicas) > 1:
        plots.plot_replica_timeline(lone.replicas, out / "timeline.png", context)
    else:
        plots.plot_timeline(study.results, out / "timeline.png", context)
    return [*names, "cdf.png", "timeline.png"]


def write_sweep(out: Path, result: SweepResult) -> list[str]:
    """Write sweep.csv, sweep.json, tradeoff.png and cdf.png under `out`; return the names written.

    Raises:
        OSError: `out` cannot be created or written.
    """
    header, rows, table_rows = result.header, result.rows, result.table_rows
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="", encoding="utf-8") as fh:
        # The CSV keeps flat columns: rejections by reason go to sweep.json only.
        flat = [k for k in ROW_KEYS if k != "rejected_by_reason"]
        writer = csv.DictWriter(fh, fieldnames=flat, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table_rows)
    (out / "sweep.json").write_text(json.dumps({"header": header, "rows": table_rows}, indent=1) + "\n")
    budgets = sorted({r["token_budget"] for r in table_rows})
    context = plots.plot_context(header, "budgets " + ", ".join(f"{b:,}" for b in budgets))
    plots.plot_tradeoff(table_rows, out / "tradeoff.png", context)
    plots.plot_sweep_cdfs(rows, out / "cdf.png", context)
    return ["sweep.csv", "sweep.json", "tradeoff.png", "cdf.png"]


def write_kv_sweep(out: Path, rows: Sequence[dict[str, Any]], title: str) -> list[str]:
    """Write kv_sweep.json (the rows) and kv_sweep.png (titled kv_sweep_title(rows, title)) under
    `out`; return the names written.

    Raises:
        OSError: `out` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "kv_sweep.json", list(rows))
    plots.plot_kv_sweep(rows, out / "kv_sweep.png", kv_sweep_title(rows, title))
    return ["kv_sweep.json", "kv_sweep.png"]


def write_tune(out: Path, result: TuneResult, header: dict[str, Any], vllm_serve: str | None = None) -> list[str]:
    """Write tune.json (tune.tune_report, with `vllm_serve` as its "vllm_serve") and tune.png (plots.plot_tune)
    under `out`; return the names.

    Raises:
        OSError: `out` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(tune_report(result, header, vllm_serve), indent=1) + "\n")
    budgets = sorted({r["token_budget"] for r in result.rows})
    plots.plot_tune(result.rows, out / "tune.png", best=result.best, slo_ttft=result.slo_ttft,
                    slo_tpot=result.slo_tpot, bound_budget=result.bound.token_budget if result.bound else None,
                    context=plots.plot_context(header, f"budgets {budgets[0]:,} to {budgets[-1]:,}"))
    return ["tune.json", "tune.png"]


#: The columns of plan.csv: a simulated cluster's shape, size, cost and figures.
PLAN_CSV_KEYS = (
    "label", "gpu", "tp", "kind", "replicas", "prefill", "decode", "router", "num_gpus", "attainment",
    "usd_per_hour", "usd_per_mtok_input", "usd_per_mtok_output", "request_goodput", "goodput_per_gpu",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "completed", "rejected",
)


def write_plan(out: Path, report: dict[str, Any], rows: Sequence[dict[str, Any]], attainment: float) -> list[str]:
    """Write plan.json (the --json report), plan.csv (every cluster simulated, PLAN_CSV_KEYS) and plan.png
    (plots.plot_plan_costs: cost against SLO attainment) under `out`; return the names.

    Raises:
        OSError: `out` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(report, indent=1) + "\n")
    with open(out / "plan.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(PLAN_CSV_KEYS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plots.plot_plan_costs(rows, out / "plan.png", attainment, report.get("answer"), bool(report.get("priced")),
                          context=plots.plot_context(report["header"]))
    return ["plan.json", "plan.csv", "plan.png"]


def write_disagg_records(result: DisaggResult, workload: Workload, path: Path) -> None:
    """Write disagg.disagg_records to `path`: JSON if it ends in .json, else CSV.

    Raises:
        OSError: the file cannot be written.
    """
    rows = disagg_records(result, workload)
    if str(path).endswith(".json"):
        write_json(path, rows)
        return
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(RECORD_FIELDS))
        writer.writeheader()
        writer.writerows(rows)


def write_disagg_out(
    out: Path, header: dict[str, Any], summary: dict[str, Any], result: DisaggResult, workload: Workload
) -> list[str]:
    """`--out DIR` for a disaggregated run: summary.json ({"header", "runs": [summary]}),
    requests-disagg.csv (disagg_records), steps-prefill<k>.csv and steps-decode<k>.csv (each
    replica's steps, report.step_records' columns), cdf.png (TTFT and TPOT over the joined
    timelines) and timeline.png (a line per replica).

    Returns:
        The names written, in order.

    Raises:
        OSError: `out` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"header": header, "runs": [summary]}, indent=1) + "\n")
    names = ["summary.json", "requests-disagg.csv"]
    write_disagg_records(result, workload, out / "requests-disagg.csv")
    reps = [*result.prefill, *result.decode]
    for res in reps:
        name = f"steps-{res.label.replace('#', '')}.csv"
        write_steps_csv(res, out / name)
        names.append(name)
    context = plots.plot_context(
        header, f"{header.get('disaggregate', '?')} (P:D), budget prefill {summary.get('prefill_budget')} / "
        f"decode {summary.get('decode_budget')}"
    )
    ttft = [(t.token_times[0] - t.arrival) * 1e3 for t in result.timelines]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) * 1e3
            for t in result.timelines if len(t.token_times) > 1]
    plots.plot_cdf_series([(str(summary.get("label", "disaggregated")), ttft, tpot)], out / "cdf.png", context)
    plots.plot_replica_timeline(reps, out / "timeline.png", context, [r.label for r in reps])
    return [*names, "cdf.png", "timeline.png"]
