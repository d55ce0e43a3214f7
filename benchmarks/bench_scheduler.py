"""Microseconds per step of schedule() + complete() with many running decodes.

Usage: python benchmarks/bench_scheduler.py [--steps 3000] [--running 64,256,1024,4096]

Workload per row: N long decodes kept running, and every 4 steps a new 256-token prompt with max_new 8
arrives (so admissions, chunks and finishes happen all the time); budget N + 512, max_seqs N + 16.
Each row times the same workload on stallfree's Scheduler (reservation), on stallfree's PagedScheduler
(blocks of 16 tokens, a pool large enough that nothing is preempted, so the row measures the block
accounting) and on benchmarks/baseline_scheduler.py's ScanScheduler, side by side in one run; medians and
p99 in microseconds. The paged row's last column is its median over the reservation scheduler's.

With --cache a "cached" row runs the paged row's workload with enable_prefix_caching=True: every prompt
carries block hashes, the 256-token prompts share their first 192 tokens (12 blocks) with one of 4
system prompts and have 4 blocks of their own, so admissions hit, pin, register and evict; its last
column is then its median over the paged row's (issue 15 asks for <= 1.3x at 1,024 running).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from baseline_scheduler import ScanScheduler  # noqa: E402

from stallfree import PagedScheduler, Request, Scheduler  # noqa: E402

ARRIVAL_EVERY = 4
PROMPT = 256
SHORT_MAX_NEW = 8
BLOCK_SIZE = 16


# Option rows: the same workload under each scheduler option (budgets are above the decode count, so
# overflow rules are priced on the path every step takes, not on the rare overflow itself).
OPTIONS: dict[str, dict[str, object]] = {
    "stallfree": {},
    "block16": {"block_size": 16},
    "priority": {"policy": "priority", "aging_interval": 100},
    "rotate": {"decode_overflow": "rotate"},
    "spec2": {"num_spec_tokens": 2},
}


NUM_SYSTEM_PROMPTS = 4
SHARED_BLOCKS = 12


def make(kind: str, n: int, **kw):
    budget, seqs, kv = n + 512, n + 16, 10**15
    if kind == "scan":
        return ScanScheduler(budget, seqs, kv)
    if kind == "paged":
        return PagedScheduler(token_budget=budget, max_seqs=seqs, block_size=BLOCK_SIZE, **kw)
    if kind == "cached":
        return PagedScheduler(token_budget=budget, max_seqs=seqs, block_size=BLOCK_SIZE,
                              enable_prefix_caching=True, **kw)
    if kind == "spec2":
        budget = 3 * n + 512
    return Scheduler(token_budget=budget, max_seqs=seqs, kv_tokens=kv, **OPTIONS[kind], **kw)


def add(s, rid, prompt, max_new) -> None:
    if isinstance(s, ScanScheduler):
        s.add(rid, prompt, max_new)
    elif getattr(s, "enable_prefix_caching", False):
        # Stand-ins for chained hashes: equal exactly when the prefix is.
        full = prompt // BLOCK_SIZE
        shared = SHARED_BLOCKS if prompt == PROMPT else 0
        sysp = rid % NUM_SYSTEM_PROMPTS
        hashes = tuple(("sys", sysp, i) if i < shared else ("own", rid, i) for i in range(full))
        s.add(Request(rid, prompt, max_new, block_hashes=hashes))
    else:
        s.add(Request(rid, prompt, max_new))


def _live(s) -> int:
    if isinstance(s, ScanScheduler):
        return len(s.running) + len(s.waiting)
    return s.num_running + s.num_waiting


def run(kind: str, n: int, steps: int, mixed: bool = False, **kw) -> list[float]:
    """Return per-step seconds of schedule() + complete() after warming up N decodes.

    With `mixed`, the long requests finish too, at random (max_new uniform in [steps/4, 2 steps],
    seeded), and are replaced as they go, so finishes happen anywhere in the decode list rather than
    only among the newest requests.
    """
    s = make(kind, n, **kw)
    rng = random.Random(0)
    # Paged admission rejects what its pool can never hold, so there the long requests ask for just
    # more tokens than the run gives them; they still never finish while timed.
    long_new = steps + 64 if kind in ("paged", "cached") else 10**8

    def long_max_new() -> int:
        return rng.randint(steps // 4, 2 * steps) if mixed else long_new

    for i in range(n):
        add(s, i, 16, long_max_new())
    while True:  # warm up: prefill all N long requests
        plan = s.schedule()
        s.complete(plan)
        if (s.num_running if hasattr(s, "num_running") else len(s.running)) >= n and not (
            s.num_waiting if hasattr(s, "num_waiting") else len(s.waiting)
        ):
            break
    for _ in range(4):
        s.complete(s.schedule())
    times = []
    clock = time.perf_counter
    rid = n
    for k in range(steps):
        if k % ARRIVAL_EVERY == 0:
            add(s, rid, PROMPT, SHORT_MAX_NEW)
            rid += 1
        while mixed and _live(s) < n:
            add(s, rid, 16, long_max_new())
            rid += 1
        t0 = clock()
        plan = s.schedule()
        s.complete(plan)
        times.append(clock() - t0)
    return times


def summarize(times: list[float]) -> tuple[float, float]:
    ts = sorted(times)
    return statistics.median(ts) * 1e6, ts[int(0.99 * (len(ts) - 1))] * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--running", default="64,256,1024,4096")
    ap.add_argument("--options", action="store_true", help="add a row per scheduler option")
    ap.add_argument("--mixed", action="store_true", help="long requests finish at random too (see run())")
    ap.add_argument("--cache", action="store_true", help="add the paged row with prefix caching on")
    args = ap.parse_args(argv)
    kinds = ["stallfree", "paged", "scan"] + ([k for k in OPTIONS if k != "stallfree"] if args.options else [])
    kinds += ["cached"] if args.cache else []
    print(f"{'running':>8} {'impl':>10} {'median_us':>10} {'p99_us':>10} {'vs scan':>8} {'vs default':>10}")
    for n in [int(x) for x in args.running.split(",")]:
        # Enough blocks for every token of the run: the long requests' 16-token prompts, the warm-up
        # and one token per step, plus a few short requests in flight.
        blocks = n * ((16 + 64 + args.steps) // BLOCK_SIZE + 1) + 64 * (PROMPT + SHORT_MAX_NEW) // BLOCK_SIZE
        rows = {
            kind: summarize(
                run(kind, n, args.steps, args.mixed,
                    **({"num_blocks": blocks} if kind in ("paged", "cached") else {}))
            )
            for kind in kinds
        }
        for kind, (med, p99) in rows.items():
            speed = rows["scan"][0] / med
            rel = med / rows["paged" if kind == "cached" else "stallfree"][0]
            print(f"{n:>8} {kind:>10} {med:>10.1f} {p99:>10.1f} {speed:>7.1f}x {rel:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
