"""How a sweep of 64 configurations scales with workers (docs/cluster.md): 8 token budgets x 8 rate
scales on the first N requests of the bundled trace, run serially, in process pools of 1, 2, ... and
all CPUs, and on a local Ray instance (when Ray is installed). Prints wall time and simulated requests
per wall second; checks that every executor's rows equal the serial ones (but for sim_wall_s).

Usage: python benchmarks/cluster_executors.py [--num-requests 1000] [--no-ray]
"""

from __future__ import annotations

import argparse
import os
import time

from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.executors import ProcessExecutor, SerialExecutor, make_executor
from stallfree.sim.studies.sweep import sweep

BUDGETS = [128, 256, 512, 768, 1024, 2048, 4096, 8192]
SCALES = [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]


def main() -> None:
    """Print one row per executor."""
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--no-ray", action="store_true")
    args = p.parse_args()
    setup = Setup(WorkloadOptions(num_requests=args.num_requests), HardwareOptions())
    cpus = os.cpu_count() or 1
    runs: list[tuple[str, object]] = [("serial", SerialExecutor())]
    runs += [(f"process x{j}", ProcessExecutor(j)) for j in sorted({1, 2, cpus})]
    if not args.no_ray:
        try:
            runs.append((f"ray local x{cpus}", make_executor("ray", jobs=cpus)))
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            print(f"ray skipped: {exc}")
    n_sims = len(BUDGETS) * len(SCALES)
    print(f"{n_sims} simulations of {args.num_requests} requests each ({n_sims * args.num_requests:,} requests); "
          f"{cpus} CPUs\n")
    print("| executor | wall (s) | simulated requests / wall s | rows equal serial |")
    print("|---|---|---|---|")
    ref = None
    for name, ex in runs:
        t0 = time.perf_counter()
        res = sweep(setup, BUDGETS, batching=["chunked"], rate_scales=SCALES, slo_ttft=1.0, slo_tpot=0.05,
                    jobs=ex)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        rows = [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in res.table_rows]
        ref = ref if ref is not None else rows
        print(f"| {name} | {wall:.1f} | {n_sims * args.num_requests / wall:,.0f} | {rows == ref} |", flush=True)


if __name__ == "__main__":
    main()
