"""Per-request and per-step records of a run, as rows and as CSV files.

Imports allowed: the standard library, stallfree.core and stallfree.sim.run.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.outputs.buckets import prompt_bucket
from stallfree.sim.run.result import SimResult

__all__ = [
    "iter_request_records",
    "request_records",
    "step_records",
    "write_records",
    "write_steps_csv",
]


def request_records(res: SimResult, replica: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The rows of iter_request_records, as a list."""
    return list(iter_request_records(res, replica))


def iter_request_records(res: SimResult, replica: Sequence[int] | None = None) -> Iterator[dict[str, Any]]:
    """One dict per request, made as it is asked for (a run's records never all in memory): rid,
    arrival_s, prompt_len, prompt_bucket (stallfree.sim.outputs.buckets),
    max_new, output_tokens, admitted_s, first_token_s, finish_s, ttft_ms, tpot_ms, e2el_ms,
    queue_ms, finish_reason, rejected (the message), rejected_reason ("context_length", "kv_capacity" or None),
    with LoRA adapters (res.lora) lora (the adapter's name, None: the base model) and lora_load_s, and,
    last, tenant when the workload names tenants.
    Times are None for rejected requests; tpot_ms is None below 2 tokens. With `replica` (a
    cluster's replica per request, -1 for one refused at arrival) a `replica` column follows rid
    (None where -1). A session run's rows end with session_id and turn. ttft_ms and e2el_ms include
    the engine profile's front end (config frontend_s,
    as latency_arrays); the step times (admitted_s, first_token_s, finish_s) are the engine's."""
    start, end = res.step_start, res.step_end
    frontend = float(res.config.get("frontend_s", 0.0))
    rejected = dict(res.rejected)
    keys = res.session_keys
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
            "output_tokens": res.target[r] if f >= 0 and res.finish_reason[r] != "timeout" else 0,
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
        if res.lora is not None and res.lora_load_s is not None:
            row["lora"] = res.lora[r]
            row["lora_load_s"] = res.lora_load_s[r]
        if res.tenant is not None:
            row["tenant"] = res.tenant[r]
        yield row


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
    a cluster's replica per request: a replica column, as request_records). The rows are written one
    at a time as iter_request_records makes them (the file is what json.dumps(rows, indent=1) or
    csv.DictWriter would write of the whole list, byte for byte).

    Raises:
        OSError: the file cannot be written.
    """
    rows = iter_request_records(res, replica)
    first = next(rows, None)
    with open(path, "w", newline="" if path.suffix != ".json" else None, encoding="utf-8") as fh:
        if path.suffix == ".json":
            if first is None:
                fh.write("[]\n")
                return
            fh.write("[\n")
            sep = ""
            for row in itertools.chain((first,), rows):
                # json.dumps(list, indent=1) writes each item one level in: every line one more space.
                fh.write(sep + " " + json.dumps(row, indent=1).replace("\n", "\n "))
                sep = ",\n"
            fh.write("\n]\n")
            return
        writer = csv.DictWriter(fh, fieldnames=list(first) if first is not None else ["rid"])
        writer.writeheader()
        if first is not None:
            writer.writerow(first)
            for row in rows:
                writer.writerow(row)


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
