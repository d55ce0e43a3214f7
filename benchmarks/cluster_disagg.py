"""Aggregated against disaggregated serving at equal GPU count (docs/cluster.md): the whole bundled
Azure conversation trace, N replicas of the default replica (4 x H100, FP8, Llama 3.3 70B)
aggregated, against every P:D split of the same N replicas; goodput per GPU. Each side's token
budget is searched too (stallfree.sim.studies.disagg_search.search_plan's grids, or the ones given).

Usage: python benchmarks/cluster_disagg.py [--replicas 8] [--rate-scale 16] [--num-requests N]
    [--slo-ttft 1.0] [--slo-tpot 0.05] [--aggregated-budgets 1024,2048,4096] [--prefill-budgets 2048,8192]
    [--decode-budgets 128,2048]
"""

from __future__ import annotations

import argparse
import time

from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.disagg_search import (
    DEFAULT_AGGREGATED_BUDGETS,
    DEFAULT_DECODE_BUDGETS,
    DEFAULT_PREFILL_BUDGETS,
    search_plan,
)


def main() -> None:
    """Print one markdown row per configuration, aggregated first, then P:D best first."""
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--rate-scale", type=float, default=16.0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="s")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="s")
    p.add_argument("--num-requests", type=int, default=None, help="the first N requests (default: all)")

    def grid(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    p.add_argument("--aggregated-budgets", type=grid, default=list(DEFAULT_AGGREGATED_BUDGETS))
    p.add_argument("--prefill-budgets", type=grid, default=list(DEFAULT_PREFILL_BUDGETS))
    p.add_argument("--decode-budgets", type=grid, default=list(DEFAULT_DECODE_BUDGETS))
    args = p.parse_args()
    setup = Setup(WorkloadOptions(rate_scale=args.rate_scale, num_requests=args.num_requests), HardwareOptions())
    wl = setup.workload
    t0 = time.perf_counter()
    aggs, rows = search_plan(
        setup, args.replicas, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot,
        aggregated_budgets=args.aggregated_budgets, prefill_budgets=args.prefill_budgets,
        decode_budgets=args.decode_budgets,
    )
    wall = time.perf_counter() - t0
    agg = aggs[0]
    print(f"{wl.name}: {len(wl):,} requests, {wl.mean_rate:.1f} req/s offered; {setup.hardware}")
    print(f"SLO: TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot * 1e3:g} ms; {agg['num_gpus']} GPUs; "
          f"search wall {wall:.0f} s\n")
    print("| configuration | goodput (req/s) | goodput/GPU | SLO met | p99 TTFT (ms) | p99 TPOT (ms) "
          "| p99 transfer (ms) |")
    print("|---|---|---|---|---|---|---|")
    for s in [*aggs, *rows]:
        xfer = s.get("p99_transfer_ms")
        print(
            f"| {s['label']} | {s['request_goodput']:.1f} | {s['goodput_per_gpu']:.3f} | "
            f"{(s['request_goodput'] or 0) / s['request_throughput']:.1%} | {s['p99_ttft_ms']:,.0f} | "
            f"{s['p99_tpot_ms']:.1f} | {'-' if xfer is None else f'{xfer:.2f}'} |"
        )
    best = rows[0]
    # The labels name their kind ("aggregated x8 b2048", "disagg 5P:3D ..."): "best" alone reads right.
    print(f"\nbest: {agg['label']}: {agg['goodput_per_gpu']:.3f} req/s/GPU; {best['label']}: "
          f"{best['goodput_per_gpu']:.3f} req/s/GPU")


if __name__ == "__main__":
    main()
