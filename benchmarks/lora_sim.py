"""LoRA adapters: the figures of docs/scheduling.md and docs/simulator.md ("LoRA adapters").

Usage: python benchmarks/lora_sim.py [--core N] [--limits] [--routers]

--core N: N seeded random scheduler runs per KV policy with adapters (tests/factories.py's
    random_lora_run: 40 requests, max_loras 1-4 over 1-8 adapters, max_lora_passes 0-8, FCFS, priority,
    K=3 partial prefills, aligned chunks or prefix caching, aborts and early stops) under the invariant
    checker: the limit held in every step, every request finished, the longest pass-over against its bound.
--limits: 32 adapters with Zipf(1) popularity, max_loras 4, 8 and 16 (and 16 with all 32 adapters in host
    memory) on the default replica (Llama 3.3 70B, 4 x H100 SXM): loads, TTFT cold and warm, throughput.
--routers: the same adapters on 4 replicas, max_loras 4, round-robin against adapter-affinity.
--passes: max_loras 4 at 2 and 3.5 requests/s, max_lora_passes 0, 32, 256 (the default) and 4,096.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from stallfree.cli import main  # noqa: E402

WORKLOAD = ["--synthetic", "poisson", "--seed", "0", "--loras", "32", "--lora-popularity", "zipf:1"]


def core(n: int) -> None:
    """Random scheduler runs with adapters under the checker, both KV policies."""
    from factories import random_lora_run

    for policy in ("reserve", "paged"):
        steps = longest = at_bound = finished = 0
        for seed in range(n):
            chk = random_lora_run(seed, policy)
            steps += chk.num_steps
            finished += chk.num_requests
            bound = chk.scheduler.config.max_lora_passes
            assert chk.max_lora_passes_of_one <= bound
            longest = max(longest, chk.max_lora_passes_of_one)
            at_bound += chk.max_lora_passes_of_one == bound and bound > 0
        print(f"{policy}: {n} runs, {finished} requests finished, {steps} steps checked, limit held in every step; "
              f"longest pass-over {longest} steps (bounds 0-8); {at_bound} runs reached their bound")


def simulate(argv: list[str]) -> dict[str, Any]:
    """`stallfree simulate ... --json`'s first run."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(["simulate", *argv, "--json"])
    assert code == 0, code
    run: dict[str, Any] = json.loads(buf.getvalue())["runs"][0]
    return run


def row(name: str, run: dict[str, Any]) -> str:
    lora = run["lora"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    return (f"| {name} | {lora['lora_loads']:,} | {lora['lora_storage_loads']:,} | {lora['cold_requests']:,} | "
            f"{ms(run['mean_ttft_ms'])} | {ms(run['p99_ttft_ms'])} | {ms(lora['mean_ttft_ms_cold'])} | "
            f"{ms(lora['mean_ttft_ms_warm'])} | {run['request_throughput']:.2f} | {run['output_throughput']:,.0f} | "
            f"{run['capacity_req_s']:.2f} |")


HEAD = ("| run | adapter loads | from storage | cold starts | TTFT mean (ms) | TTFT p99 (ms) | TTFT cold | "
        "TTFT warm | requests/s | output tokens/s | capacity (requests/s) |\n" + "|---" * 11 + "|")


def limits() -> None:
    """max_loras 4, 8, 16 on one replica."""
    base = [*WORKLOAD, "--rate", "2", "--num-requests", "1000"]
    print(HEAD)
    for m in (4, 8, 16):
        print(row(f"max_loras {m}", simulate([*base, "--max-loras", str(m)])), flush=True)
    print(row("max_loras 16, 32 in host memory", simulate([*base, "--max-loras", "16", "--max-cpu-loras", "32"])))
    plain = simulate(base)  # the adapters ignored: the base model's run of the same requests
    print(f"base model, no adapters: TTFT mean {plain['mean_ttft_ms']:,.0f} ms, p99 {plain['p99_ttft_ms']:,.0f} ms, "
          f"{plain['request_throughput']:.2f} requests/s, capacity {plain['capacity_req_s']:.2f} requests/s")


def routers() -> None:
    """round-robin against adapter-affinity on 4 replicas."""
    base = [*WORKLOAD, "--rate", "8", "--num-requests", "2000", "--max-loras", "4", "--replicas", "4"]
    print(HEAD)
    for r in ("round-robin", "adapter-affinity"):
        print(row(r, simulate([*base, "--router", r])), flush=True)


def passes() -> None:
    """What the pass-over bound costs: max_loras 4, max_lora_passes 0 to 4,096."""
    print("| rate (requests/s) | max_lora_passes | adapter loads | TTFT mean (ms) | TTFT p99 (ms) | TTFT cold mean | "
          "TTFT cold p99 | TTFT warm mean | capacity (requests/s) |\n" + "|---" * 9 + "|")
    for rate in ("2", "3.5"):
        for p in ("0", "32", "256", "4096"):
            run = simulate([*WORKLOAD, "--rate", rate, "--num-requests", "1000", "--max-loras", "4",
                            "--max-lora-passes", p])
            lora = run["lora"]
            print(f"| {rate} | {int(p):,} | {lora['lora_loads']:,} | {run['mean_ttft_ms']:,.0f} | "
                  f"{run['p99_ttft_ms']:,.0f} | {lora['mean_ttft_ms_cold']:,.0f} | {lora['p99_ttft_ms_cold']:,.0f} | "
                  f"{lora['mean_ttft_ms_warm']:,.0f} | {run['capacity_req_s']:.2f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=int, metavar="N", help="N random scheduler runs per KV policy")
    ap.add_argument("--limits", action="store_true")
    ap.add_argument("--routers", action="store_true")
    ap.add_argument("--passes", action="store_true")
    a = ap.parse_args()
    if a.core:
        core(a.core)
    if a.limits:
        limits()
    if a.routers:
        routers()
    if a.passes:
        passes()
