"""Benchmark: the time of one priced step under the kernel tables, this tree's `src` beside an older one.

Run:
    git archive main src | tar -x -C /tmp/old            # an older tree's sources (OLD_SRC = /tmp/old/src)
    PYTHONPATH=src python benchmarks/priced_step.py --against /tmp/old/src [--rounds 3] [--json] [-- SIMULATE_ARGS]

Each round runs one worker process per source tree, alternating (old, new, old, new, ...), so that both see
the same machine load. A worker runs `stallfree simulate SIMULATE_ARGS --kernels vllm` (no arguments: the
default run, the bundled Azure conversation trace of 19,366 requests replayed 1.4 times as fast; e.g.
`-- --num-requests 9000` replays its first 9,000 requests, `-- --synthetic poisson --rate 300 --num-requests 20000
--replicas 32 --router least-outstanding` a cluster sharing one cost model), keeps every plan priced, and then
prices those plans again in the run's order with a fresh cost model (and a fresh replica's view of it for each
view the run bound: KernelCostModel.bind_replica) whose tables are already loaded and whose package calls are
cached (as in a run past its first steps): each step is timed alone (time.perf_counter_ns around one step_time
call), and the whole pass by CPU time. It reports the median and p90 of the per-step times, the CPU
microseconds per step of the pass, and the prices it computed. The parent compares the prices of the two trees
step by step, and sorted (a cluster's replicas may step in another order across replicas; each replica's in
the same order) (relative error median, p99, max) and, in this tree, the prices with the step cache on and
off.

Needs the optional package aiconfigurator-core (pip install 'stallfree[kernels]').
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _worker(argv: list[str], out: str, compare_uncached: bool) -> None:
    """Run `stallfree simulate ARGV --kernels vllm`, keep the plans it prices, price them again step by
    step; write the figures to `out` (JSON)."""
    import contextlib
    import io

    from stallfree.cli import main as cli_main
    from stallfree.costmodel.kernels import KernelCostModel

    plans: list[Any] = []
    owners: list[KernelCostModel] = []  # per plan, the model (or replica's view of it) that priced it
    priced = KernelCostModel.step_time

    def recording(self: KernelCostModel, plan: Any) -> float:
        plans.append(plan)
        owners.append(self)
        return priced(self, plan)

    KernelCostModel.step_time = recording  # type: ignore[method-assign]
    with contextlib.redirect_stdout(io.StringIO()):
        cli_main(["simulate", *argv, "--kernels", "vllm"])
    KernelCostModel.step_time = priced  # type: ignore[method-assign]
    km = owners[0]
    # One model, or views of one (KernelCostModel.bind_replica: each replica's own step cache over the
    # model's price caches).
    if any(m._decode_c is not km._decode_c for m in owners):
        raise SystemExit("the run priced with several kernel cost models; expected one (or views of one)")
    kept = [(p, m) for p, m in zip(plans, owners, strict=True) if p.num_tokens]
    plans = [p for p, _ in kept]
    # The same model, its package calls cached, its per-run structures forgotten: a run's order again,
    # each plan priced by a fresh view where the run had one.
    km._sorted = None
    runs = getattr(km, "_runs", None)
    if runs is not None:
        runs.clear()
    fresh: dict[int, Any] = {}
    for m in owners:
        if id(m) not in fresh:
            fresh[id(m)] = (km if m is km or not hasattr(km, "bind_replica") else km.bind_replica(None)).step_time
    pairs = [(p, fresh[id(m)]) for p, m in kept]
    clock = time.perf_counter_ns
    ns: list[int] = []
    prices: list[float] = []
    cpu0 = time.process_time()
    for p, price in pairs:
        t0 = clock()
        prices.append(price(p))
        ns.append(clock() - t0)
    cpu = time.process_time() - cpu0
    ns.sort()
    result: dict[str, Any] = {
        "steps": len(plans), "mean_decodes": sum(p.num_decodes for p in plans) / len(plans),
        "median_us": ns[len(ns) // 2] / 1e3, "p90_us": _quantile([float(x) for x in ns], 0.9) / 1e3,
        "cpu_us_per_step": cpu / len(plans) * 1e6, "prices": prices,
    }
    if compare_uncached and hasattr(km, "step_time_uncached"):
        result["uncached_prices"] = [km.step_time_uncached(p) for p in plans]
    Path(out).write_text(json.dumps(result), encoding="utf-8")


def _run_worker(src: Path, argv: list[str], compare_uncached: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="priced-step-") as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", out]
        if compare_uncached:
            cmd.append("--compare-uncached")
        env = dict(os.environ, PYTHONPATH=str(src))
        subprocess.run([*cmd, "--", *argv], env=env, check=True)
        data: dict[str, Any] = json.loads(Path(out).read_text(encoding="utf-8"))
        return data


def _errors(a: list[float], b: list[float]) -> dict[str, float] | None:
    """Relative error of `a` against `b`, step by step (None when the runs took different steps)."""
    if len(a) != len(b):
        return None
    errs = sorted(abs(x - y) / y for x, y in zip(a, b, strict=True) if y)
    return {"median": _quantile(errs, 0.5), "p99": _quantile(errs, 0.99), "max": errs[-1],
            "identical_steps": sum(x == y for x, y in zip(a, b, strict=True))}


def main() -> int:
    """Run the comparison and print a table (or JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, help="an older tree's src folder (OLD_SRC)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating worker pairs (default 3)")
    ap.add_argument("simulate_args", nargs="*", metavar="-- SIMULATE_ARGS",
                    help="the `stallfree simulate` options of the run (default: none, the default run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--compare-uncached", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.simulate_args, a.worker, a.compare_uncached)
        return 0
    new_src = HERE.parent / "src"
    trees = [("new", new_src)] if a.against is None else [("old", a.against.resolve()), ("new", new_src)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for r in range(a.rounds):
        for name, src in trees:
            runs[name].append(_run_worker(src, a.simulate_args, compare_uncached=(name == "new" and r == 0)))
    workload = "`stallfree simulate " + " ".join([*a.simulate_args, "--kernels", "vllm"]) + "`"
    out: dict[str, Any] = {"workload": workload, "rounds": a.rounds}
    for name, rs in runs.items():
        out[name] = {"steps": rs[0]["steps"], "mean_decodes": rs[0]["mean_decodes"],
                     "median_us": median(x["median_us"] for x in rs), "p90_us": median(x["p90_us"] for x in rs),
                     "cpu_us_per_step": median(x["cpu_us_per_step"] for x in rs)}
    new0 = runs["new"][0]
    if "uncached_prices" in new0:
        out["cache_on_vs_off"] = _errors(new0["prices"], new0["uncached_prices"])
    if "old" in runs:
        out["new_vs_old"] = _errors(new0["prices"], runs["old"][0]["prices"])
        # A cluster's replicas may step in another order across replicas (the event loop runs each on its own
        # between arrivals), each replica's steps in the same order: the prices compared as sorted lists too.
        out["new_vs_old_sorted"] = _errors(sorted(new0["prices"]), sorted(runs["old"][0]["prices"]))
        out["ratio_median"] = out["old"]["median_us"] / out["new"]["median_us"]
        out["ratio_cpu"] = out["old"]["cpu_us_per_step"] / out["new"]["cpu_us_per_step"]
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"priced step of {out['workload']}: medians of {a.rounds} alternating rounds")
    print(f"{'tree':<5} {'steps':>8} {'decodes/step':>13} {'median us':>10} {'p90 us':>8} {'CPU us/step':>12}")
    for name, _ in trees:
        f = out[name]
        print(f"{name:<5} {f['steps']:>8,} {f['mean_decodes']:>13.1f} {f['median_us']:>10.2f} {f['p90_us']:>8.2f} "
              f"{f['cpu_us_per_step']:>12.2f}")
    if "old" in runs:
        print(f"old / new: median {out['ratio_median']:.2f}x, CPU per step {out['ratio_cpu']:.2f}x")
    for key, label in (("new_vs_old", "new vs old prices"), ("new_vs_old_sorted", "new vs old prices, sorted"),
                       ("cache_on_vs_off", "step cache on vs off")):
        e = out.get(key, "absent")
        if e is None:
            print(f"{label}: the runs took different steps")
        elif e != "absent":
            print(f"{label}: relative error median {e['median']:.1e}, p99 {e['p99']:.1e}, max {e['max']:.1e} "
                  f"({e['identical_steps']:,} steps identical)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
