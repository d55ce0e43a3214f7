"""Benchmark: the measured-kernel cost model (stallfree.costmodel.kernels) on the default run's plans.

Run: PYTHONPATH=src python benchmarks/bench_kernels.py [--json] [--sample N] [--engine vllm]

Reports, in one run:
- microseconds per priced step over the default `stallfree simulate` run's plans, cached (the
  caches warm, as in a run) and uncached (every cache cleared before each step, so each step asks the
  package for all its terms);
- the error the buckets add: |step_time - step_time_exact| / step_time_exact over a seeded sample
  of those plans (step_time_exact asks the package for every chunk and every decode's own keys);
- the wall time of the default `stallfree simulate` with `--kernels ENGINE` and `--kernels none`,
  each a fresh process (so the kernel run includes loading the package's tables).
Needs the optional package aiconfigurator-core (pip install 'stallfree[kernels]').
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
from typing import Any

from stallfree.core.plan import StepPlan
from stallfree.costmodel.kernels import KernelCostModel
from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.run.simulator import simulate


class _Recorder:
    """Prices with the kernel model and keeps every plan priced."""

    def __init__(self, inner: KernelCostModel) -> None:
        self.inner, self.plans = inner, []  # type: ignore[var-annotated]

    def step_time(self, plan: StepPlan) -> float:
        self.plans.append(plan)
        return self.inner.step_time(plan)


def _wall(engine: str) -> float:
    env = dict(os.environ)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stallfree", "simulate", "--kernels", engine], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--sample", type=int, default=300, help="plans sampled for the bucketing error")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    setup = Setup(WorkloadOptions(), HardwareOptions(kernels=a.engine))
    km = setup.cost_model
    assert isinstance(km, KernelCostModel)
    rec = _Recorder(km)
    simulate(setup.workload, setup.config("chunked", 2048), rec)
    plans = [p for p in rec.plans if p.num_tokens]
    t0 = time.perf_counter()
    for p in plans:
        km.step_time(p)
    cached_us = (time.perf_counter() - t0) / len(plans) * 1e6
    sub = plans[:: max(1, len(plans) // 2000)]
    t0 = time.perf_counter()
    for p in sub:
        km.clear_caches()
        km.step_time(p)
    uncached_us = (time.perf_counter() - t0) / len(sub) * 1e6
    km.clear_caches()
    rng = random.Random(a.seed)
    errs = []
    for p in rng.sample(plans, min(a.sample, len(plans))):
        exact = km.step_time_exact(p)
        errs.append(abs(km.step_time(p) - exact) / exact)
    errs.sort()
    out: dict[str, Any] = {
        "engine": km.engine, "version": km.version, "system": km.tables.system,
        "plans": len(plans), "mean_decodes": statistics.fmean(p.num_decodes for p in plans),
        "us_per_step_cached": cached_us, "us_per_step_uncached": uncached_us,
        "bucket_error": {"sample": len(errs), "mean": statistics.fmean(errs), "median": errs[len(errs) // 2],
                         "p99": errs[min(len(errs) - 1, int(0.99 * len(errs)))], "max": errs[-1]},
        "default_run_wall_s": {f"--kernels {a.engine}": _wall(a.engine), "--kernels none": _wall("none")},
    }
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['engine']} {out['version']} on {out['system']}: {out['plans']:,} plans of the default run "
          f"({out['mean_decodes']:.1f} decodes each on average)")
    print(f"priced step: {cached_us:.1f} us cached, {uncached_us:.1f} us uncached")
    b = out["bucket_error"]
    print(f"bucketing error over {b['sample']} sampled plans: mean {b['mean']:.2e}, median {b['median']:.2e}, "
          f"p99 {b['p99']:.2e}, max {b['max']:.2e} (fractions of the unbucketed step time)")
    for k, v in out["default_run_wall_s"].items():
        print(f"default `stallfree simulate {k}`: {v:.2f} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
