"""prefix-affinity against least-outstanding with prefix caching on (docs/cluster.md): the bundled
Mooncake conversation trace (first 3,000 requests, its own rate), 4 replicas of the default replica
with paged KV and prefix caching. Per router: the cluster's prefix cache hit rate (and the bound of
one infinite cache), TTFT p50 / p99, p99 TPOT, requests per replica, and the run's wall time.

Usage: python benchmarks/cluster_prefix_affinity.py [--num-requests 3000] [--replicas 4] [--rate-scale 1]
           [--caps 1.5:4,inf:0]   (prefix-affinity load caps to try, FACTOR:MARGIN)
"""

from __future__ import annotations

import argparse
import math
import time

from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.loop import Router
from stallfree.sim.run.routers import (
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_AFFINITY_LOAD_MARGIN,
    LeastOutstandingRouter,
    PrefixAffinityRouter,
)
from stallfree.sim.studies.cluster_study import cluster_summary


def main() -> None:
    """Print one markdown row per router (and load cap)."""
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=3000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument("--caps", default=f"{DEFAULT_AFFINITY_LOAD_FACTOR:g}:{DEFAULT_AFFINITY_LOAD_MARGIN},inf:0")
    args = p.parse_args()
    workload = WorkloadOptions(trace="mooncake", num_requests=args.num_requests, rate_scale=args.rate_scale)
    setup = Setup(workload, HardwareOptions(), {"kv_policy": "paged", "enable_prefix_caching": True})
    wl = setup.workload
    print(f"{wl.name}: {len(wl):,} requests, {wl.mean_rate:.2f} req/s; {args.replicas} x {setup.hardware}; "
          "paged KV, prefix caching on\n")
    print("| router | load cap (factor : margin) | hit rate | bound | p50 TTFT (s) | p99 TTFT (s) "
          "| p99 TPOT (ms) | requests per replica | wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    runs: list[tuple[str, str, Router]] = [("least-outstanding", "-", LeastOutstandingRouter())]
    for cap in args.caps.split(","):
        f, m = cap.split(":")
        factor = math.inf if f == "inf" else float(f)
        label = "none" if factor == math.inf else f"{factor:g} : {m}"
        runs.append(("prefix-affinity", label, PrefixAffinityRouter(load_factor=factor, load_margin=int(m))))
    for name, cap_text, router in runs:
        t0 = time.perf_counter()
        c = simulate_cluster(wl, setup.config("chunked", 2048), setup.cost_model, args.replicas, router,
                             max_model_len=setup.context_length)
        wall = time.perf_counter() - t0
        s = cluster_summary(c)
        per = ", ".join(str(r["num_requests"]) for r in s["replicas"])
        print(
            f"| {name} | {cap_text} | {s['prefix_cache_hit_rate']:.1%} | {s['prefix_cache_hit_rate_bound']:.1%} "
            f"| {s['p50_ttft_ms'] / 1e3:,.2f} | {s['p99_ttft_ms'] / 1e3:,.2f} | {s['p99_tpot_ms']:.1f} | {per} "
            f"| {wall:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
