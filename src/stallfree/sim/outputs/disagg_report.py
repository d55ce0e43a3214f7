"""What a disaggregated run reports: its summary (one run's keys, plus each side's replicas and the KV
transfers) and its per-request records.

Imports allowed: the standard library, stallfree.core, stallfree.sim.run and stallfree.sim.outputs.
"""

from __future__ import annotations

import math
from typing import Any

from stallfree.core.metrics import summarize
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.buckets import bucket_stats
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.disagg import DisaggResult

__all__ = [
    "RECORD_FIELDS",
    "SIDE_KEYS",
    "disagg_records",
    "disagg_summary",
    "side_figures",
]


def disagg_summary(
    result: DisaggResult, num_requests: int, slo_ttft: float | None = None, slo_tpot: float | None = None
) -> dict[str, Any]:
    """The cluster-wide summary with the single-run keys (stallfree.core.metrics.summarize over the
    joined timelines, plus num_requests, rejected, rejected_by_reason, slo_attainment), transfer figures
    (mean and p99 transfer ms, link name, bandwidth, latency, KV bytes per token), and `replicas`:
    one report.summarize_result per replica with its `role` ("prefill" or "decode") and index, and
    `by_prompt_len` (the joined timelines' figures per prompt-length bucket, as a single run's), and
    `sides`: {"prefill": ..., "decode": ...}, each side's per-step figures (side_figures; the console table
    shows them as "P x | D y", a cluster-wide figure would mix the two sides' steps).
    """

    out: dict[str, Any] = {"num_requests": num_requests, "rejected": len(result.rejected)}
    by: dict[str, int] = {}
    for kind in result.rejected_kind.values():
        by[kind] = by.get(kind, 0) + 1
    out["rejected_by_reason"] = by
    if result.timelines:
        out.update(summarize(result.timelines, slo_ttft, slo_tpot))
        # As a single run reports it: the share of completed requests within the SLOs.
        good, rate = out.get("request_goodput"), out.get("request_throughput")
        out["slo_attainment"] = good / rate if good is not None and rate else None
    else:
        out["completed"] = 0
    moves = sorted(e - s for s, e in zip(result.transfer_start, result.transfer_end, strict=True) if e == e)
    out.update(
        interconnect=result.link.name,
        link_bandwidth_bytes_per_s=result.link.bandwidth_bytes_per_s,
        link_latency_s=result.link.latency_s,
        kv_bytes_per_token=result.kv_bytes_per_token,
        num_transfers=len(moves),
        mean_transfer_ms=sum(moves) / len(moves) * 1e3 if moves else None,
        p99_transfer_ms=moves[min(len(moves) - 1, math.ceil(0.99 * len(moves)) - 1)] * 1e3 if moves else None,
        prefill_replicas=len(result.prefill),
        decode_replicas=len(result.decode),
        sim_wall_s=result.wall_s,
    )
    reps = []
    sides = (("prefill", result.prefill, result.prefill_of), ("decode", result.decode, result.decode_of))
    for role, results, of in sides:
        for k, res in enumerate(results):
            s = summarize_result(res)
            s.update(role=role, replica=k, num_requests=sum(1 for x in of if x == k))
            reps.append(s)
    out["replicas"] = reps
    out["by_prompt_len"] = _buckets(result)
    out["sides"] = {role: side_figures([r for r in reps if r["role"] == role]) for role in ("prefill", "decode")}
    return out


def _buckets(result: DisaggResult) -> dict[str, dict[str, Any]]:
    """The joined timelines' figures per prompt-length bucket, as a single run's by_prompt_len
    (stallfree.sim.outputs.buckets.bucket_stats: TTFT, TPOT and E2E from the client's arrival, ms)."""
    import numpy as np

    tl = result.timelines
    plens = [0] * len(result.prefill_of)
    for t in tl:
        plens[int(t.rid)] = t.prompt_len
    multi = [t for t in tl if len(t.token_times) > 1]
    lat = {
        "rids": np.asarray([int(t.rid) for t in tl], dtype=np.int64),
        "ttft": np.asarray([t.token_times[0] - t.arrival for t in tl], dtype=np.float64),
        "e2e": np.asarray([t.token_times[-1] - t.arrival for t in tl], dtype=np.float64),
        "tpot_rids": np.asarray([int(t.rid) for t in multi], dtype=np.int64),
        "tpot": np.asarray([(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in multi],
                           dtype=np.float64),
    }
    return bucket_stats(lat, plens)


#: The per-step keys a disaggregated run states per side (`sides`), not for the cluster as a whole.
SIDE_KEYS = (
    "mean_tokens_per_step", "budget_utilization", "mean_running_decodes", "mean_kv_utilization",
    "max_kv_utilization", "num_preemptions", "num_recomputed_tokens", "num_steps",
)


def side_figures(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's SIDE_KEYS from its replicas' summaries: tokens/step and budget utilization over all the
    side's steps (tokens; fraction), running decodes (requests) and mean KV utilization (fraction) the
    mean over its replicas, max KV utilization the highest, preemptions, recomputed tokens and steps
    summed; None where no replica has the figure (a side that ran no step)."""

    def vals(key: str) -> list[tuple[float, int]]:
        out = []
        for r in reps:
            v = r.get(key)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                out.append((v, int(r.get("num_steps") or 0)))
        return out

    def weighted(key: str) -> float | None:
        got = vals(key)
        steps = sum(n for _, n in got)
        return sum(v * n for v, n in got) / steps if steps else None

    def mean(key: str) -> float | None:
        got = vals(key)
        return sum(v for v, _ in got) / len(got) if got else None

    def top(key: str) -> float | None:
        got = vals(key)
        return max(v for v, _ in got) if got else None

    def total(key: str) -> int | None:
        got = vals(key)
        return sum(int(v) for v, _ in got) if got else None

    return {
        "mean_tokens_per_step": weighted("mean_tokens_per_step"),
        "budget_utilization": weighted("budget_utilization"),
        "mean_running_decodes": mean("mean_running_decodes"),
        "mean_kv_utilization": mean("mean_kv_utilization"),
        "max_kv_utilization": top("max_kv_utilization"),
        "num_preemptions": total("num_preemptions"),
        "num_recomputed_tokens": total("num_recomputed_tokens"),
        "num_steps": total("num_steps"),
    }


#: Columns of disagg_records, in order.
RECORD_FIELDS = (
    "rid", "arrival_s", "prompt_len", "max_new", "output_tokens", "prefill_replica", "decode_replica",
    "admitted_s", "first_token_s", "transfer_start_s", "transfer_end_s", "transfer_ms", "decode_admitted_s",
    "finish_s", "ttft_ms", "tpot_ms", "e2el_ms", "queue_ms", "finish_reason", "rejected", "rejected_reason",
)


def disagg_records(result: DisaggResult, workload: Workload) -> list[dict[str, Any]]:
    """One dict per request of `workload` (the one simulated), the keys RECORD_FIELDS: the single-run
    record's (report.request_records) plus the replica that prefilled it and the one that decoded it
    (None: none), its transfer's start and end (s) and length (ms), and when the decode side admitted
    it (s). admitted_s and queue_ms are the prefill side's; finish_reason is "length" when the request
    generated max_new tokens, else "stop". Times are None for a rejected or unfinished request and
    for a step it never took (no transfer for a single-token request); tpot_ms is None below 2 tokens.

    Raises:
        ValueError: `workload` has a different number of requests than the result.
    """
    n = len(workload)
    if len(result.prefill_of) != n:
        raise ValueError(f"the workload has {n} requests; the result {len(result.prefill_of)}")
    tl = {int(t.rid): t for t in result.timelines}
    why = dict(result.rejected)
    rows = []
    for r in range(n):
        t = tl.get(r)
        k, d = result.prefill_of[r], result.decode_of[r]
        arr = result.arrival[r] if result.arrival else workload.arrivals[r]
        adm = result.prefill[k].admit_step[r] if k >= 0 else -1
        dadm = result.decode[d].admit_step[r] if d >= 0 else -1
        t0, t1 = result.transfer_start[r], result.transfer_end[r]
        cap = result.max_new[r] if result.max_new else None
        ntok = len(t.token_times) if t is not None else 0
        first = t.token_times[0] if t is not None else None
        last = t.token_times[-1] if t is not None else None
        rows.append({
            "rid": r,
            "arrival_s": arr,
            "prompt_len": workload.prompt_lens[r],
            "max_new": cap,
            "output_tokens": ntok,
            "prefill_replica": k if k >= 0 else None,
            "decode_replica": d if d >= 0 else None,
            "admitted_s": result.prefill[k].step_start[adm] if adm >= 0 else None,
            "first_token_s": first,
            "transfer_start_s": t0 if t0 == t0 else None,
            "transfer_end_s": t1 if t1 == t1 else None,
            "transfer_ms": (t1 - t0) * 1e3 if t1 == t1 else None,
            "decode_admitted_s": result.decode[d].step_start[dadm] if dadm >= 0 else None,
            "finish_s": last,
            "ttft_ms": (first - arr + result.frontend_s) * 1e3 if first is not None else None,
            "tpot_ms": (last - first) / (ntok - 1) * 1e3 if last is not None and first is not None and ntok > 1
            else None,
            "e2el_ms": (last - arr + result.frontend_s) * 1e3 if last is not None else None,
            "queue_ms": (result.prefill[k].step_start[adm] - arr) * 1e3 if adm >= 0 else None,
            "finish_reason": None if t is None else "length" if cap is not None and ntok >= cap else "stop",
            "rejected": why.get(r),
            "rejected_reason": result.rejected_kind.get(r) if r in why else None,
        })
    return rows
