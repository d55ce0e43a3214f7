"""Long prompts and head-of-line blocking: the contract vs concurrent partial prefills (K/L/T).

The trace: the bundled Azure LLM 2023 conversation trace (first `--window` seconds, arrivals scaled
by `--rate-scale`), with `--num-long` prompts of 50k-120k tokens (uniform, seeded) injected at
uniformly drawn arrival times in the window, each with `--long-output` output tokens. Steps are
priced by the default cost model (Llama 3.3 70B, 4 x H100 SXM, FP8; its context length 131,072
tokens bounds every request). Every request must complete.

Reported per setting: TTFT p50/p99 of prompts under 4k tokens and of prompts over 32k tokens, p99
TPOT (all requests with >= 2 tokens), output throughput (tokens/s over the run) and completions.
The figure: short-prompt p99 TTFT against long-prompt p99 TTFT, one point per setting.

Usage:
    PYTHONPATH=src python benchmarks/long_prompts.py --out /tmp/long_prompts
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from stallfree.sim.report import latency_arrays
from stallfree.sim.setup import default_cost_model
from stallfree.sim.simulator import SchedulerConfig, simulate
from stallfree.sim.workload import Workload, load_bundled

MAX_MODEL_LEN = 131_072  # Llama 3.3 70B's context length, tokens (the default cost model's model)

#: (label, (K, L, T) or None for the contract). T = 5,242 is vLLM's default, 4% of 131,072.
SETTINGS: list[tuple[str, tuple[int, int, int] | None]] = [
    ("contract (K=1)", None),
    ("K=2 L=2 T=1024", (2, 2, 1024)),
    ("K=4 L=2 T=512", (4, 2, 512)),
    ("K=4 L=1 T=512", (4, 1, 512)),
    ("K=4 L=1 T=5242 (4%)", (4, 1, MAX_MODEL_LEN * 4 // 100)),
]


def build_trace(seed: int, window: float, rate_scale: float, num_long: int, long_output: int) -> Workload:
    """The Azure conversation trace's first `window` s, scaled, with `num_long` long prompts injected.

    Args:
        seed: seeds the long prompts' lengths (50,000-120,000 tokens) and arrival times.
        window: seconds of trace time kept (before scaling).
        rate_scale: arrival rate multiplier (arrival times divided by it).
        num_long: long prompts injected.
        long_output: output tokens of each long prompt.
    """
    base = load_bundled().window(0.0, window).scale_rate(rate_scale)
    rng = random.Random(seed)
    rows = list(zip(base.arrivals, base.prompt_lens, base.output_lens, strict=True))
    span = base.duration
    for _ in range(num_long):
        rows.append((rng.uniform(0.0, span * 0.8), rng.randint(50_000, 120_000), long_output))
    rows.sort(key=lambda r: r[0])
    return Workload(
        tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows),
        name=f"azure-conv-2023[0,{window:g}s]x{rate_scale:g}+{num_long}long(seed {seed})",
    )


def measure(wl: Workload, partial: tuple[int, int, int] | None, budget: int) -> dict[str, Any]:
    """Simulate one setting and return its figures (seconds, tokens/s)."""
    cost, kv = default_cost_model()
    res = simulate(wl, SchedulerConfig(kv, budget, 256, partial_prefills=partial), cost, max_model_len=MAX_MODEL_LEN)
    lat = latency_arrays(res)
    rids = lat["rids"]
    plen = np.asarray(res.prompt_len)[rids]
    ttft = lat["ttft"]
    short, long_ = ttft[plen < 4096], ttft[plen > 32_768]
    end = float(np.frombuffer(res.step_end, dtype=np.float64)[-1])
    return {
        "completed": int(len(rids)),
        "requests": len(wl),
        "ttft_short_p50_s": float(np.percentile(short, 50)),
        "ttft_short_p99_s": float(np.percentile(short, 99)),
        "ttft_long_p50_s": float(np.percentile(long_, 50)),
        "ttft_long_p99_s": float(np.percentile(long_, 99)),
        "tpot_p99_s": float(np.percentile(lat["tpot"], 99)),
        "throughput_tok_per_s": float(lat["tokens"].sum()) / (end - wl.arrivals[0]),
        "num_short": int(len(short)),
        "num_long": int(len(long_)),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Short-prompt p99 TTFT against long-prompt p99 TTFT, one labelled point per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    points: dict[tuple[float, float], list[str]] = {}
    for r in rows:  # settings with identical figures share one point and one label
        points.setdefault((r["ttft_long_p99_s"], r["ttft_short_p99_s"]), []).append(r["setting"])
    for (x, y), labels in points.items():
        ax.scatter(x, y, s=50)
        ax.annotate(" = ".join(labels), (x, y), textcoords="offset points", xytext=(6, -12), fontsize=9)
    ax.margins(x=0.2, y=0.1)
    ax.set_xlabel("p99 TTFT of prompts > 32k tokens (s)")
    ax.set_ylabel("p99 TTFT of prompts < 4k tokens (s)")
    ax.set_title("Long prompts: short vs long p99 TTFT per setting")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    """Run every setting on one trace and print a table (and JSON, and the figure, with --out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=float, default=900.0, help="seconds of the Azure trace (default 900)")
    p.add_argument("--rate-scale", type=float, default=1.5, help="arrival rate multiplier (default 1.5)")
    p.add_argument("--num-long", type=int, default=8, help="long prompts injected (default 8)")
    p.add_argument("--long-output", type=int, default=200, help="output tokens of a long prompt (default 200)")
    p.add_argument("--budget", type=int, default=2048, help="token budget (default 2048)")
    p.add_argument("--out", type=Path, help="write results.json and ttft_short_vs_long.png here")
    args = p.parse_args()
    wl = build_trace(args.seed, args.window, args.rate_scale, args.num_long, args.long_output)
    rows = []
    for label, partial in SETTINGS:
        row = {"setting": label, **measure(wl, partial, args.budget)}
        rows.append(row)
    print(f"trace: {wl.name}, {len(wl)} requests, budget {args.budget}")
    print(f"{'setting':<22} {'short p50':>9} {'short p99':>9} {'long p50':>9} {'long p99':>9} "
          f"{'TPOT p99':>9} {'tok/s':>8} {'done':>11}")
    for r in rows:
        print(f"{r['setting']:<22} {r['ttft_short_p50_s']:9.3f} {r['ttft_short_p99_s']:9.3f} "
              f"{r['ttft_long_p50_s']:9.3f} {r['ttft_long_p99_s']:9.3f} {r['tpot_p99_s'] * 1e3:7.1f}ms "
              f"{r['throughput_tok_per_s']:8.0f} {r['completed']:>5}/{r['requests']:<5}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"trace": wl.name, "rows": rows}, indent=1))
        plot(rows, args.out / "ttft_short_vs_long.png")


if __name__ == "__main__":
    main()
