"""Two tenants, one flooding: the light tenant's TTFT under FCFS and under VTC, against its TTFT alone.

The workload (seeded): tenant "light" sends short requests (prompts uniform 100-1,000 tokens, outputs
uniform 50-300) as a Poisson process at --light-rate requests/s; tenant "flood" sends long prompts
(uniform 8,000-16,000 tokens, 200 output tokens) at --flood-rate requests/s, more prefill than the
replica can serve, for --duration seconds. Steps are priced by the default cost model (Llama 3.3 70B,
4 x H100 SXM, FP8; the simulator's defaults: budget 2,048 tokens, 256 sequences; synchronous scheduling
unless --async-scheduling). Runs: the light tenant alone, both under fairness="fcfs", both under
fairness="vtc" (weights 1) with isolation off (the library's default), and both under "vtc" with isolation
(tenant_chunk_tokens=C, tenant_burst_tokens=B: --tenant-chunk-tokens, --tenant-burst-tokens; by default the
commands' own under --fairness vtc, stallfree.flags.VTC_CHUNK_TOKENS and VTC_BURST_TOKENS). Every request
completes.

Reported per run: the light tenant's TTFT p50/p99, the flood's TTFT p50, total token throughput (input
+ output tokens over the run, tokens/s) and output throughput. The goal: light p99 TTFT with VTC within
2x of alone, total throughput within 5% of FCFS (the verdict's ratios; "vtc" and "vtc+isolation").
`--breakdown` adds, per run, where the light tenant's TTFT goes (means and p99s, ms): waiting for the step
in flight at its arrival, steps it then waited in the queue, and the step(s) from its admission to its first
token. `--out DIR` also writes the trace (CSV with a tenant column) so that the CLI reproduces each run:

    stallfree simulate --trace DIR/two_tenants.csv --json [--fairness vtc [--tenant-chunk-tokens 0
        --tenant-burst-tokens 0]]   (vtc alone: isolation turned off; without them, the default isolation)
    stallfree simulate --trace DIR/light_alone.csv --json

Prints a table (times in ms or s, throughputs in tokens/s, the ratios of the goal) under a line that says
what priced the steps; `--json` prints the figures unrounded instead.

Usage:
    PYTHONPATH=src python benchmarks/tenants_sim.py
    PYTHONPATH=src python benchmarks/tenants_sim.py --json
    PYTHONPATH=src python benchmarks/tenants_sim.py --out /tmp/tenants
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.flags import VTC_BURST_TOKENS, VTC_CHUNK_TOKENS
from stallfree.sim.inputs.options import HardwareOptions
from stallfree.sim.inputs.pricing import build_cost_model, default_cost_model
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.result import SimResult
from stallfree.sim.run.simulator import simulate


def two_tenants(seed: int, duration: float, light_rate: float, flood_rate: float) -> Workload:
    """The seeded two-tenant workload described in the module docstring, in arrival order."""
    rng = random.Random(seed)
    rows: list[tuple[float, int, int, str]] = []
    for tenant, rate in (("light", light_rate), ("flood", flood_rate)):
        t = rng.expovariate(rate)
        while t < duration:
            if tenant == "light":
                rows.append((t, rng.randint(100, 1000), rng.randint(50, 300), tenant))
            else:
                rows.append((t, rng.randint(8000, 16000), 200, tenant))
            t += rng.expovariate(rate)
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Workload(tuple(r[0] - t0 for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows),
                    "two_tenants", tenants=tuple(r[3] for r in rows))


def only(wl: Workload, tenant: str) -> Workload:
    """The requests of one tenant (arrival times kept)."""
    assert wl.tenants is not None
    idx = [i for i, t in enumerate(wl.tenants) if t == tenant]
    return Workload(tuple(wl.arrivals[i] for i in idx), tuple(wl.prompt_lens[i] for i in idx),
                    tuple(wl.output_lens[i] for i in idx), f"{wl.name}_{tenant}",
                    tenants=tuple(wl.tenants[i] for i in idx))


def run(wl: Workload, budget: int, async_scheduling: bool, **options: Any) -> tuple[dict[str, Any], SimResult]:
    """Simulate `wl` with the default replica, token budget `budget` and SchedulerConfig `options`; the
    summary and the result."""
    cost, kv = default_cost_model()
    res = simulate(wl, ReplicaConfig.of(kv, budget, async_scheduling=async_scheduling, **options), cost)
    assert sum(1 for f in res.finish_step if f >= 0) == len(wl), "every request completes"
    return summarize_result(res), res


def breakdown(res: SimResult, tenant: str = "light") -> dict[str, float]:
    """Where `tenant`'s TTFT goes, ms (mean and p99 of each part over its requests): `in_flight`, from its
    arrival to the start of the first step planned after it; `queued`, from there to the start of its
    admission's step (steps in which it waited); `to_first_token`, from there to the end of the step of its
    first token; plus the share of its requests that waited at least one step."""
    assert res.tenant is not None
    starts = list(res.step_start)
    parts: dict[str, list[float]] = {"in_flight": [], "queued": [], "to_first_token": []}
    waited = 0
    for rid, t in enumerate(res.tenant):
        if t != tenant:
            continue
        first = bisect.bisect_left(starts, res.arrival[rid])
        admit = res.admit_step[rid]
        parts["in_flight"].append(starts[first] - res.arrival[rid])
        parts["queued"].append(starts[admit] - starts[first])
        parts["to_first_token"].append(res.step_end[res.first_step[rid]] - starts[admit])
        waited += admit > first
    out: dict[str, float] = {}
    for name, xs in parts.items():
        xs.sort()
        out[f"{name}_mean_ms"] = 1000 * sum(xs) / len(xs)
        out[f"{name}_p99_ms"] = 1000 * xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]
    out["share_queued"] = waited / len(parts["queued"])
    return out


def _time(ms: float | None) -> str:
    """A latency for the table: ms below a second, else s; '-' for none."""
    if ms is None:
        return "-"
    return f"{ms:,.1f} ms" if ms < 1000 else f"{ms / 1000:,.1f} s"


def _ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.2f}x"


def table(report: dict[str, Any], priced: str, args: argparse.Namespace) -> list[str]:
    """The readable report: the workload and what priced the steps, a row per run, the goal's ratios, and
    with --breakdown where the light tenant's TTFT goes."""
    iso = report["isolation"]
    lines = [
        f"two tenants, seed {args.seed}: {report['requests']:,} requests arriving over {args.duration:g} s "
        f"(light {args.light_rate:g}/s, prompts 100-1,000 tokens; flood {args.flood_rate:g}/s, prompts "
        "8,000-16,000 tokens)",
        f"{priced}; budget {args.max_num_batched_tokens:,} tokens, "
        f"{'asynchronous' if report['async_scheduling'] else 'synchronous'} scheduling",
        f"vtc+isolation: tenant chunk {iso['tenant_chunk_tokens']:,} tokens, burst {iso['tenant_burst_tokens']:,} "
        "tokens; vtc: isolation off",
        "",
    ]
    head = ("run", "light TTFT p50 / p99", "light TPOT p99", "flood TTFT p50", "total tokens/s", "output tokens/s")
    rows = [head] + [
        (name, f"{_time(r['light_p50_ttft_ms'])} / {_time(r['light_p99_ttft_ms'])}", _time(r["light_p99_tpot_ms"]),
         _time(r["flood_p50_ttft_ms"]), f"{r['total_token_throughput']:,.0f}", f"{r['output_throughput']:,.0f}")
        for name, r in report["runs"].items()]
    lines += _columns(rows)
    v = report["verdict"]
    lines += [
        "",
        f"light p99 TTFT over alone: fcfs {_ratio(v['light_p99_ttft_fcfs_over_alone'])}, vtc "
        f"{_ratio(v['light_p99_ttft_vtc_over_alone'])}, vtc+isolation "
        f"{_ratio(v['light_p99_ttft_isolation_over_alone'])} (goal: within 2x)",
        f"total throughput over fcfs: vtc {v['total_throughput_vtc_over_fcfs']:.4f}, vtc+isolation "
        f"{v['total_throughput_isolation_over_fcfs']:.4f} (goal: within 5%)",
    ]
    if args.breakdown:
        head = ("run", "in flight mean / p99", "queued mean / p99", "to first token mean / p99", "waited a step")
        rows = [head] + [
            (name, *(f"{_time(b[f'{part}_mean_ms'])} / {_time(b[f'{part}_p99_ms'])}"
                     for part in ("in_flight", "queued", "to_first_token")), f"{b['share_queued']:.0%}")
            for name, r in report["runs"].items() for b in (r["light_ttft_breakdown"],)]
        lines += ["", "where the light tenant's TTFT goes:", *_columns(rows)]
    return lines


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as aligned text: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if k == 0 else cell.rjust(w) for k, (cell, w) in enumerate(zip(row, widths,
                                                                                                    strict=True)))
            for row in rows]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--light-rate", type=float, default=2.0, help="light tenant, requests/s")
    ap.add_argument("--flood-rate", type=float, default=6.0, help="flooding tenant, requests/s")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget (default 2,048)")
    ap.add_argument("--tenant-chunk-tokens", type=int, default=VTC_CHUNK_TOKENS,
                    help=f"C of the isolation run (default {VTC_CHUNK_TOKENS}, the commands' default under vtc)")
    ap.add_argument("--tenant-burst-tokens", type=int, default=VTC_BURST_TOKENS,
                    help=f"B of the isolation run (default {VTC_BURST_TOKENS}, the commands' default under vtc)")
    ap.add_argument("--async-scheduling", action="store_true", help="plan each step while the previous one runs")
    ap.add_argument("--breakdown", action="store_true", help="where the light tenant's TTFT goes, per run")
    ap.add_argument("--out", type=Path, default=None, help="also write the traces (two_tenants.csv, light_alone.csv)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON, unrounded, instead of the table")
    args = ap.parse_args(argv)
    wl = two_tenants(args.seed, args.duration, args.light_rate, args.flood_rate)
    b, a = args.max_num_batched_tokens, args.async_scheduling
    iso = {"tenant_chunk_tokens": args.tenant_chunk_tokens, "tenant_burst_tokens": args.tenant_burst_tokens}
    runs = {"light alone": run(only(wl, "light"), b, a), "fcfs": run(wl, b, a), "vtc": run(wl, b, a, fairness="vtc"),
            "vtc+isolation": run(wl, b, a, fairness="vtc", **iso)}
    out: dict[str, Any] = {}
    for name, (s, res) in runs.items():
        light = s["by_tenant"]["light"]
        flood = s["by_tenant"].get("flood", {})
        out[name] = {
            "light_p50_ttft_ms": light["median_ttft_ms"], "light_p99_ttft_ms": light["p99_ttft_ms"],
            "light_p99_tpot_ms": light["p99_tpot_ms"], "flood_p50_ttft_ms": flood.get("median_ttft_ms"),
            "total_token_throughput": s["total_token_throughput"], "output_throughput": s["output_throughput"],
            "duration_s": s["duration_s"],
        }
        if args.breakdown:
            out[name]["light_ttft_breakdown"] = breakdown(res)
    alone, fcfs, vtc, iso_run = out["light alone"], out["fcfs"], out["vtc"], out["vtc+isolation"]
    verdict = {
        "light_p99_ttft_fcfs_over_alone": fcfs["light_p99_ttft_ms"] / alone["light_p99_ttft_ms"],
        "light_p99_ttft_vtc_over_alone": vtc["light_p99_ttft_ms"] / alone["light_p99_ttft_ms"],
        "total_throughput_vtc_over_fcfs": vtc["total_token_throughput"] / fcfs["total_token_throughput"],
        "light_p99_ttft_isolation_over_alone": iso_run["light_p99_ttft_ms"] / alone["light_p99_ttft_ms"],
        "total_throughput_isolation_over_fcfs": iso_run["total_token_throughput"] / fcfs["total_token_throughput"],
    }
    report = {"requests": len(wl), "isolation": iso, "async_scheduling": a, "runs": out, "verdict": verdict}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(table(report, build_cost_model(HardwareOptions())[2], args)))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        assert wl.tenants is not None
        for name, part in (("two_tenants", wl), ("light_alone", only(wl, "light"))):
            assert part.tenants is not None
            with open(args.out / f"{name}.csv", "w") as fh:
                fh.write("arrival_time,prompt_len,output_len,tenant\n")
                for t, p, o, tenant in zip(part.arrivals, part.prompt_lens, part.output_lens, part.tenants,
                                           strict=True):
                    fh.write(f"{t:.6f},{p},{o},{tenant}\n")


if __name__ == "__main__":
    main()
