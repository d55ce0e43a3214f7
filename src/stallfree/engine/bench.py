"""Measure the engine on real execution: per-step wall time against the step's features (the CSV the
cost model's calibration reads) with a least-squares fit, the inter-token latency (ITL) of running
streams while a long prompt arrives (chunked vs not), and continuous batching's throughput against
one request at a time.

Imports allowed: the standard library, numpy, torch, stallfree.core, stallfree.engine.
"""

from __future__ import annotations

import csv
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.engine.engine import LLMEngine
from stallfree.engine.sampling import SamplingParams

__all__ = ["CSV_COLUMNS", "StepRecord", "fit_step_time", "run_engine_bench", "write_csv"]

#: Columns of the step-time CSV (one row per step).
CSV_COLUMNS = ("step", "num_prefill_tokens", "num_decodes", "decode_context_sum",
               "prefill_context_sum", "num_tokens", "seconds")
#: The fit's features, in CSV column names; the intercept is the per-step overhead.
FEATURES = ("num_prefill_tokens", "num_decodes", "decode_context_sum", "prefill_context_sum")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One executed step. Units: tokens (counts and context sums), seconds (wall time of step())."""

    step: int
    num_prefill_tokens: int
    num_decodes: int
    decode_context_sum: int
    prefill_context_sum: int
    num_tokens: int
    seconds: float


def _timed_step(eng: LLMEngine, log: list[StepRecord]) -> tuple[float, list[Any]]:
    """Run one step; append its record (non-empty steps only); return (end time in s, outputs)."""
    t0 = time.perf_counter()
    outs = eng.step()
    t1 = time.perf_counter()
    plan = eng.last_plan
    if plan is not None and plan.num_tokens:
        log.append(StepRecord(len(log), plan.num_prefill_tokens, plan.num_decodes,
                              plan.decode_context_sum, sum(c.start for c in plan.prefills),
                              plan.num_tokens, t1 - t0))
    return t1, outs


def write_csv(records: list[StepRecord], path: Path) -> None:
    """Write the step records with the CSV_COLUMNS header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in records:
            w.writerow([r.step, r.num_prefill_tokens, r.num_decodes, r.decode_context_sum,
                        r.prefill_context_sum, r.num_tokens, f"{r.seconds:.6f}"])


def fit_step_time(records: list[StepRecord]) -> dict[str, Any]:
    """Least-squares fit seconds = c0 + sum_i c_i * feature_i over the FEATURES.

    Returns:
        {"coef": {"intercept_s": c0, "<feature>_s": c_i, ...} (seconds per unit),
         "mape": mean |pred - y| / y, "r2": coefficient of determination, "n": rows}.

    Raises:
        ValueError: fewer rows than parameters.
    """
    import numpy as np

    if len(records) < len(FEATURES) + 1:
        raise ValueError(f"need at least {len(FEATURES) + 1} steps to fit, got {len(records)}")
    x = np.array([[1.0] + [float(getattr(r, f)) for f in FEATURES] for r in records])
    y = np.array([r.seconds for r in records])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    names = ["intercept_s"] + [f"{f}_s" for f in FEATURES]
    return {"coef": dict(zip(names, (float(c) for c in coef), strict=True)),
            "mape": float(np.mean(np.abs(pred - y) / y)), "r2": 1.0 - ss_res / ss_tot, "n": len(y)}


def _percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def itl_under_long_prompt(
    make: Callable[..., LLMEngine], budget: int, log: list[StepRecord], long_len: int = 2048,
    streams: int = 4, stream_tokens: int = 40,
) -> dict[str, float]:
    """ITL of `streams` running requests while a `long_len`-token prompt arrives.

    The streams (16-token prompts, `stream_tokens` each) start together; once all decode, the
    long prompt arrives. ITL = each gap between consecutive tokens of a stream (seconds).

    Returns:
        budget, p50/p99/max ITL in ms, the long prompt's TTFT in s, and the steps it took.
    """
    eng = make(token_budget=budget, max_seqs=streams + 1, kv_tokens=long_len + 64 * (streams + 1))
    rng = random.Random(1)
    for i in range(streams):
        eng.add_request(i, [rng.randrange(300, 40000) for _ in range(16)],
                        SamplingParams(max_tokens=stream_tokens, **GREEDY))
    last: dict[int, float] = {}
    gaps: list[float] = []
    arrival = first = None
    steps_to_first = 0
    while eng.has_unfinished():
        if arrival is None and eng.scheduler.num_running == streams and all(
            s in last for s in range(streams)
        ) and len(gaps) >= streams * 2:
            eng.add_request("long", [rng.randrange(300, 40000) for _ in range(long_len)],
                            SamplingParams(max_tokens=1, **GREEDY))
            arrival = time.perf_counter()
        t, outs = _timed_step(eng, log)
        if arrival is not None and first is None:
            steps_to_first += 1
        for o in outs:
            if o.rid == "long":
                first = t
            else:
                if o.rid in last:
                    gaps.append(t - last[o.rid])
                last[o.rid] = t
    assert arrival is not None and first is not None
    return {"token_budget": budget, "p50_itl_ms": 1e3 * _percentile(gaps, 50),
            "p99_itl_ms": 1e3 * _percentile(gaps, 99), "max_itl_ms": 1e3 * max(gaps),
            "long_prompt_ttft_s": first - arrival, "long_prompt_steps": steps_to_first,
            "num_gaps": len(gaps)}


def throughput_mixed(
    make: Callable[..., LLMEngine], log: list[StepRecord], n: int = 12, budget: int = 256,
    max_seqs: int = 16, one_at_a_time: bool = False,
) -> dict[str, float]:
    """Output tokens per second on a seeded mixed workload (prompts 16-256 tokens, 16-48 new).

    With one_at_a_time, each request runs alone to the end before the next is added (no
    batching, no chunking); otherwise all arrive at once and are continuously batched.
    """
    rng = random.Random(7)
    work = [([rng.randrange(300, 40000) for _ in range(rng.randint(16, 256))], rng.randint(16, 48))
            for _ in range(n)]
    out_tokens = 0
    t0 = time.perf_counter()
    if one_at_a_time:
        eng = make(token_budget=4096, max_seqs=1, kv_tokens=4096)
        for i, (ids, new) in enumerate(work):
            eng.add_request(i, ids, SamplingParams(max_tokens=new, **GREEDY))
            while eng.has_unfinished():
                out_tokens += len(_timed_step(eng, log)[1])
    else:
        eng = make(token_budget=budget, max_seqs=max_seqs, kv_tokens=8192)
        for i, (ids, new) in enumerate(work):
            eng.add_request(i, ids, SamplingParams(max_tokens=new, **GREEDY))
        while eng.has_unfinished():
            out_tokens += len(_timed_step(eng, log)[1])
    elapsed = time.perf_counter() - t0
    assert out_tokens == sum(new for _, new in work)
    return {"mode": "one_at_a_time" if one_at_a_time else f"continuous_b{budget}",
            "requests": n, "output_tokens": out_tokens, "seconds": elapsed,
            "output_throughput": out_tokens / elapsed}


def calibration_sweep(make: Callable[..., LLMEngine], log: list[StepRecord]) -> None:
    """Steps with varied mixes: d decodes at growing contexts next to chunks of several sizes."""
    rng = random.Random(3)
    for budget, decodes, prompt in ((32, 2, 200), (64, 8, 400), (128, 4, 600), (256, 12, 500)):
        eng = make(token_budget=budget, max_seqs=decodes + 1, kv_tokens=8192)
        for i in range(decodes):
            eng.add_request(i, [rng.randrange(300, 40000) for _ in range(rng.randint(8, 120))],
                            SamplingParams(max_tokens=24, **GREEDY))
        eng.add_request("p", [rng.randrange(300, 40000) for _ in range(prompt)],
                        SamplingParams(max_tokens=4, **GREEDY))
        while eng.has_unfinished():
            _timed_step(eng, log)


def run_engine_bench(eng_factory: Callable[..., LLMEngine], out_dir: Path,
                     long_len: int = 2048, quick: bool = False) -> dict[str, Any]:
    """Run every measurement, write out_dir/engine_steps.csv, and return the figures.

    Args:
        eng_factory: builds an engine from (token_budget, max_seqs, kv_tokens) sharing weights.
        long_len: the long prompt's length for the ITL experiment, in tokens.
        quick: smaller workloads (a smoke run).
    """
    log: list[StepRecord] = []
    warm: list[StepRecord] = []
    throughput_mixed(eng_factory, warm, n=2)  # warm-up: allocator and kernel first-use costs
    calibration_sweep(eng_factory, log)
    n = 4 if quick else 12
    tp = [throughput_mixed(eng_factory, log, n=n),
          throughput_mixed(eng_factory, log, n=n, one_at_a_time=True)]
    itl = [itl_under_long_prompt(eng_factory, 128, log, long_len=long_len),
           itl_under_long_prompt(eng_factory, max(4096, long_len + 64), log, long_len=long_len)]
    csv_path = out_dir / "engine_steps.csv"
    write_csv(log, csv_path)
    return {"csv": str(csv_path), "fit": fit_step_time(log), "itl": itl, "throughput": tp,
            "steps": len(log)}
