"""Reports of simulations: the summary (vLLM's serving-benchmark keys plus scheduler figures),
per-request and per-step records, terminal tables and JSON/CSV files.

Imports allowed: the standard library, stallfree.core and stallfree.sim; numpy and rich only inside
functions (lazily), so that the event loop never loads them.

The summary follows the definitions of stallfree.core.metrics exactly (the test suite checks it
against stallfree.core.metrics.summarize); it is computed with numpy because a whole trace has
millions of inter-token gaps.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stallfree.core.metrics import DEFAULT_PERCENTILES, throughput_figures
from stallfree.sim.buckets import bucket_stats, prompt_bucket
from stallfree.sim.buckets import table_rows as bucket_table_rows
from stallfree.sim.session_run import session_summary
from stallfree.sim.simulator import SimResult

__all__ = [
    "latency_arrays",
    "print_table",
    "request_records",
    "slo_met",
    "step_records",
    "summarize_result",
    "write_records",
    "write_steps_csv",
]


def latency_arrays(res: SimResult) -> dict[str, Any]:
    """Per-request TTFT, TPOT, E2E, queueing delay (s) and all inter-token gaps, as numpy arrays.

    Returns:
        dict with "rids" [n_done], "ttft" [n_done], "tpot" [n_multi] (requests with >= 2 tokens),
        "tpot_rids" [n_multi], "e2e" [n_done], "queue" [n_done], "itl" [total tokens - n_done],
        "tokens" [n_done] (tokens emitted), all in seconds except the counts. TTFT and E2E include the
        engine profile's front-end time when the result's config has ``frontend_s`` (s; set by
        simulate when the cost model is a stallfree.sim.engine_profile.ProfiledCostModel); the queueing
        delay, TPOT and the gaps are the engine's.
    """
    import numpy as np

    end = np.frombuffer(res.step_end, dtype=np.float64)
    start = np.frombuffer(res.step_start, dtype=np.float64)
    dec = np.frombuffer(res.step_decodes, dtype=np.int64)
    ticks = np.frombuffer(res.step_ticks, dtype=np.int64)
    first = np.asarray(res.first_step, dtype=np.int64)
    fin = np.asarray(res.finish_step, dtype=np.int64)
    adm = np.asarray(res.admit_step, dtype=np.int64)
    arrival = np.asarray(res.arrival, dtype=np.float64)
    done = np.flatnonzero((fin >= 0) & (first >= 0))
    irregular = set(res.skips) | set(res.segments)
    tokens = np.asarray([res.target[r] for r in done.tolist()], dtype=np.int64)
    out: dict[str, Any] = {"rids": done, "tokens": tokens}
    a, b = first[done], fin[done]
    # An engine profile's front end (config frontend_s, s): the client's TTFT and E2E include it.
    frontend = float(res.config.get("frontend_s", 0.0))
    out["ttft"] = end[a] - arrival[done] + frontend
    out["e2e"] = end[b] - arrival[done] + frontend
    out["queue"] = start[adm[done]] - arrival[done]
    multi = tokens > 1
    out["tpot"] = (end[b][multi] - end[a][multi]) / (tokens[multi] - 1)
    out["tpot_rids"] = done[multi]
    # Inter-token gaps of the regular requests, vectorised: the token steps of a request are its
    # first-token step a, then every step in (a, b] that had decodes.
    reg = np.ones(len(done), dtype=bool)
    if irregular:
        reg = np.asarray([r not in irregular for r in done.tolist()], dtype=bool)
    ra, rb = a[reg], b[reg]
    lengths = rb - ra
    total = int(lengths.sum())
    gaps = [np.empty(0)]
    if total:
        owner = np.repeat(np.arange(len(ra)), lengths)
        offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        steps = ra[owner] + offsets + 1
        keep = dec[steps] > 0
        steps, owner = steps[keep], owner[keep]
        prev = np.empty_like(steps)
        prev[1:] = steps[:-1]
        new_owner = np.ones(len(steps), dtype=bool)
        new_owner[1:] = owner[1:] != owner[:-1]
        prev[new_owner] = ra[owner[new_owner]]
        gaps.append(end[steps] - end[prev])
        assert int(ticks[rb].sum() - ticks[ra].sum()) == len(steps)
    for r in sorted(irregular):
        if res.finish_step[r] >= 0:
            gaps.append(np.diff(np.asarray(res.token_times(r))))
    out["itl"] = np.concatenate(gaps)
    return out


def _stats(name: str, values: Any, percentiles: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [
        f"p{q:g}_{name}_ms" for q in percentiles
    ]
    if len(values) == 0:
        return dict.fromkeys(keys, None)
    ms = values * 1e3
    out: dict[str, float | None] = {
        keys[0]: float(np.mean(ms)),
        keys[1]: float(np.median(ms)),
        keys[2]: float(np.std(ms)),
    }
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = float(np.percentile(ms, q))
    return out


def _throughputs(
    res: SimResult, lat: dict[str, Any], slo_ttft: float | None, slo_tpot: float | None
) -> dict[str, Any]:
    """The totals and rates of a run that completed requests, for summarize_result: completed,
    total_{input,output}_tokens, duration_s (first arrival to last finish, s), request_, output_ and
    total_token_throughput (per s), request_goodput and slo_attainment (None without an SLO), and a
    closed loop's achieved_request_rate. `lat`: latency_arrays(res)."""
    import numpy as np

    done = lat["rids"]
    end = np.frombuffer(res.step_end, dtype=np.float64)
    arrival = np.asarray(res.arrival, dtype=np.float64)
    fin = np.asarray(res.finish_step, dtype=np.int64)[done]
    duration = float(end[fin].max() - arrival.min())
    n_out = int(lat["tokens"].sum())
    n_in = int(sum(res.prompt_len[r] for r in done.tolist()))
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: math.inf)
    out: dict[str, Any] = throughput_figures(len(done), n_in, n_out, duration)
    out["slo_attainment"] = None
    if "concurrency" in res.config:
        # Closed loop: the rate the clients reached, requests sent (refused ones too) per second.
        out["achieved_request_rate"] = rate(res.num_requests)
    if slo_ttft is not None or slo_tpot is not None:
        good = slo_met(lat, slo_ttft, slo_tpot)
        out["request_goodput"] = rate(int(good.sum()))
        out["slo_attainment"] = float(good.mean())
    return out


def summarize_result(
    res: SimResult,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """Summarize a simulation: the keys of stallfree.core.metrics.summarize plus the scheduler's.

    Args:
        res: the simulation.
        slo_ttft: TTFT objective for goodput, s (None: none).
        slo_tpot: TPOT objective for goodput, s (None: none).
        percentiles: which percentiles to report (default 50, 90, 99).

    Returns:
        A flat dict: label, workload, num_requests, rejected, rejected_by_reason (a dict: kind ->
        count, kinds "context_length" and "kv_capacity"), completed, total_input_tokens,
        total_output_tokens, duration_s, request_throughput, output_throughput,
        total_token_throughput, request_goodput, slo_attainment, {mean,median,std,pXX}_{ttft,
        tpot,itl,e2el,queue}_ms, num_steps, mean_tokens_per_step, budget_utilization (mean tokens
        per step / token budget), queued_fraction (share of steps after which requests waited),
        mean_kv_utilization and max_kv_utilization (reserved / total KV, time-weighted mean and
        maximum), mean_running_decodes, sim_wall_s, by_prompt_len (stallfree.sim.buckets.bucket_stats:
        per prompt-length bucket, requests and the median and p99 TTFT, TPOT and E2E, ms); plus the
        scheduler config. A session run (stallfree.sim.sessions) adds ttft_by_turn and sessions
        (stallfree.sim.sessions.session_summary). A closed-loop run
        (config concurrency, think_time_s) adds achieved_request_rate: requests sent (refused ones
        included) / duration_s, requests/s.
    """
    pcts = tuple(percentiles)
    lat = latency_arrays(res)
    done = lat["rids"]
    n_done = len(done)
    out: dict[str, Any] = {"label": res.label, "workload": res.workload, **res.config}
    out["num_requests"] = res.num_requests
    out["rejected"] = len(res.rejected)
    out["rejected_by_reason"] = res.rejected_by_reason
    if n_done == 0:
        out["completed"] = 0
        return out
    out.update(_throughputs(res, lat, slo_ttft, slo_tpot))
    for name, key in (
        ("ttft", "ttft"),
        ("tpot", "tpot"),
        ("itl", "itl"),
        ("e2el", "e2e"),
        ("queue", "queue"),
    ):
        out.update(_stats(name, lat[key], pcts))
    out["by_prompt_len"] = bucket_stats(lat, res.prompt_len)
    out.update(_step_figures(res))
    if res.session_keys is not None:
        out.update(session_summary(res, float(res.config.get("frontend_s", 0.0))))
        # As under closed-loop load, the replica sets the request rate: turns sent / duration.
        sent = res.num_requests - res.rejected_by_reason.get("session_ended", 0)
        out["achieved_request_rate"] = sent / out["duration_s"] if out.get("duration_s") else None
    return out


def slo_met(lat: dict[str, Any], slo_ttft: float | None, slo_tpot: float | None) -> Any:
    """Per finished request (latency_arrays order), whether it met both SLOs (s; None: no objective):
    a numpy bool array [n_done]. A request of one token has no TPOT and meets any TPOT objective."""
    import numpy as np

    done = lat["rids"]
    good = np.ones(len(done), dtype=bool)
    if slo_ttft is not None:
        good &= lat["ttft"] <= slo_ttft
    if slo_tpot is not None:
        tpot_ok = np.ones(len(done), dtype=bool)
        tpot_ok[np.searchsorted(done, lat["tpot_rids"])] = lat["tpot"] <= slo_tpot
        good &= tpot_ok
    return good


def _step_figures(res: SimResult) -> dict[str, Any]:
    """The scheduler's figures of summarize_result, from the step arrays and the result's counters."""
    import numpy as np

    end = np.frombuffer(res.step_end, dtype=np.float64)
    start = np.frombuffer(res.step_start, dtype=np.float64)
    dur = end - start
    busy = float(dur.sum())
    tokens = np.frombuffer(res.step_tokens, dtype=np.int64)
    budget = res.config.get("token_budget")
    kv = np.frombuffer(res.step_kv_used, dtype=np.int64)
    waiting = np.frombuffer(res.step_waiting, dtype=np.int64)
    decodes = np.frombuffer(res.step_decodes, dtype=np.int64)
    return dict(
        num_steps=res.num_steps,
        mean_tokens_per_step=float(tokens.mean()),
        budget_utilization=float(tokens.mean() / budget) if budget else None,
        queued_fraction=float((waiting > 0).mean()),
        mean_kv_utilization=float((kv * dur).sum() / busy / res.kv_total) if res.kv_total and busy else None,
        max_kv_utilization=float(kv.max() / res.kv_total) if res.kv_total else None,
        mean_running_decodes=float((decodes * dur).sum() / busy) if busy else 0.0,
        num_preemptions=res.num_preemptions,
        num_recomputed_tokens=res.num_recomputed_tokens,
        prefix_cache_hit_rate=res.prefix_cache_hit_rate,
        prefix_cache_hit_rate_bound=res.prefix_cache_hit_rate_bound,
        prefix_cache_evictions=res.prefix_cache_evictions,
        prefix_cache_hit_rate_first_admission=res.prefix_cache_hit_rate_first_admission,
        kv_tier=res.kv_tier,
        sim_wall_s=res.wall_s,
    )


def request_records(res: SimResult, replica: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One dict per request: rid, arrival_s, prompt_len, prompt_bucket (stallfree.sim.buckets),
    max_new, output_tokens, admitted_s, first_token_s, finish_s, ttft_ms, tpot_ms, e2el_ms,
    queue_ms, finish_reason, rejected (the message), rejected_reason ("context_length", "kv_capacity" or None).
    Times are None for rejected requests; tpot_ms is None below 2 tokens. With `replica` (a
    cluster's replica per request, -1 for one refused at arrival) a `replica` column follows rid
    (None where -1). A session run's rows end with session_id and turn. ttft_ms and e2el_ms include
    the engine profile's front end (config frontend_s,
    as latency_arrays); the step times (admitted_s, first_token_s, finish_s) are the engine's."""
    start, end = res.step_start, res.step_end
    frontend = float(res.config.get("frontend_s", 0.0))
    rejected = dict(res.rejected)
    keys = res.session_keys
    rows = []
    for r in range(res.num_requests):
        a, f, adm = res.first_step[r], res.finish_step[r], res.admit_step[r]
        arr = res.arrival[r]
        row: dict[str, Any] = {"rid": r}
        if replica is not None:
            row["replica"] = replica[r] if replica[r] >= 0 else None
        row |= {
            "arrival_s": arr,
            "prompt_len": res.prompt_len[r],
            "prompt_bucket": prompt_bucket(res.prompt_len[r]),
            "max_new": res.max_new[r],
            "output_tokens": res.target[r] if f >= 0 else 0,
            "admitted_s": start[adm] if adm >= 0 else None,
            "first_token_s": end[a] if a >= 0 else None,
            "finish_s": end[f] if f >= 0 else None,
            "finish_reason": res.finish_reason[r] or None,
            "rejected": rejected.get(r),
            "rejected_reason": res.rejected_kind.get(r) if r in rejected else None,
        }
        row["ttft_ms"] = (end[a] - arr + frontend) * 1e3 if a >= 0 else None
        row["e2el_ms"] = (end[f] - arr + frontend) * 1e3 if f >= 0 else None
        row["queue_ms"] = (start[adm] - arr) * 1e3 if adm >= 0 else None
        n = row["output_tokens"]
        row["tpot_ms"] = (end[f] - end[a]) / (n - 1) * 1e3 if f >= 0 and n > 1 else None
        if keys is not None:
            row["session_id"], row["turn"] = keys[r]
        rows.append(row)
    return rows


def step_records(res: SimResult, step_base: Sequence[int] | None = None) -> Iterable[dict[str, Any]]:
    """One dict per step: step, start_s, end_s, num_tokens, num_decodes, prefill_tokens,
    kv_used_tokens, kv_utilization, num_waiting. With `step_base` (a merged cluster result's first
    row per replica, N + 1 entries) each row starts with its `replica`, and `step` counts that
    replica's own steps."""
    kv_total = res.kv_total or 1
    k = 0
    for s in range(res.num_steps):
        tok, dec, kv = res.step_tokens[s], res.step_decodes[s], res.step_kv_used[s]
        row: dict[str, Any] = {}
        if step_base is not None:
            while s >= step_base[k + 1]:
                k += 1
            row = {"replica": k}
        yield row | {
            "step": s - (step_base[k] if step_base is not None else 0),
            "start_s": res.step_start[s],
            "end_s": res.step_end[s],
            "num_tokens": tok,
            "num_decodes": dec,
            "prefill_tokens": tok - dec,
            "kv_used_tokens": kv,
            "kv_utilization": kv / kv_total,
            "num_waiting": res.step_waiting[s],
        }


def write_records(res: SimResult, path: Path, replica: Sequence[int] | None = None) -> None:
    """Write the per-request records to `path`: JSON if it ends in .json, else CSV (with `replica`,
    a cluster's replica per request: a replica column, as request_records).

    Raises:
        OSError: the file cannot be written.
    """
    rows = request_records(res, replica)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        return
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["rid"])
        writer.writeheader()
        writer.writerows(rows)


def write_steps_csv(res: SimResult, path: Path, step_base: Sequence[int] | None = None) -> None:
    """Write the per-step records (KV utilisation over time, tokens per step) as CSV (with
    `step_base`, a cluster's: a replica column, as step_records).

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(
            fh,
            fieldnames=[
                *(["replica"] if step_base is not None else []),
                "step",
                "start_s",
                "end_s",
                "num_tokens",
                "num_decodes",
                "prefill_tokens",
                "kv_used_tokens",
                "kv_utilization",
                "num_waiting",
            ],
        )
        writer.writeheader()
        writer.writerows(step_records(res, step_base))


_TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("completed", "completed requests", "{:,}"),
    ("rejected_by_reason.context_length", "rejected: over context length", "{:,}"),
    ("rejected_by_reason.kv_capacity", "rejected: never fits the KV", "{:,}"),
    ("request_throughput", "requests/s", "{:,.2f}"),
    ("output_throughput", "output tokens/s", "{:,.0f}"),
    ("request_goodput", "goodput (req/s)", "{:,.2f}"),
    ("slo_attainment", "SLO attainment", "{:.1%}"),
    ("mean_ttft_ms", "TTFT mean (ms)", "{:,.1f}"),
    ("median_ttft_ms", "TTFT median (ms)", "{:,.1f}"),
    ("p90_ttft_ms", "TTFT p90 (ms)", "{:,.1f}"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "{:,.1f}"),
    ("mean_tpot_ms", "TPOT mean (ms)", "{:,.2f}"),
    ("median_tpot_ms", "TPOT median (ms)", "{:,.2f}"),
    ("p90_tpot_ms", "TPOT p90 (ms)", "{:,.2f}"),
    ("p99_tpot_ms", "TPOT p99 (ms)", "{:,.2f}"),
    ("mean_itl_ms", "ITL mean (ms)", "{:,.2f}"),
    ("p99_itl_ms", "ITL p99 (ms)", "{:,.2f}"),
    ("mean_e2el_ms", "E2E mean (ms)", "{:,.0f}"),
    ("p99_e2el_ms", "E2E p99 (ms)", "{:,.0f}"),
    ("mean_queue_ms", "queueing mean (ms)", "{:,.1f}"),
    ("p99_queue_ms", "queueing p99 (ms)", "{:,.1f}"),
    ("mean_tokens_per_step", "tokens/step", "{:,.1f}"),
    ("budget_utilization", "budget utilization", "{:.1%}"),
    ("mean_running_decodes", "running decodes (mean)", "{:,.1f}"),
    ("mean_kv_utilization", "KV utilization mean", "{:.1%}"),
    ("max_kv_utilization", "KV utilization max", "{:.1%}"),
    ("num_preemptions", "preemptions", "{:,}"),
    ("num_recomputed_tokens", "recomputed tokens", "{:,}"),
    ("prefix_cache_hit_rate", "prefix cache hit rate", "{:.1%}"),
    ("prefix_cache_hit_rate_bound", "prefix cache hit bound (infinite cache)", "{:.1%}"),
    ("prefix_cache_evictions", "prefix cache evictions", "{:,}"),
    ("kv_tier.cpu_kv_tokens", "CPU KV tier (tokens)", "{:,}"),
    ("kv_tier.hit_rate_gpu", "hit rate, GPU tier", "{:.1%}"),
    ("kv_tier.hit_rate_cpu", "hit rate, CPU tier", "{:.1%}"),
    ("kv_tier.first_admission_hit_rate_gpu", "1st-admission hit rate, GPU tier", "{:.1%}"),
    ("kv_tier.first_admission_hit_rate_cpu", "1st-admission hit rate, CPU tier", "{:.1%}"),
    ("kv_tier.kv_loads", "KV blocks loaded from CPU", "{:,}"),
    ("kv_tier.kv_offloads", "KV blocks offloaded to CPU", "{:,}"),
    ("num_steps", "steps", "{:,}"),
    ("sim_wall_s", "simulation wall time (s)", "{:,.2f}"),
)


def _value(summary: dict[str, Any], key: str) -> Any:
    """A summary's value; "a.b" reads key b of the dict at a (0 when the dict lacks it)."""
    if "." not in key:
        return summary.get(key)
    outer, inner = key.split(".", 1)
    d = summary.get(outer)
    return None if d is None else d.get(inner, 0)


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return spec.format(value)


def console() -> Any:
    """A rich Console for stdout; wide when stdout is not a terminal, so piped tables are not cut."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def print_table(summaries: Sequence[dict[str, Any]], title: str | None = None) -> None:
    """Print summaries side by side on the terminal (rich), one column per run."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for s in summaries:
        table.add_column(str(s.get("label", "")), justify="right")
    for key, name, spec in _TABLE_ROWS:
        if all(s.get(key) is None for s in summaries) and key in ("request_goodput", "slo_attainment"):
            continue
        if key.startswith("kv_tier.") and all(s.get("kv_tier") is None for s in summaries):
            continue
        # The cache rows when caching is on in any run; "-" in a run without it.
        if key.startswith("prefix_cache_") and all(s.get("prefix_cache_hit_rate") is None for s in summaries):
            continue
        if key.startswith("prefix_cache_"):
            table.add_row(name, *(_fmt(_value(s, key) if s.get("prefix_cache_hit_rate") is not None else None, spec)
                                  for s in summaries))
            continue
        table.add_row(name, *(_fmt(_value(s, key), spec) for s in summaries))
        if key == "p99_queue_ms":
            for title, cells in bucket_table_rows(summaries):
                table.add_row(title, *cells)
            for title, cells in _session_rows(summaries):
                table.add_row(title, *cells)
    console().print(table)


#: The most turns whose TTFT the table shows one row each (the JSON has every turn).
_TABLE_TURNS = 10


def _session_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Rows of a session run (ttft_by_turn, sessions): mean | p99 TTFT by turn for the first turns, the
    sessions completed and those ended early; none when no run has sessions."""
    if all(s.get("ttft_by_turn") is None for s in summaries):
        return []
    turns = sorted({t["turn"] for s in summaries for t in s.get("ttft_by_turn") or ()})[:_TABLE_TURNS]
    rows = []
    for k in turns:
        cells = []
        for s in summaries:
            t = next((t for t in s.get("ttft_by_turn") or () if t["turn"] == k), None)
            cells.append("-" if t is None else f"{t['mean_ttft_ms']:,.1f} | {t['p99_ttft_ms']:,.1f}")
        rows.append((f"TTFT mean | p99 (ms), turn {k}", cells))
    done = [None if s.get("sessions") is None else s["sessions"] for s in summaries]
    rows.append(("sessions completed", ["-" if x is None else f"{x['completed']:,} of {x['num_sessions']:,}"
                                        for x in done]))
    rows.append(("sessions ended early", ["-" if x is None else f"{sum(x['ended_by_reason'].values()):,}"
                                          for x in done]))
    return rows
