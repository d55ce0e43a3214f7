"""Aggregated against disaggregated serving at equal GPU count (docs/cluster.md): the whole bundled
Azure conversation trace, N replicas of the default replica (4 x H100, FP8, Llama 3.3 70B)
aggregated, against every P:D split of the same N replicas; goodput per GPU.

Usage: python benchmarks/cluster_disagg.py [--replicas 8] [--rate-scale 16] [--slo-ttft 1.0]
    [--slo-tpot 0.05]
"""

from __future__ import annotations

import argparse
import time

from stallfree.sim.disagg import search_ratio
from stallfree.sim.setup import HardwareOptions, Setup, WorkloadOptions


def main() -> None:
    """Print one markdown row per configuration, aggregated first, then P:D best first."""
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--rate-scale", type=float, default=16.0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="s")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="s")
    args = p.parse_args()
    setup = Setup(WorkloadOptions(rate_scale=args.rate_scale), HardwareOptions())
    wl = setup.workload
    t0 = time.perf_counter()
    agg, rows = search_ratio(setup, args.replicas, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    wall = time.perf_counter() - t0
    print(f"{wl.name}: {len(wl):,} requests, {wl.mean_rate:.1f} req/s offered; {setup.hardware}")
    print(f"SLO: TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot * 1e3:g} ms; {agg['num_gpus']} GPUs; "
          f"search wall {wall:.0f} s\n")
    print("| configuration | goodput (req/s) | goodput/GPU | SLO met | p99 TTFT (ms) | p99 TPOT (ms) "
          "| p99 transfer (ms) |")
    print("|---|---|---|---|---|---|---|")
    for s in [agg, *rows]:
        xfer = s.get("p99_transfer_ms")
        print(
            f"| {s['label']} | {s['request_goodput']:.1f} | {s['goodput_per_gpu']:.3f} | "
            f"{(s['request_goodput'] or 0) / s['request_throughput']:.1%} | {s['p99_ttft_ms']:,.0f} | "
            f"{s['p99_tpot_ms']:.1f} | {'-' if xfer is None else f'{xfer:.2f}'} |"
        )


if __name__ == "__main__":
    main()
