"""Cost of reading a freshly planned step's decodes as ScheduledChunk objects, against building a list of
plain tuples of the same five fields, in the same run.

Usage: python benchmarks/bench_plan_read.py [--running 1024,4096] [--reps 300]

Per row: a Scheduler with N long decodes running (budget N + 512); each repetition plans a fresh step,
times `list(plan)` (one ScheduledChunk per decode, made on reading: plans cache nothing) and, on the same
plan, a list comprehension building N tuples (rid, 1, False, start, True) from the plan's compact
sequences, then completes the step. Medians in microseconds and their ratio. The compact sequences
themselves (`plan.decode_rids`, `plan.decode_starts`) are the engine's fast path and cost no object
per decode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stallfree import Request, Scheduler  # noqa: E402


def run(n: int, reps: int) -> tuple[float, float]:
    """Return (median us of list(plan), median us of the tuple list) over `reps` fresh plans."""
    s = Scheduler(n + 512, n + 16, 10**15)
    for i in range(n):
        s.add(Request(i, 16, 10**8))
    while s.num_waiting or s.num_running < n:
        s.complete(s.schedule())
    s.complete(s.schedule())
    clock = time.perf_counter
    objs, tups = [], []
    for _ in range(reps):
        plan = s.schedule()
        t0 = clock()
        chunks = list(plan)
        t1 = clock()
        step = plan.step
        offsets = plan._decode_offsets
        tuples = [(rid, 1, False, off + step, True) for rid, off in zip(plan.decode_rids, offsets, strict=True)]
        t2 = clock()
        assert len(chunks) == len(tuples) == n
        objs.append(t1 - t0)
        tups.append(t2 - t1)
        s.complete(plan)
    return statistics.median(objs) * 1e6, statistics.median(tups) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", default="1024,4096")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    print(f"{'running':>8} {'chunks_us':>10} {'tuples_us':>10} {'ratio':>7}")
    for n in [int(x) for x in args.running.split(",")]:
        obj, tup = run(n, args.reps)
        print(f"{n:>8} {obj:>10.1f} {tup:>10.1f} {obj / tup:>6.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
