"""`stallfree validate --vllm-result FILE`: simulate the requests of a `vllm bench serve` result with a
model, GPU and vLLM-equivalent scheduler settings, and compare with what vLLM measured.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim,
stallfree.validate.

vLLM settings map to ours: --max-num-batched-tokens is the token budget, --max-num-seqs is max_seqs,
--gpu-memory-utilization sets the KV capacity through the cost model. vLLM's scheduler is paged; ours
reserves each request's prompt_len + max_new at admission unless `paged` is chosen.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from stallfree.core.metrics import RequestTimeline
from stallfree.sim.defaults import DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET
from stallfree.sim.inputs.engine_profile import EngineProfile
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.simulator import simulate
from stallfree.validate.against import verdict
from stallfree.validate.compare import compare, latencies, read_vllm_result, summary
from stallfree.validate.hardware import pricing

__all__ = ["validate_vllm"]


def validate_vllm(
    path: str | Path,
    model: str,
    gpu: str,
    tp: int = 1,
    dtype: str = "bf16",
    max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET,
    max_num_seqs: int = DEFAULT_MAX_SEQS,
    gpu_memory_utilization: float = 0.9,
    paged: bool = True,
    seed: int = 0,
    profile: EngineProfile | None = None,
    kernels: str | None = "none",
) -> dict[str, Any]:
    """Simulate the result file's requests and compare (all requests; see compare.compare).

    `profile` (default: none) adds the engine's own time: its step terms to every step, its front-end
    time to every simulated TTFT and E2E (the file's latencies are measured by the client).

    Returns:
        {"engine": vLLM's measured summary, "simulator": ..., "mean_error_pct": signed errors of the means,
        "verdict": against.verdict's line, "error": ..., "config": ..., "notes": [...]}.

    Raises:
        ValueError: a bad result file (named key), or a bad model, GPU or setting (CostModelError).
    """
    res = read_vllm_result(path)
    if profile is None and kernels is not None:
        profile = EngineProfile("none")  # a library call naming its pricing gets no profile unless asked
    chosen = pricing(model, gpu, tp, dtype, profile, kernels)
    prof = chosen.profile
    kv = chosen.base.kv_capacity_tokens(gpu_memory_utilization)
    arrivals = res.arrival_times(seed)
    wl = Workload(arrivals, res.prompt_lens, res.output_lens, name=f"vllm result {Path(path).name}")
    paging: dict[str, Any] = {"kv_policy": "paged", "block_size": 16} if paged else {}
    sched = ReplicaConfig.of(kv, max_num_batched_tokens, max_num_seqs, **paging)
    sim = simulate(wl, sched, chosen.cost_model)
    measured = []
    for i, (ttft, gaps) in enumerate(zip(res.ttfts, res.itls, strict=True)):
        t = [arrivals[i] + ttft]
        for g in gaps:
            t.append(t[-1] + g)
        measured.append(RequestTimeline(i, arrivals[i], tuple(t), res.prompt_lens[i]))
    eng, simlat = latencies(measured), latencies(sim.timelines())
    if prof.frontend_s:
        d = prof.frontend_s
        simlat = {r: replace(v, ttft=v.ttft + d, e2e=v.e2e + d) for r, v in simlat.items()}
    rids = list(range(len(wl)))
    notes = [f"steps priced by the {chosen.provenance}", prof.describe()]
    if res.arrivals is None:
        notes.append(
            "the file has no arrival times: arrivals were drawn at its request_rate "
            f"({res.request_rate:g}/s, burstiness {res.burstiness:g}, seed {seed}); per-request errors pair "
            "requests by position, so the percentile errors are the ones to read"
        )
    measured_sum, sim_sum = summary(eng, rids), summary(simlat, rids)
    mean_err: dict[str, float | None] = {}
    for m in ("ttft", "tpot", "e2e"):
        a, b = measured_sum[f"mean_{m}_ms"], sim_sum[f"mean_{m}_ms"]
        mean_err[f"mean_{m}"] = (b - a) / a * 100.0 if a and b is not None else None
    return {
        "engine": measured_sum,
        "simulator": sim_sum,
        "mean_error_pct": mean_err,
        "verdict": verdict(mean_err),
        "error": compare(eng, simlat, rids),
        "scheduler_config": sched.scheduler.resolved(),
        "config": {
            "requests": len(wl),
            "model": model,
            "gpu": gpu,
            "tp": tp,
            "dtype": dtype,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "kv_tokens": kv,
            "scheduler": "paged" if paged else "reserve",
            "cost_model": chosen.provenance,
            "engine_profile": prof.name,
        },
        "notes": notes,
    }
