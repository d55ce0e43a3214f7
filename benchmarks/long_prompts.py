"""Long prompts and head-of-line blocking: the contract vs concurrent partial prefills (K/L/T).

The trace (`--trace azure`, the default): the bundled Azure LLM 2023 conversation trace (first
`--window` seconds, arrivals scaled by `--rate-scale`), with `--num-long` prompts of 50k-120k tokens
(uniform, seeded) injected at uniformly drawn arrival times in the window, each with `--long-output`
output tokens. `--trace mooncake`: the bundled Mooncake FAST'25 conversation trace instead (its own
long prompts, p99 85k tokens; prefix caching off), windowed and scaled the same way. Steps are
priced by the default cost model (Llama 3.3 70B, 4 x H100 SXM, FP8; its context length 131,072
tokens bounds every request). Every request must complete.

Reported per setting: TTFT p50/p99 of prompts under 4k tokens and of prompts over 32k tokens, p99
TPOT (all requests with >= 2 tokens), output throughput (tokens/s over the run) and completions.
`--step-breakdown` also prints, per setting, the steps that carry a chunk deep into a prompt (start
>= 4,096 tokens, whose attention over the prefix makes the step slow) against the others: how many,
their share of the time, step time p50/p99, the decodes in them.
The figure: short-prompt p99 TTFT against long-prompt p99 TTFT, and p99 TPOT against short-prompt
p99 TTFT with the issue's goal (TPOT within 1.15x of the contract's, short p99 TTFT at least 2x
lower) shaded, one point per setting.

Usage:
    PYTHONPATH=src python benchmarks/long_prompts.py --out /tmp/long_prompts
    PYTHONPATH=src python benchmarks/long_prompts.py --trace mooncake --window 1800 --rate-scale 0.25 --num-long 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from stallfree.core.plan import StepPlan
from stallfree.sim.inputs.pricing import default_cost_model
from stallfree.sim.inputs.traces import load_bundled, load_mooncake
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import latency_arrays
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.simulator import simulate

MAX_MODEL_LEN = 131_072  # Llama 3.3 70B's context length, tokens (the default cost model's model)

#: (label, (K, L, T) or None for the contract). T = 5,242 is vLLM's default, 4% of 131,072.
SETTINGS: list[tuple[str, tuple[int, int, int] | None]] = [
    ("contract (K=1)", None),
    ("K=2 L=2 T=1024", (2, 2, 1024)),
    ("K=2 L=2 T=256", (2, 2, 256)),
    ("K=4 L=4 T=256", (4, 4, 256)),
    ("K=4 L=4 T=512", (4, 4, 512)),
    ("K=8 L=8 T=256", (8, 8, 256)),
    ("K=4 L=1 T=5242 (4%)", (4, 1, MAX_MODEL_LEN * 4 // 100)),
]

#: A chunk starting this deep into its prompt (tokens) makes a "deep-chunk" step in --step-breakdown.
DEEP_CHUNK_START = 4096


def build_trace(
    seed: int, window: float, rate_scale: float, num_long: int, long_output: int, trace: str = "azure"
) -> Workload:
    """A bundled trace's first `window` s, scaled, with `num_long` long prompts injected.

    Args:
        seed: seeds the long prompts' lengths (50,000-120,000 tokens) and arrival times.
        window: seconds of trace time kept (before scaling).
        rate_scale: arrival rate multiplier (arrival times divided by it).
        num_long: long prompts injected (0: none).
        long_output: output tokens of each long prompt.
        trace: "azure" (Azure LLM 2023 conversation) or "mooncake" (Mooncake FAST'25 conversation).

    Raises:
        ValueError: an unknown trace name.
    """
    if trace not in ("azure", "mooncake"):
        raise ValueError(f"trace must be 'azure' or 'mooncake', got {trace!r}")
    full = load_bundled() if trace == "azure" else load_mooncake()
    base = full.window(0.0, window).scale_rate(rate_scale)
    rng = random.Random(seed)
    rows = list(zip(base.arrivals, base.prompt_lens, base.output_lens, strict=True))
    span = base.duration
    for _ in range(num_long):
        rows.append((rng.uniform(0.0, span * 0.8), rng.randint(50_000, 120_000), long_output))
    rows.sort(key=lambda r: r[0])
    return Workload(
        tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows),
        name=f"{'azure-conv-2023' if trace == 'azure' else 'mooncake-conv'}[0,{window:g}s]x{rate_scale:g}"
             f"+{num_long}long(seed {seed})",
    )


class StepRecorder:
    """Wrap a cost model and record, per step: its time (s), decodes, and chunks starting at
    >= DEEP_CHUNK_START tokens (a step "carries a deep chunk")."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.time: list[float] = []
        self.decodes: list[int] = []
        self.deep: list[int] = []

    def step_time(self, plan: StepPlan) -> float:
        """The inner model's time for `plan`, s, recorded."""
        t = float(self.inner.step_time(plan))
        self.time.append(t)
        self.decodes.append(plan.num_decodes)
        self.deep.append(sum(1 for c in plan.prefills if c.start >= DEEP_CHUNK_START))
        return t

    def breakdown(self) -> list[dict[str, Any]]:
        """Per class of step (no deep chunk, one, two or more): steps, share of the run's step time,
        step time p50/p99 (ms), mean decodes per step, and the decode tokens in those steps."""
        t = np.asarray(self.time)
        nd = np.asarray(self.decodes)
        deep = np.asarray(self.deep)
        rows = []
        for label, mask in (("no deep chunk", deep == 0), ("1 deep chunk", deep == 1), (">= 2 deep chunks", deep >= 2)):
            if not mask.any():
                rows.append({"steps": label, "count": 0})
                continue
            rows.append({
                "steps": label, "count": int(mask.sum()), "time_share": float(t[mask].sum() / t.sum()),
                "step_p50_ms": float(np.percentile(t[mask], 50) * 1e3),
                "step_p99_ms": float(np.percentile(t[mask], 99) * 1e3),
                "decodes_mean": float(nd[mask].mean()), "decode_tokens": int(nd[mask].sum()),
            })
        return rows


def measure(wl: Workload, partial: tuple[int, int, int] | None, budget: int) -> dict[str, Any]:
    """Simulate one setting and return its figures (seconds, tokens/s) and its step breakdown."""
    cost, kv = default_cost_model()
    rec = StepRecorder(cost)
    res = simulate(wl, SchedulerConfig(kv, budget, 256, partial_prefills=partial), rec, max_model_len=MAX_MODEL_LEN)
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
        "step_breakdown": rec.breakdown(),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Two panels, one labelled point per setting (settings within 2% of each other share one):
    short-prompt p99 TTFT against long-prompt p99 TTFT; p99 TPOT against short-prompt p99 TTFT,
    with the goal region (TPOT <= 1.15x the contract's, short p99 TTFT <= half the contract's)
    shaded. rows[0] is the contract."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    panels = (
        (ax1, "ttft_long_p99_s", "ttft_short_p99_s", 1.0, 1.0),
        (ax2, "ttft_short_p99_s", "tpot_p99_s", 1.0, 1e3),
    )
    for ax, xkey, ykey, xs, ys in panels:
        xy = [(r[xkey] * xs, r[ykey] * ys) for r in rows]
        dx = (max(x for x, _ in xy) - min(x for x, _ in xy)) or 1.0
        dy = (max(y for _, y in xy) - min(y for _, y in xy)) or 1.0
        points: dict[tuple[float, float], list[str]] = {}
        for (x, y), r in zip(xy, rows, strict=True):
            # Settings within 2% of the axes' spans share one point and one label ("=" joins them).
            near = [p for p in points if abs(p[0] - x) <= 0.02 * dx and abs(p[1] - y) <= 0.02 * dy]
            points.setdefault(near[0] if near else (x, y), []).append(r["setting"])
        for i, ((x, y), labels) in enumerate(points.items()):
            ax.scatter(x, y, s=50)
            # Alternate above and below: nearby settings would otherwise print over each other.
            ax.annotate(" = ".join(labels), (x, y), textcoords="offset points", xytext=(6, 6 if i % 2 else -13),
                        fontsize=8)
        ax.margins(x=0.25, y=0.15)
        ax.grid(True, alpha=0.3)
    base = rows[0]
    ax2.fill_between([0, base["ttft_short_p99_s"] / 2], 0, base["tpot_p99_s"] * 1e3 * 1.15, color="green",
                     alpha=0.12, label="goal: TPOT <= 1.15x, short TTFT >= 2x lower")
    ax2.set_xlim(left=0)
    ax2.set_ylim(bottom=0)
    ax2.legend(loc="upper left", fontsize=8)
    ax1.set_xlabel("p99 TTFT of prompts > 32k tokens (s)")
    ax1.set_ylabel("p99 TTFT of prompts < 4k tokens (s)")
    ax1.set_title("Short vs long p99 TTFT per setting")
    ax2.set_xlabel("p99 TTFT of prompts < 4k tokens (s)")
    ax2.set_ylabel("p99 TPOT (ms)")
    ax2.set_title("p99 TPOT vs short-prompt p99 TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    """Run every setting on one trace and print a table (and JSON, and the figure, with --out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", choices=("azure", "mooncake"), default="azure", help="bundled trace (default azure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=float, default=900.0, help="seconds of the trace (default 900)")
    p.add_argument("--rate-scale", type=float, default=1.5, help="arrival rate multiplier (default 1.5)")
    p.add_argument("--num-long", type=int, default=8, help="long prompts injected (default 8)")
    p.add_argument("--long-output", type=int, default=200, help="output tokens of a long prompt (default 200)")
    p.add_argument("--budget", type=int, default=2048, help="token budget (default 2048)")
    p.add_argument("--step-breakdown", action="store_true", help="print the deep-chunk step breakdown per setting")
    p.add_argument("--out", type=Path, help="write results.json and ttft_short_vs_long.png here")
    args = p.parse_args()
    wl = build_trace(args.seed, args.window, args.rate_scale, args.num_long, args.long_output, args.trace)
    rows = []
    for label, partial in SETTINGS:
        row = {"setting": label, **measure(wl, partial, args.budget)}
        rows.append(row)
    base = rows[0]
    print(f"trace: {wl.name}, {len(wl)} requests, budget {args.budget}")
    print(f"{'setting':<22} {'short p50':>9} {'short p99':>9} {'long p50':>9} {'long p99':>9} "
          f"{'TPOT p99':>9} {'tok/s':>8} {'done':>11}   short p99 / TPOT p99 vs contract")
    for r in rows:
        print(f"{r['setting']:<22} {r['ttft_short_p50_s']:9.3f} {r['ttft_short_p99_s']:9.3f} "
              f"{r['ttft_long_p50_s']:9.3f} {r['ttft_long_p99_s']:9.3f} {r['tpot_p99_s'] * 1e3:7.1f}ms "
              f"{r['throughput_tok_per_s']:8.0f} {r['completed']:>5}/{r['requests']:<5} "
              f"  {base['ttft_short_p99_s'] / r['ttft_short_p99_s']:5.2f}x lower / "
              f"{r['tpot_p99_s'] / base['tpot_p99_s']:4.2f}x")
    if args.step_breakdown:
        print(f"\nsteps with a chunk starting >= {DEEP_CHUNK_START} tokens into its prompt (deep) vs the others:")
        for r in rows:
            for b in r["step_breakdown"]:
                if b["count"]:
                    print(f"{r['setting']:<22} {b['steps']:<17} {b['count']:>7} steps, {b['time_share']:5.1%} of "
                          f"the time, step p50 {b['step_p50_ms']:6.1f} ms p99 {b['step_p99_ms']:6.1f} ms, "
                          f"{b['decodes_mean']:5.1f} decodes/step, {b['decode_tokens']:>8} decode tokens")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"trace": wl.name, "rows": rows}, indent=1))
        plot(rows, args.out / "ttft_short_vs_long.png")


if __name__ == "__main__":
    main()
