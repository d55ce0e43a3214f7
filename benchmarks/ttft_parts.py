"""What a run folder's TTFT is made of, measured against simulated (the defaults of `validate --against`).

Per request, TTFT = (scheduled_ts - queued_ts): the wait for admission (a free `max_num_seqs` slot, the
token budget, KV) + (first_token_ts - scheduled_ts): the steps from admission to the first token (the
prefill chunks, and under asynchronous scheduling the step already planned without the request). The
simulated parts are the same replay's admission step start and first-token step end; "with the lag" adds
the step vLLM's asynchronous scheduler runs first (stallfree.validate.against._with_async_lag).

Also: a least-squares fit over the seconds of timeseries.csv at the run's most running requests of
1 s = gen / running x decode step + prompt tokens x per-prompt-token cost, measured and simulated (the
simulated seconds from the replay's steps): whether decode steps or prefill chunks are priced short.

Run: PYTHONPATH=src python benchmarks/ttft_parts.py [RUN_FOLDER ...]   (about 5 s a run;
default: every run folder of data/validation/llmservingsim_vllm)
"""

from __future__ import annotations

import csv
import json
import statistics as st
import sys
from pathlib import Path
from typing import Any

import numpy as np

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.routers import VllmDPRouter
from stallfree.sim.run.simulator import simulate
from stallfree.validate.hardware import derived_kv_tokens, gpu_match, model_preset, pricing
from stallfree.validate.runs import read_run_folder

DEFAULT = Path(__file__).resolve().parents[1] / "data" / "validation" / "llmservingsim_vllm"


def _replay(folder: Path) -> tuple[Any, Any, list[dict[str, Any]]]:
    run = read_run_folder(folder)
    rows = sorted((json.loads(x) for x in (folder / "requests.jsonl").read_text().splitlines() if x.strip()),
                  key=lambda r: r["queued_ts"])
    m, d = model_preset(run.model, run.dtype)
    g, _ = gpu_match(run.device_name, run.device_memory_bytes)
    p = pricing(m, g, run.tp, d, None, None, engine_version=run.vllm_version or None)
    if run.num_gpu_blocks:
        kv = run.num_gpu_blocks * run.block_size
    else:
        mem = run.device_memory_bytes or getattr(p.base, "roofline", p.base).gpu.mem_bytes
        kv = derived_kv_tokens(p.base, mem, run.gpu_memory_utilization, run.block_size)
    wl = Workload(run.arrivals, run.prompt_lens, run.output_lens, name=folder.name)
    sched = SchedulerConfig(kv, run.max_num_batched_tokens, run.max_num_seqs, kv="paged", block_size=run.block_size)
    if run.dp > 1:
        res = simulate_cluster(wl, sched, p.cost_model, run.dp, VllmDPRouter(), max_model_len=run.max_model_len).merged
    else:
        res = simulate(wl, sched, p.cost_model, max_model_len=run.max_model_len)
    return run, res, rows


def _rate_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    a = np.array([[g / n, p] for g, p, n in rows])
    x, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    return float(x[0]), float(x[1])


def parts(folder: Path) -> dict[str, Any]:
    """The figures for one run folder (keys as printed)."""
    run, res, rows = _replay(folder)
    n = len(rows)
    mw = [r["scheduled_ts"] - r["queued_ts"] for r in rows]
    mp = [r["first_token_ts"] - r["scheduled_ts"] for r in rows]
    sw, sp, lag = [], [], []
    for i in range(n):
        a = res.admit_step[i]
        sw.append(res.step_start[a] - res.arrival[i])
        sp.append(res.step_end[res.first_step[i]] - res.step_start[a])
        busy = a > 0 and res.step_start[a] > res.arrival[i] + 1e-9
        lag.append(res.step_end[a - 1] - res.step_start[a - 1] if busy else 0.0)
    un = [i for i in range(n) if mw[i] < 0.005]
    out: dict[str, Any] = {
        "run": folder.name, "requests": n,
        "wait_s": (st.mean(mw), st.mean(sw)),
        "sched_to_first_ms": (1e3 * st.mean(mp), 1e3 * st.mean(sp),
                              1e3 * st.mean(s + g for s, g in zip(sp, lag, strict=True))),
        "unqueued": len(un),
        "unqueued_sched_to_first_median_ms": (
            (1e3 * st.median(mp[i] for i in un), 1e3 * st.median(sp[i] for i in un),
             1e3 * st.median(sp[i] + lag[i] for i in un)) if un else None),
    }
    ts = list(csv.DictReader((folder / "timeseries.csv").open()))
    top = max(int(r["running"]) for r in ts)
    mrows, srows = [], []
    for r in ts:
        t = float(r["t"])
        if int(r["running"]) != top or run.dp > 1:
            continue
        ks = [k for k in range(len(res.step_start)) if t - 1 <= res.step_end[k] < t]
        busy = sum(res.step_end[k] - res.step_start[k] for k in ks)
        if not ks or busy <= 0:
            continue
        mrows.append((float(r["gen_throughput"]), float(r["prompt_throughput"]), float(top)))
        gen = sum(res.step_decodes[k] for k in ks)
        srows.append((gen / busy, sum(res.step_tokens[k] - res.step_decodes[k] for k in ks) / busy, gen / len(ks)))
    if len(mrows) >= 3:
        out["seconds_at_top"] = (top, len(mrows))
        out["decode_step_ms_and_prompt_us"] = tuple(v * f for v, f in zip(_rate_fit(mrows) + _rate_fit(srows),
                                                                          (1e3, 1e6, 1e3, 1e6), strict=True))
    return out


def main(argv: list[str]) -> None:
    folders = [Path(a) for a in argv] or sorted(p for p in DEFAULT.iterdir() if (p / "meta.json").is_file())
    for f in folders:
        o = parts(f)
        w, s = o["wait_s"], o["sched_to_first_ms"]
        print(f"{o['run']}: {o['requests']} requests")
        print(f"  wait queued -> scheduled, mean: measured {w[0]:.3f} s, simulated {w[1]:.3f} s "
              f"({(w[1] / w[0] - 1) * 100:+.1f}%)" if w[0] > 0 else "  no wait")
        print(f"  scheduled -> first token, mean: measured {s[0]:.1f} ms, simulated {s[1]:.1f} ms "
              f"({(s[1] / s[0] - 1) * 100:+.1f}%), with the async lag {s[2]:.1f} ms ({(s[2] / s[0] - 1) * 100:+.1f}%)")
        if o["unqueued_sched_to_first_median_ms"]:
            u = o["unqueued_sched_to_first_median_ms"]
            print(f"  {o['unqueued']} admitted at once (wait < 5 ms): scheduled -> first median measured "
                  f"{u[0]:.1f} ms, simulated {u[1]:.1f} ms, with the lag {u[2]:.1f} ms")
        if "decode_step_ms_and_prompt_us" in o:
            d = o["decode_step_ms_and_prompt_us"]
            top, k = o["seconds_at_top"]
            print(f"  {k} seconds at {top} running: decode step {d[0]:.2f} ms + {d[1]:.1f} us per prompt token "
                  f"measured; {d[2]:.2f} ms + {d[3]:.1f} us simulated")


if __name__ == "__main__":
    main(sys.argv[1:])
