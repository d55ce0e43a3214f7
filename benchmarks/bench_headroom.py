"""Milliseconds per Scheduler.headroom() (one snapshot and one schedule() on it) with many live requests.

Usage: python benchmarks/bench_headroom.py [--live 1056] [--repeat 15]

Workload: 1,024 long requests (64-token prompts, max_new 10**6) run 40 steps, then 32 short ones are queued;
budget 2,048, max_seqs 1,040, KV 10**8 tokens. Under "reserve" about 100 reservations fit and the rest wait;
under "paged" (blocks of 16) nearly all run. Prints the median over --repeat calls for each KV policy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stallfree import Request, Scheduler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", type=int, default=1056)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    long_ = max(1, args.live - 32)
    for name, kw in (("reserve", {}), ("paged", {"kv_policy": "paged", "block_size": 16})):
        s = Scheduler(2048, long_ + 16, 10**8, **kw)
        for i in range(long_):
            s.add(Request(i, 64, 10**6))
        for _ in range(40):
            s.complete(s.schedule())
        for i in range(long_, args.live):
            s.add(Request(i, 64, 100))
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            s.headroom()
            times.append(time.perf_counter() - t0)
        print(f"{name:8s} running {s.num_running:5d} waiting {s.num_waiting:5d} "
              f"headroom() median {1e3 * statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
