"""Step-level simulations of the scheduler options, for docs/scheduling.md.

Usage: python benchmarks/options_sim.py [--seed 0]

Time is counted in steps (no cost model), so each figure isolates what an option changes in the
schedule itself. Four seeded experiments:

1. priority with aging: an overloaded mix of interactive (priority 0) and batch (priority 5) requests;
   queueing delay (admission step - arrival step) per class;
2. block-aligned chunks: budget use and TTFT (steps) with block_size 16 against exact chunks;
3. decode overflow: 64 decodes under a per-step budget that varies from 40 to 80 tokens; the longest
   and p99 gap between a request's tokens, "oldest" against "rotate";
4. speculative decode tokens: a batch of 64 requests with each draft token accepted with probability
   0.7; steps to finish and tokens per step for k = 0, 2, 4.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stallfree import Request, Scheduler  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def drive(s: Scheduler, arrivals: dict[int, list[Request]], budget_fn=None, accept_fn=None, limit=200_000):
    """Run to the end; return admission step, first-token step and token steps per rid, and step token counts."""
    admit, first, tokens, used = {}, {}, {}, []
    while s.has_unfinished() or s.step <= max(arrivals, default=-1):
        for r in arrivals.get(s.step, []):
            s.add(r)
        plan = s.schedule(budget_fn(s.step) if budget_fn else None)
        used.append(plan.num_tokens / plan.token_budget)
        for rid in plan.admitted:
            admit[rid] = plan.step
        for c in plan.prefills:
            if c.is_last:
                first[c.rid] = plan.step
        accepted = accept_fn(plan) if accept_fn else None
        for rid in s.complete(plan, num_accepted=accepted):
            tokens.setdefault(rid, []).append(plan.step)
        if s.step > limit:
            raise RuntimeError("did not finish")
    return admit, first, tokens, used


def priority_experiment(seed: int) -> list[str]:
    rows = ["| policy | interactive queueing p50 / p99 (steps) | batch queueing p50 / p99 (steps) | batch max |",
            "|---|---|---|---|"]
    for label, kw in [
        ("fcfs", {}),
        ("priority, no aging", {"policy": "priority"}),
        ("priority, aging 200 steps", {"policy": "priority", "aging_interval": 200}),
        ("priority, aging 20 steps", {"policy": "priority", "aging_interval": 20}),
    ]:
        rng = random.Random(seed)
        arrivals: dict[int, list[Request]] = {}
        cls = {}
        for rid in range(1500):
            # One arrival every 2 steps, ~564 tokens each on average (0.3 x 200 + 0.7 x 720): ~282 tokens
            # offered per step against a 256-token budget, so about 1.1x overloaded.
            step = rid * 2
            inter = rng.random() < 0.3
            req = (
                Request(rid, rng.randint(64, 256), rng.randint(16, 64), priority=0)
                if inter
                else Request(rid, rng.randint(256, 1024), rng.randint(32, 128), priority=5)
            )
            cls[rid] = inter
            arrivals.setdefault(step, []).append(req)
        s = Scheduler(token_budget=256, max_seqs=32, kv_tokens=10**7, **kw)
        admit, *_ = drive(s, arrivals)
        arrive = {r.rid: st for st, rs in arrivals.items() for r in rs}
        q_i = [admit[r] - arrive[r] for r in admit if cls[r]]
        q_b = [admit[r] - arrive[r] for r in admit if not cls[r]]
        rows.append(
            f"| {label} | {pct(q_i, .5):.0f} / {pct(q_i, .99):.0f} | {pct(q_b, .5):.0f} / {pct(q_b, .99):.0f} "
            f"| {max(q_b)} |"
        )
    return rows


def block_experiment(seed: int) -> list[str]:
    rows = ["| chunks | budget used (mean) | TTFT p50 / p99 (steps) | steps to drain |", "|---|---|---|---|"]
    for label, kw in [("exact", {}), ("block_size 16", {"block_size": 16})]:
        rng = random.Random(seed)
        arrivals: dict[int, list[Request]] = {}
        for rid in range(600):
            arrivals.setdefault(rid * 2, []).append(Request(rid, rng.randint(100, 1500), rng.randint(20, 200)))
        s = Scheduler(token_budget=512, max_seqs=64, kv_tokens=10**7, **kw)
        admit, first, _, used = drive(s, arrivals)
        ttft = [first[r] - admit[r] + 1 for r in first]
        rows.append(
            f"| {label} | {statistics.mean(used):.1%} | {pct(ttft, .5):.0f} / {pct(ttft, .99):.0f} | {len(used)} |"
        )
    return rows


def overflow_experiment(seed: int) -> list[str]:
    rows = ["| decode_overflow | longest gap (steps) | p99 gap | mean gap |", "|---|---|---|---|"]
    for mode in ("oldest", "rotate"):
        rng = random.Random(seed)
        s = Scheduler(token_budget=128, max_seqs=64, kv_tokens=10**7, decode_overflow=mode)
        arrivals = {0: [Request(i, 1, 200) for i in range(64)]}
        budgets = [rng.randint(40, 80) for _ in range(100_000)]
        _, _, tokens, _ = drive(s, arrivals, budget_fn=budgets.__getitem__)
        gaps = [b - a for ts in tokens.values() for a, b in zip(ts, ts[1:], strict=False)]
        rows.append(f"| {mode} | {max(gaps)} | {pct(gaps, .99):.0f} | {statistics.mean(gaps):.2f} |")
    return rows


def spec_experiment(seed: int) -> list[str]:
    rows = ["| num_spec_tokens | steps to finish | tokens per step (mean) | output tokens per step |",
            "|---|---|---|---|"]
    for k in (0, 2, 4):
        rng = random.Random(seed)
        s = Scheduler(token_budget=512, max_seqs=64, kv_tokens=10**7, num_spec_tokens=k)
        arrivals = {0: [Request(i, 32, 128) for i in range(64)]}

        def accept(plan, rng=rng):
            out = {}
            for c in plan.decodes:
                n = 1
                while n < c.num_tokens and rng.random() < 0.7:  # each draft token accepted w.p. 0.7
                    n += 1
                out[c.rid] = n
            return out

        _, _, tokens, used = drive(s, arrivals, accept_fn=accept if k else None)
        rows.append(f"| {k} | {len(used)} | {statistics.mean(used) * 512:.0f} | {64 * 128 / len(used):.1f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    seed = ap.parse_args(argv).seed
    for title, fn in [
        ("priority with aging", priority_experiment),
        ("block-aligned chunks", block_experiment),
        ("decode overflow", overflow_experiment),
        ("speculative decode tokens", spec_experiment),
    ]:
        print(f"\n{title}\n")
        print("\n".join(fn(seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
