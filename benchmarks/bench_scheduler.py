"""Microseconds per step of schedule() + complete() with many running decodes.

Usage: python benchmarks/bench_scheduler.py [--steps 3000] [--running 64,256,1024,4096] [--cache [--tier]
       [--repeat R]]
       [--clock wall|thread] [--options] [--mixed] [--cache-scaling] [--against OLD_SRC [--repeat R]]

Workload per row: N long decodes kept running, and every 4 steps a new 256-token prompt with max_new 8
arrives (so admissions, chunks and finishes happen all the time); budget N + 512, max_seqs N + 16.
Each row times the same workload on stallfree's Scheduler (reservation), on stallfree's PagedScheduler
(blocks of 16 tokens, a pool large enough that nothing is preempted, so the row measures the block
accounting) and on benchmarks/baseline_scheduler.py's ScanScheduler, side by side in one run; medians and
p99 in microseconds. The paged row's last column is its median over the reservation scheduler's.

With --cache a "cached" row runs the paged row's workload with enable_prefix_caching=True: every prompt
carries block hashes, the 256-token prompts share their first 192 tokens (12 blocks) with one of 4
system prompts and have 4 blocks of their own, so admissions hit, pin and register blocks and finishes
release them (the pool is large enough that nothing is evicted); its last column is then its median
over the paged row's (issue 15 asks for <= 1.3x at 1,024 running). With --tier a "tiered" row runs
the cached row's workload with a CPU KV tier as large as the GPU pool (stallfree.core.kv_tier), paired
with both; its last column is its median over the cached row's. The paged and cached rows are run
side by side, one step of each in turn, so that other jobs on the machine weigh on both alike;
--repeat R runs that pair R times and prints the R ratios and their median. --clock thread times CPU
time of the thread instead of wall time. --cache-scaling prints only how a lookup and building a pool
scale (cache_scaling()).

--against OLD_SRC compares this code with another copy of the package (OLD_SRC: the directory holding its
`stallfree`, e.g. an unpacked `git archive` of an earlier commit): for each --running value it runs the
reserve, paged and cached rows (paired step by step within a run) R times in each copy, in fresh processes,
the copies alternating (new, old, old, new, ...), and prints each copy's median over the runs of each row's
median and the ratio new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# BENCH_SRC (set by --against for its child runs) names the copy of the package to time.
SRC = os.environ.get("BENCH_SRC") or str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, SRC)

from baseline_scheduler import ScanScheduler  # noqa: E402

from stallfree import PagedScheduler, Request, Scheduler  # noqa: E402
from stallfree.core.kv import CachingBlockPool  # noqa: E402

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
# Wall time by default; "thread" reads the thread's CPU time (time.thread_time), which leaves out the
# time another job on a shared machine holds the core.
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCK = ["wall"]
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
    if kind == "tiered":
        blocks = int(kw.pop("num_blocks"))
        return Scheduler(budget, seqs, blocks * BLOCK_SIZE, kv_policy="paged", block_size=BLOCK_SIZE,
                         enable_prefix_caching=True, cpu_kv_tokens=blocks * BLOCK_SIZE, **kw)
    if kind == "spec2":
        budget = 3 * n + 512
    return Scheduler(token_budget=budget, max_seqs=seqs, kv_tokens=kv, **OPTIONS[kind], **kw)


def add(s, rid, prompt, max_new) -> None:
    if isinstance(s, ScanScheduler):
        s.add(rid, prompt, max_new)
    elif getattr(getattr(s, "config", None), "enable_prefix_caching", False):
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


def start(kind: str, n: int, steps: int, mixed: bool = False, **kw) -> Callable[[int], float]:
    """Build the row's scheduler, warm up N decodes, and return step(k): the seconds of schedule() +
    complete() of timed step k (0, 1, ..., steps - 1, in order), arrivals added untimed first.

    With `mixed`, the long requests finish too, at random (max_new uniform in [steps/4, 2 steps],
    seeded), and are replaced as they go, so finishes happen anywhere in the decode list rather than
    only among the newest requests.
    """
    s = make(kind, n, **kw)
    rng = random.Random(0)
    # Paged admission rejects what its pool can never hold, so there the long requests ask for just
    # more tokens than the run gives them; they still never finish while timed.
    long_new = steps + 64 if kind in ("paged", "cached", "tiered") else 10**8

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
    clock = CLOCKS[CLOCK[0]]
    rid = [n]

    def step(k: int) -> float:
        if k % ARRIVAL_EVERY == 0:
            add(s, rid[0], PROMPT, SHORT_MAX_NEW)
            rid[0] += 1
        while mixed and _live(s) < n:
            add(s, rid[0], 16, long_max_new())
            rid[0] += 1
        t0 = clock()
        plan = s.schedule()
        s.complete(plan)
        return clock() - t0

    return step


def run(kind: str, n: int, steps: int, mixed: bool = False, **kw) -> list[float]:
    """Return per-step seconds of schedule() + complete() after warming up N decodes (see start())."""
    step = start(kind, n, steps, mixed, **kw)
    return [step(k) for k in range(steps)]


def run_paired(kinds: list[str], n: int, steps: int, mixed: bool, kw: dict[str, dict]) -> dict[str, list[float]]:
    """Run the rows' workloads side by side, one step of each in turn (the order alternating), so
    that the load of a shared machine falls on every row alike; per-step seconds for each row."""
    steppers = {kind: start(kind, n, steps, mixed, **kw.get(kind, {})) for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for k in range(steps):
        for kind in kinds if k % 2 == 0 else kinds[::-1]:
            times[kind].append(steppers[kind](k))
    return times


def cache_scaling() -> None:
    """Print what prefix caching's costs grow with: building a pool of a million blocks, and one
    lookup (all blocks hit, so it reads every hash) against the new prompt's blocks and the number
    of blocks cached; microseconds, best of 5 timings."""
    import timeit

    for blocks in (10**3, 10**6):
        t = min(timeit.repeat(lambda b=blocks: PagedScheduler(8192, 256, b, BLOCK_SIZE, enable_prefix_caching=True),
                              number=10, repeat=5)) / 10
        print(f"PagedScheduler(num_blocks={blocks:,}, enable_prefix_caching=True) built in {t * 1e6:.1f} us")
    for cached in (10**3, 10**5, 10**6):
        pool = CachingBlockPool(cached, BLOCK_SIZE)
        table: list[int] = []
        pool.allocate(table, cached)
        pool.register(table, range(cached), 0, cached)  # hashes 0..cached-1: one long cached prefix
        for new in (16, 256, min(4096, cached)):
            t = min(timeit.repeat(lambda n=new, p=pool: p.lookup(range(n), n), number=200, repeat=5)) / 200
            print(f"lookup of a {new:>5}-block prompt, {cached:>9,} blocks cached: {t * 1e6:8.1f} us")


AGAINST_KINDS = ["stallfree", "paged", "cached"]


def _blocks_for(n: int, steps: int) -> int:
    """Enough blocks for every token of a run: the long requests' 16-token prompts, the warm-up and one
    token per step, plus a few short requests in flight."""
    return n * ((16 + 64 + steps) // BLOCK_SIZE + 1) + 64 * (PROMPT + SHORT_MAX_NEW) // BLOCK_SIZE


def emit_medians(n: int, steps: int, mixed: bool) -> None:
    """Print {row: median microseconds} of the reserve, paged and cached rows, paired step by step."""
    kw = {kind: {"num_blocks": _blocks_for(n, steps)} for kind in ("paged", "cached")}
    times = run_paired(AGAINST_KINDS, n, steps, mixed, kw)
    print(json.dumps({kind: statistics.median(t) * 1e6 for kind, t in times.items()}))


def against(old_src: str, running: list[int], steps: int, repeat: int, mixed: bool) -> None:
    """Time this copy and `old_src` in alternating fresh processes; print medians and new/old ratios."""
    copies = {"new": SRC, "old": str(Path(old_src).resolve())}
    print(f"new: {copies['new']}\nold: {copies['old']}")
    print(f"{'running':>8} {'row':>10} {'new_us':>9} {'old_us':>9} {'new/old':>8}  runs (new | old)")
    for n in running:
        got: dict[str, dict[str, list[float]]] = {c: {k: [] for k in AGAINST_KINDS} for c in copies}
        for r in range(repeat):
            for copy in ("new", "old") if r % 2 == 0 else ("old", "new"):
                env = dict(os.environ, BENCH_SRC=copies[copy], PYTHONPATH=copies[copy])
                cmd = [sys.executable, __file__, "--emit-medians", "--running", str(n), "--steps", str(steps),
                       "--clock", CLOCK[0]]
                out = subprocess.run(cmd + (["--mixed"] if mixed else []), env=env, check=True,
                                     capture_output=True, text=True).stdout
                for kind, us in json.loads(out.strip().splitlines()[-1]).items():
                    got[copy][kind].append(us)
        for kind in AGAINST_KINDS:
            new, old = (statistics.median(got[c][kind]) for c in ("new", "old"))
            runs = " ".join(f"{x:.0f}" for x in got["new"][kind]) + " | " + " ".join(
                f"{x:.0f}" for x in got["old"][kind])
            print(f"{n:>8} {kind:>10} {new:>9.1f} {old:>9.1f} {new / old:>7.2f}x  {runs}")


def by_step(times: list[float]) -> str:
    """Medians by the step's place in the 4-step arrival cycle (a prompt arrives at 0 and is prefilled
    in that step; its 8th token, and so its finish and release, comes in the step at 3), and the mean;
    microseconds."""
    med = [statistics.median(times[r::ARRIVAL_EVERY]) * 1e6 for r in range(ARRIVAL_EVERY)]
    return (f"admit {med[0]:.1f}, +1 {med[1]:.1f}, +2 {med[2]:.1f}, finish {med[3]:.1f}; "
            f"mean {statistics.mean(times) * 1e6:.1f}")


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
    ap.add_argument("--tier", action="store_true",
                    help="with --cache: add the cached row with a CPU KV tier (core/kv_tier.py) as large as the "
                         "GPU pool, run paired with the other two; its last column is its median over cached's")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --cache: runs of the paired paged/cached rows (the table shows the last; "
                         "the median of their ratios is printed)")
    ap.add_argument("--cache-scaling", action="store_true",
                    help="only print how prefix caching's lookup and pool construction scale (cache_scaling())")
    ap.add_argument("--by-step", action="store_true",
                    help="with --cache: also print each paired row's medians by step type (by_step())")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: time.perf_counter; thread: time.thread_time (CPU time of this thread)")
    ap.add_argument("--against", metavar="OLD_SRC",
                    help="compare with another copy of the package (see the module docstring); --repeat runs")
    ap.add_argument("--emit-medians", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    CLOCK[0] = args.clock
    running = [int(x) for x in args.running.split(",")]
    if args.emit_medians:
        for n in running:
            emit_medians(n, args.steps, args.mixed)
        return 0
    if args.against:
        against(args.against, running, args.steps, args.repeat, args.mixed)
        return 0
    if args.cache_scaling:
        cache_scaling()
        return 0
    kinds = ["stallfree", "paged", "scan"] + ([k for k in OPTIONS if k != "stallfree"] if args.options else [])
    kinds += ["cached"] if args.cache else []
    kinds += ["tiered"] if args.cache and args.tier else []
    print(f"{'running':>8} {'impl':>10} {'median_us':>10} {'p99_us':>10} {'vs scan':>8} {'vs default':>10}")
    for n in running:
        blocks = _blocks_for(n, args.steps)
        kw = {kind: {"num_blocks": blocks} for kind in ("paged", "cached", "tiered")}
        rows = {kind: summarize(run(kind, n, args.steps, args.mixed, **kw.get(kind, {})))
                for kind in kinds if kind not in ("paged", "cached", "tiered")}
        ratios = []
        tier_ratios = []
        pair = ["paged", "cached"] if args.cache else ["paged"]
        pair += ["tiered"] if "tiered" in kinds else []
        for _ in range(args.repeat):
            # Caching off and on step by step in turn: the ratio is not at the mercy of the load.
            paired = run_paired(pair, n, args.steps, args.mixed, {k: dict(v) for k, v in kw.items()})
            for kind, times in paired.items():
                rows[kind] = summarize(times)
                if args.by_step:
                    print(f"{n:>8} {kind:>10} by step type: {by_step(times)}")
            if args.cache:
                ratios.append(rows["cached"][0] / rows["paged"][0])
            if "tiered" in rows:
                tier_ratios.append(rows["tiered"][0] / rows["cached"][0])
        for kind in kinds:
            med, p99 = rows[kind]
            speed = rows["scan"][0] / med
            rel = med / rows[{"cached": "paged", "tiered": "cached"}.get(kind, "stallfree")][0]
            print(f"{n:>8} {kind:>10} {med:>10.1f} {p99:>10.1f} {speed:>7.1f}x {rel:>9.2f}x")
        if len(ratios) > 1:
            print(f"{n:>8} cached/paged per run: {' '.join(f'{r:.2f}' for r in ratios)}; "
                  f"median {statistics.median(ratios):.2f}x")
        if len(tier_ratios) > 1:
            print(f"{n:>8} tiered/cached per run: {' '.join(f'{r:.2f}' for r in tier_ratios)}; "
                  f"median {statistics.median(tier_ratios):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
