"""Benchmark: the time to price one step (target: under 5 us for 256 decodes and one chunk).

Run: PYTHONPATH=src python benchmarks/bench_costmodel.py [--json]

Each sample times a batch of calls with time.perf_counter_ns and divides by the batch size (a single call
is too short to time on its own); the median and p99 are over the samples. Plans come from a real
Scheduler run, so they carry the scheduler's own tuples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

from stallfree import Request, Scheduler, StepPlan
from stallfree.costmodel import CostModel

BATCH = 50
SAMPLES = 3000


def _plan_256_decodes_one_chunk() -> StepPlan:
    """Drive a Scheduler until a step holds 256 decodes and one prefill chunk."""
    s = Scheduler(token_budget=2048, max_seqs=512, kv_tokens=10_000_000)
    for rid in range(256):
        s.add(Request(rid, 100, 1000))
    while True:
        plan = s.schedule()
        s.complete(plan)
        if plan.num_decodes == 256 and not plan.prefills:
            break
    s.add(Request("long", 32768, 10))
    plan = s.schedule()
    assert plan.num_decodes == 256 and len(plan.prefills) == 1, (plan.num_decodes, len(plan.prefills))
    return plan


def _time_us(fn: Callable[[], object]) -> tuple[float, float]:
    """Return (median, p99) microseconds per call of fn."""
    per_call = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / BATCH / 1e3)
    per_call.sort()
    return statistics.median(per_call), per_call[int(0.99 * len(per_call)) - 1]


def main() -> int:
    """Run the benchmark and print median and p99 per call."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    plan = _plan_256_decodes_one_chunk()
    results = {}
    for mode in ("full", "design"):
        cm = CostModel.from_names("llama-3.3-70b", "h100-sxm", tp=4, dtype="fp8", mode=mode)
        results[f"step_time[{mode}] 256 decodes + 1 chunk"] = _time_us(lambda cm=cm: cm.step_time(plan))
    moe = CostModel.from_names("mixtral-8x7b", "h100-sxm", tp=2)
    results["step_time[full, MoE] 256 decodes + 1 chunk"] = _time_us(lambda: moe.step_time(plan))
    cm = CostModel.from_names("llama-3.3-70b", "h100-sxm", tp=4, dtype="fp8")
    results["decode_step_time"] = _time_us(lambda: cm.decode_step_time(256, 4096))
    search = _time_us(lambda: cm.max_tokens_within(0.05, 256, 256 * 4096))
    results["max_tokens_within (binary search)"] = search
    if args.json:
        print(json.dumps({k: {"median_us": m, "p99_us": p} for k, (m, p) in results.items()}, indent=1))
        return 0
    print(f"python {sys.version.split()[0]}; {SAMPLES} samples of {BATCH} calls each")
    for name, (med, p99) in results.items():
        print(f"{name:<45} median {med:6.2f} us   p99 {p99:6.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
