"""The per-router table of docs/cluster.md: the whole bundled Azure conversation trace at a rate that
needs several replicas, each router at N = 2, 4 and 8 replicas: p99 TTFT, p99 TPOT, goodput,
load imbalance, and the simulation's wall time.

Usage: python benchmarks/cluster_routers.py [--rate-scale 16] [--slo-ttft 1.0] [--slo-tpot 0.05]
"""

from __future__ import annotations

import argparse
import time

from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.routers import ROUTERS, make_router
from stallfree.sim.studies.cluster_study import cluster_summary


def main() -> None:
    """Print one markdown row per (N, router)."""
    p = argparse.ArgumentParser()
    p.add_argument("--rate-scale", type=float, default=16.0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="s")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="s")
    p.add_argument("--replicas", default="2,4,8")
    args = p.parse_args()
    setup = Setup(WorkloadOptions(rate_scale=args.rate_scale), HardwareOptions())
    cfg = setup.config("chunked", 2048)
    wl = setup.workload
    print(f"{wl.name}: {len(wl):,} requests, {wl.mean_rate:.1f} req/s offered; {setup.hardware}")
    print(f"goodput: completed requests/s with TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot * 1e3:g} ms\n")
    print("| N | router | p99 TTFT (ms) | p99 TPOT (ms) | goodput (req/s) | SLO met | imbalance mean / max "
          "| wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.replicas.split(",")):
        for name in ROUTERS:
            t0 = time.perf_counter()
            c = simulate_cluster(wl, cfg, setup.cost_model, n, make_router(name, seed=0),
                                 max_model_len=setup.context_length)
            wall = time.perf_counter() - t0
            s = cluster_summary(c, args.slo_ttft, args.slo_tpot)
            print(
                f"| {n} | {name} | {s['p99_ttft_ms']:,.0f} | {s['p99_tpot_ms']:.1f} | {s['request_goodput']:.1f} "
                f"| {s['slo_attainment']:.1%} | {s['load_imbalance_mean']:.2f} / {s['load_imbalance_max']:.1f} "
                f"| {wall:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
