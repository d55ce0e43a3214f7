"""`stallfree validate --against PATH`: replay someone else's measured runs through the simulator and
compare figure by figure. The format is found by the content of PATH (see `detect`):

- a run folder (meta.json + requests.jsonl; validate.runs), or a folder of run folders: replayed open-loop,
  each request arriving at its queued_ts;
- a `vllm bench serve` result file (JSON with input_lens; validate.vllm);
- a closed-loop benchmark CSV in the format of aiconfigurator-core's systems/silicon_sample.csv, or the
  word "aiconfigurator" for the copy inside the installed package (validate.silicon).

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim,
stallfree.validate.

Errors, percent: for each figure (mean, p50, p90, p99 of TTFT, TPOT and E2E over the requests finished in
both), the signed error (simulated - measured) / measured x 100; over runs, the median of the absolute
errors. The verdict uses the goals of docs/fidelity.md: |error| of mean E2E <= 10%, of mean TTFT <= 20%, of
mean TPOT <= 10%.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from stallfree._files import MAX_JSON_CHARS
from stallfree.core.metrics import percentile
from stallfree.costmodel import CostModelError
from stallfree.sim.inputs.engine_behaviour import (
    ASYNC_SCHEDULING_DEFAULT_SINCE,
    async_default,
    engine_defaults,
)
from stallfree.sim.inputs.engine_profile import EngineProfile
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.routers import VllmDPRouter
from stallfree.sim.run.simulator import simulate
from stallfree.sim.studies.ranges import STEP_TIME_HIGH, STEP_TIME_LOW, ScaledCost, run_range
from stallfree.validate.compare import Latencies, latencies
from stallfree.validate.errors import ValidateDataError
from stallfree.validate.hardware import (
    derived_kv_tokens,
    describe_profile,
    gpu_match,
    kv_dtype_of,
    model_preset,
    pricing,
)
from stallfree.validate.runs import RunFolder, is_run_folder, read_run_folder

__all__ = [
    "ASYNC_SCHEDULING_DEFAULT_SINCE",
    "GOALS",
    "RUN_METRICS",
    "detect",
    "figures",
    "async_default",
    "async_lag",
    "replay_run",
    "validate_runs",
    "verdict",
]

#: The metrics of per-request data (no per-token gaps in a run folder: TPOT is each request's mean gap).
RUN_METRICS = ("ttft", "tpot", "e2e")
#: Goals on the absolute error of the mean, percent (docs/fidelity.md; the issue's judged targets).
GOALS = {"e2e": 10.0, "ttft": 20.0, "tpot": 10.0}
_STATS = ("mean", "p50", "p90", "p99")


def detect(path: str) -> str:
    """Return the format of --against PATH: "aiconfigurator", "silicon", "run", "runs" or "vllm-result".

    Raises:
        ValueError: PATH does not exist or matches no format (the message says what was looked for).
    """
    if path == "aiconfigurator":
        return "aiconfigurator"
    p = Path(path)
    if is_run_folder(p):
        return "run"
    if p.is_dir():
        if any(is_run_folder(c) for c in p.iterdir()):
            return "runs"
        raise ValueError(f"--against {path!r}: a folder without meta.json + requests.jsonl, nor run folders in it")
    if not p.is_file():
        raise ValueError(f"--against {path!r}: no such file or folder (or the word 'aiconfigurator')")
    try:
        with p.open(encoding="utf-8") as fh:
            head = fh.read(4096)
    except OSError as exc:
        raise ValueError(f"--against {path!r}: cannot read: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValidateDataError(f"--against {path!r}: cannot read: {exc}") from None
    first = head.splitlines()[0] if head else ""
    if "silicon_ttft_ms" in first and "isl" in first.split(","):
        return "silicon"
    if head.lstrip().startswith("{") and _mentions(p, '"input_lens"'):
        return "vllm-result"
    raise ValidateDataError(f"--against {path!r}: not a run folder, a silicon_sample.csv-style CSV (header with isl, "
                     "silicon_ttft_ms) or a vllm bench serve result (JSON with input_lens)")


def _mentions(p: Path, word: str) -> bool:
    """Whether the first MAX_JSON_CHARS characters of a text file hold `word`, read 1 MiB at a time."""
    tail, read = "", 0
    try:
        with p.open(encoding="utf-8") as fh:
            while read < MAX_JSON_CHARS and (chunk := fh.read(1 << 20)):
                if word in tail + chunk:
                    return True
                tail, read = chunk[-len(word):], read + len(chunk)
    except UnicodeDecodeError as exc:
        raise ValidateDataError(f"--against {str(p)!r}: cannot read: {exc}") from None
    except OSError as exc:
        raise ValueError(f"--against {str(p)!r}: cannot read: {exc}") from None
    return False


def _stat(vals: list[float], stat: str) -> float | None:
    if not vals:
        return None
    if stat == "mean":
        return sum(vals) / len(vals)
    return percentile(vals, float(stat[1:]))


def figures(measured: dict[Hashable, Latencies], sim: dict[Hashable, Latencies],
            metrics: Sequence[str] = RUN_METRICS) -> dict[str, Any]:
    """Return the measured and simulated figures (ms) and their signed errors (percent) over the requests
    finished in both: {"requests", "measured": {"mean_ttft_ms", ...}, "simulated": {...},
    "error_pct": {"mean_ttft", "p50_ttft", ...}, "median_ape_pct": {"ttft", ...}}.

    Raises:
        ValueError: no request finished in both.
    """
    both = [r for r in measured if r in sim]
    if not both:
        raise ValueError("no request finished in both the measured run and the simulator")
    out: dict[str, Any] = {"requests": len(both), "measured": {}, "simulated": {}, "error_pct": {},
                           "median_ape_pct": {}}
    for m in metrics:
        pairs = [(measured[r].value(m), sim[r].value(m)) for r in both]
        mv = [a for a, b in pairs if a is not None and b is not None]
        sv = [b for a, b in pairs if a is not None and b is not None]
        for st in _STATS:
            a, b = _stat(mv, st), _stat(sv, st)
            out["measured"][f"{st}_{m}_ms"] = None if a is None else a * 1e3
            out["simulated"][f"{st}_{m}_ms"] = None if b is None else b * 1e3
            out["error_pct"][f"{st}_{m}"] = (b - a) / a * 100.0 if a and b is not None else None
        apes = [abs(b - a) / a * 100.0 for a, b in zip(mv, sv, strict=True) if a > 0]
        out["median_ape_pct"][m] = percentile(apes, 50.0) if apes else None
    return out


def verdict(errors: dict[str, float | None], signed: bool = True) -> str:
    """The verdict line on the errors of the means (keys "mean_e2e", "mean_ttft", "mean_tpot", percent;
    `signed` False when they are absolute errors, e.g. medians over runs)."""
    parts, ok = [], True
    for m, goal in GOALS.items():
        e = errors.get(f"mean_{m}")
        if e is None:
            continue
        good = abs(e) <= goal
        ok &= good
        shown = f"{e:+.1f}%" if signed else f"|{e:.1f}%|"
        parts.append(f"mean {m.upper()} {shown} ({'within' if good else 'outside'} {goal:g}%)")
    return f"verdict: {'within the goals' if ok else 'outside the goals'}: " + "; ".join(parts)


def replay_run(run: RunFolder, profile: EngineProfile | None, kernels: str | None = "none", model: str | None = None,
               gpu: str | None = None, ranges: bool = False) -> dict[str, Any]:
    """Replay one run folder open-loop (each request at its queued_ts) and compare.

    The engine profile's step terms price the steps; its front-end term is not added (a run folder's
    times are the engine's own timestamps, taken after the front end). KV capacity: the folder's
    num_gpu_blocks x block_size, else derived (hardware.derived_kv_tokens). Scheduler: paged, vLLM's
    max_num_batched_tokens and max_num_seqs, the folder's block size, watermark 0 (vLLM v1's), and asynchronous
    scheduling in the event loop where async_lag says the run's engine scheduled ahead.

    Raises:
        ValueError: a run we cannot replay (an unknown model or GPU), named.

    A run with data_parallel_size > 1 is replayed as that many replicas, each with the folder's KV and
    scheduler limits, behind VllmDPRouter (vLLM's front-end load balancing).

    With `ranges`, the run is replayed twice more with every step scaled by stallfree.sim.studies.ranges'
    STEP_TIME_LOW and STEP_TIME_HIGH: the result gains "range" ({"mean_ttft_ms": [low, high], ...} over
    the three replays, ms) and "inside_range" (whether each measured figure lies in its range).
    """
    where = str(run.path)
    name, dtype = model_preset(run.model, run.dtype) if model is None else model_preset(model, run.dtype)
    device = gpu or run.device_name
    if not device:
        raise ValueError(f"{where}: neither meta.json nor config.json names the GPU: give --gpu")
    gpu_name, gpu_note = gpu_match(device, run.device_memory_bytes)
    try:
        price = pricing(name, gpu_name, run.tp, dtype, profile, kernels, engine_version=run.vllm_version or None,
                        kv_dtype=kv_dtype_of(run.kv_cache_dtype))
        if run.num_gpu_blocks is not None:
            kv, kv_src = run.num_gpu_blocks * run.block_size, "num_gpu_blocks of meta.json"
        else:
            mem = run.device_memory_bytes or getattr(price.base, "roofline", price.base).gpu.mem_bytes
            kv = derived_kv_tokens(price.base, mem, run.gpu_memory_utilization, run.block_size)
            kv_src = "derived (memory x utilization - weights - activation reserve)"
    except CostModelError as exc:
        hint = ""
        if "unknown model" in str(exc) and model is None:
            # Only for the run's own model name: a --model the user typed is named in `exc` already,
            # with its nearest preset.
            hint = (f" (model {run.model!r} has no preset and no config.json here or in aiconfigurator-core: "
                    "give --model PATH/config.json, the model's Hugging Face config)")
        elif "unknown GPU" in str(exc):
            hint = f" (device {device!r} matches no GPU preset: give --gpu PRESET)"
        raise ValueError(f"{where}: {exc}{hint}") from None
    wl = Workload(run.arrivals, run.prompt_lens, run.output_lens, name=run.path.name)
    lagged, lag_why = async_lag(run)
    # vLLM's asynchronous scheduling is modelled in the event loop (stallfree.sim.run.loop, "Asynchronous
    # scheduling"): a request that arrives while a step runs joins the batch one step later.
    # vLLM v1's admission (stallfree.sim.inputs.engine_behaviour.VLLM_ADMISSION_RULE): no watermark, as simulate's
    # default.
    watermark = engine_defaults({"kind": "kernels", "engine": "vllm", "version": run.vllm_version})["watermark"]
    sched = ReplicaConfig.of(kv, run.max_num_batched_tokens, run.max_num_seqs, async_scheduling=lagged,
                             kv_policy="paged", block_size=run.block_size, watermark=watermark["value"])
    dp_note = None

    def replay(cost: Any) -> Any:
        if run.dp > 1:
            # vLLM runs data_parallel_size engines, each with its own scheduler, KV cache and TP group, behind
            # one front end that routes each request by its load balancing (VllmDPRouter).
            return simulate_cluster(wl, sched, cost, run.dp, VllmDPRouter(), max_model_len=run.max_model_len).merged
        return simulate(wl, sched, cost, max_model_len=run.max_model_len)

    res = replay(price.cost_model)
    if run.dp > 1:
        dp_note = (f"{run.dp} data-parallel replicas behind vLLM's load balancing (4 x waiting + running); each "
                   "replica priced as the whole model on its own TP group"
                   + (" (its experts not split across the replicas: the expert-parallel all-to-all and the "
                      "ranks' lock-step are not priced)" if run.expert_parallel else ""))
    sim = latencies(res.timelines())
    measured: dict[Hashable, Latencies] = dict(enumerate(run.measured))
    fig = figures(measured, sim)
    if ranges:
        scaled = [figures(measured, latencies(replay(ScaledCost(price.cost_model, f)).timelines()))["simulated"]
                  for f in (STEP_TIME_LOW, STEP_TIME_HIGH)]
        fig["range"] = run_range(fig["simulated"], scaled, list(fig["simulated"]))
        fig["inside_range"] = {k: span[0] <= fig["measured"][k] <= span[1]
                               for k, span in fig["range"].items()
                               if span is not None and fig["measured"][k] is not None}
    fig.update({
        "run": run.path.name,
        "config": {"model": run.model, "cost_model_name": _model_label(name),
                   "gpu": gpu_name, "gpu_device": device, "gpu_note": gpu_note,
                   "kernels_version_note": price.version_note, "tp": run.tp, "dp": run.dp, "dp_note": dp_note,
                   "dtype": dtype, "kv_cache_dtype": run.kv_cache_dtype,
                   "vllm_version": run.vllm_version,
                   "max_num_batched_tokens": run.max_num_batched_tokens, "max_num_seqs": run.max_num_seqs,
                   "kv_tokens": kv, "kv_tokens_source": kv_src, "cost_model": price.provenance,
                   "engine_profile": price.profile.name, "steps": res.num_steps,
                   "async_scheduling_lag": lagged, "async_scheduling_why": lag_why},
        "per_request": [[(measured[r].value(m) or 0.0) * 1e3 for m in ("ttft", "e2e")]
                        + [(sim[r].value(m) or 0.0) * 1e3 for m in ("ttft", "e2e")] for r in measured if r in sim],
    })
    return fig




def async_lag(run: RunFolder) -> tuple[bool, str]:
    """Whether the run's engine scheduled asynchronously (so a request joins the batch one step later
    than a synchronous scheduler would take it), and why we think so: its resolved configuration's
    scheduler_config.async_scheduling where meta.json has one, else its vLLM version against
    ASYNC_SCHEDULING_DEFAULT_SINCE (vLLM's default from 0.14.0 on; pipeline parallelism and some
    speculative decoding turn it off, neither replayed here)."""
    if run.async_scheduling is not None:
        return run.async_scheduling, f"resolved_config.scheduler_config.async_scheduling = {run.async_scheduling}"
    return async_default(run.vllm_version)


def _model_label(name: str) -> str:
    """A model's name for the report: the preset, or a config's folder (ours) or file stem (the package's)."""
    if not name.endswith(".json"):
        return name
    p = Path(name)
    return p.name.removesuffix("_config.json") if p.name.endswith("_config.json") else p.parent.name


def _runs(path: Path) -> list[Path]:
    return [path] if is_run_folder(path) else sorted(c for c in path.iterdir() if is_run_folder(c))


def validate_runs(path: str | Path, profile: EngineProfile | None, kernels: str | None = "none",
                  model: str | None = None, gpu: str | None = None, ranges: bool = False) -> dict[str, Any]:
    """Replay a run folder, or every run folder inside `path`, and summarise.

    A run that cannot be replayed (replay_run's ValueError) is listed under "skipped" with the reason.
    No run folder is fitted on: the engine profiles are fitted on benchmark rows (their `fitted_on`) and
    no calibration reads run folders, so every run is held out and the verdict is theirs. The signed
    bias (the mean signed error over the runs, percent) stands beside each median |error|: a replay that
    is fast on every run says so where a median |error| would not.

    Returns:
        {"format": "runs", "runs": [replay_run results], "skipped": [{"run", "reason"}],
        "summary": {"median_abs_error_pct": {"mean_ttft", ...}, "mean_signed_error_pct": {...},
        "held_out_runs", "fitted_runs" (0), and with `ranges` "range_coverage" (the share of runs whose
        measured figure lies in its range, per figure) and "range_median_rel_width" (the median over runs
        of (high - low) / simulated)}, "verdict": line, "engine_profile": ...}.

    Raises:
        ValueError: a malformed folder (file and line named), or no run could be replayed.
    """
    runs, skipped = [], []
    for folder in _runs(Path(path)):
        run = read_run_folder(folder)
        try:
            runs.append(replay_run(run, profile, kernels, model, gpu, ranges))
        except ValueError as exc:
            skipped.append({"run": folder.name, "reason": str(exc)})
    if not runs:
        raise ValueError(f"--against {str(path)!r}: no run could be replayed: "
                         + "; ".join(s["reason"] for s in skipped))
    summary: dict[str, float | None] = {}
    bias: dict[str, float | None] = {}
    for m in RUN_METRICS:
        for st in _STATS:
            errs = [r["error_pct"][f"{st}_{m}"] for r in runs if r["error_pct"][f"{st}_{m}"] is not None]
            summary[f"{st}_{m}"] = percentile([abs(e) for e in errs], 50.0) if errs else None
            bias[f"{st}_{m}"] = sum(errs) / len(errs) if errs else None
    signed = runs[0]["error_pct"] if len(runs) == 1 else summary
    line = verdict(signed, len(runs) == 1)
    if len(runs) > 1:
        line += (f" (median |error| over {len(runs)} held-out runs; signed bias TTFT {bias['mean_ttft']:+.1f}%, "
                 f"TPOT {bias['mean_tpot']:+.1f}%, E2E {bias['mean_e2e']:+.1f}%)")
    out_summary: dict[str, Any] = {"median_abs_error_pct": summary, "mean_signed_error_pct": bias,
                                   "held_out_runs": len(runs), "fitted_runs": 0}
    if ranges:
        out_summary.update(_coverage(runs))
    return {"format": "runs", "runs": runs, "skipped": skipped, "summary": out_summary, "verdict": line,
            "engine_profile": describe_profile(profile), "kernels": kernels}


def _coverage(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranges' coverage (share of runs whose measured figure is inside) and median relative width."""
    coverage: dict[str, float] = {}
    width: dict[str, float] = {}
    for key in runs[0]["range"]:
        inside = [r["inside_range"][key] for r in runs if key in r.get("inside_range", {})]
        widths = [(r["range"][key][1] - r["range"][key][0]) / r["simulated"][key] for r in runs
                  if r["range"].get(key) and r["simulated"].get(key)]
        if inside:
            coverage[key] = sum(inside) / len(inside)
        if widths:
            width[key] = percentile(widths, 50.0)
    return {"range_coverage": coverage, "range_median_rel_width": width}


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:+.1f}{unit}" if unit == "%" else f"{v:,.1f}{unit}"


def print_runs(res: dict[str, Any]) -> None:
    """Print each run's figures, measured beside simulated with the error, and the summary."""
    print(res["engine_profile"])
    for r in res["runs"]:
        c = r["config"]
        kv_note = "" if c.get("kv_cache_dtype", "auto") == "auto" else f", KV {c['kv_cache_dtype']}"
        print(f"\n{r['run']}: {r['requests']} requests; {c['cost_model_name']} on {c['tp']} x {c['gpu']} "
              f"{c['dtype']}{kv_note}; budget {c['max_num_batched_tokens']:,}, max_num_seqs {c['max_num_seqs']}, "
              f"KV {c['kv_tokens']:,} tokens ({c['kv_tokens_source']})")
        print(f"  steps priced by the {c['cost_model']}")
        if c.get("gpu_note"):
            print(f"  GPU {c['gpu_device']!r}: {c['gpu_note']}")
        if c.get("async_scheduling_lag"):
            print(f"  asynchronous scheduling ({c['async_scheduling_why']}): replayed with the step planned while "
                  "the previous one runs (a request arriving during a step joins one step later)")
        if c.get("dp_note"):
            print(f"  {c['dp_note']}")
        if c.get("kernels_version_note"):
            print(f"  {c['kernels_version_note']}")
        spans = r.get("range") or {}
        print(f"  {'figure':<10} {'measured ms':>12} {'simulated ms':>13} {'error':>8}"
              + (f" {'range ms':>23}" if spans else ""))
        for m in RUN_METRICS:
            for st in _STATS:
                k = f"{st}_{m}"
                span = spans.get(k + "_ms")
                inside = "" if span is None else ("" if r["inside_range"].get(k + "_ms") else " (outside)")
                print(f"  {m.upper() + ' ' + st:<10} {_fmt(r['measured'][k + '_ms']):>12} "
                      f"{_fmt(r['simulated'][k + '_ms']):>13} {_fmt(r['error_pct'][k], '%'):>8}"
                      + ("" if span is None else f" {_fmt(span[0]) + '-' + _fmt(span[1]):>23}{inside}"))
    for s in res["skipped"]:
        print(f"\nskipped {s['run']}: {s['reason']}")
    if len(res["runs"]) > 1:
        med = res["summary"]["median_abs_error_pct"]
        bias = res["summary"].get("mean_signed_error_pct", {})
        print("\nmedian |error| over runs (signed bias): " + ", ".join(
            f"{m.upper()} mean {_fmt(med[f'mean_{m}'])}% ({_fmt(bias.get(f'mean_{m}'), '%')}) p99 "
            f"{_fmt(med[f'p99_{m}'])}% ({_fmt(bias.get(f'p99_{m}'), '%')})" for m in RUN_METRICS))
    cov = res["summary"].get("range_coverage")
    if cov:
        width = res["summary"]["range_median_rel_width"]
        print("ranges (every step at x" + f"{STEP_TIME_LOW:g} and x{STEP_TIME_HIGH:g}): measured inside on "
              + ", ".join(f"{k.removesuffix('_ms')} {cov[k]:.0%} (median width {width.get(k, 0):.0%})"
                          for k in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2e_ms", "p99_ttft_ms") if k in cov)
              + " of runs")
    print(res["verdict"])


def plot_runs(path: Path, res: dict[str, Any]) -> None:
    """Scatter simulated against measured TTFT and E2E per request, one colour per run, y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for j, (ax, metric) in enumerate(zip(axes, ("TTFT", "E2E"), strict=True)):
        for r in res["runs"]:
            pts = r["per_request"]
            ax.scatter([p[j] for p in pts], [p[2 + j] for p in pts], s=6, alpha=0.6, label=r["run"])
        lim = max([max(p[j], p[2 + j]) for r in res["runs"] for p in r["per_request"]] + [1.0]) * 1.05
        ax.plot([0, lim], [0, lim], color="grey", linewidth=1)
        ax.set_xlabel(f"measured {metric} (ms)")
        ax.set_ylabel(f"simulated {metric} (ms)")
        ax.legend(fontsize=7)
    fig.suptitle("stallfree validate --against: simulated against measured, per request")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dump(res: dict[str, Any]) -> str:
    """The result as JSON text, without the per-request points (they are for the plot)."""
    def strip(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k != "per_request"}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o
    return json.dumps(strip(res), indent=1)
