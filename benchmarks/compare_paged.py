"""Reservation vs paged KV on the bundled trace: throughput, TTFT/TPOT percentiles, KV utilisation, preemptions.

Runs the simulator's default replica (Llama 3.3 70B, 4 x H100 SXM, FP8; budget 2,048, max_seqs 256;
the bundled Azure conversation trace at the default rate scale 3) once with the reservation Scheduler
(KV for prompt_len + max_new reserved at admission) and once with the PagedScheduler (blocks of 16
tokens taken as tokens are computed) on the same KV capacity, for each capacity given. Every request
asks for --max-tokens (default 4,096) and stops at its real output length, as a client that sets a
generous max_tokens does, so the reservation scheduler reserves far more than is used.

Usage: PYTHONPATH=src python benchmarks/compare_paged.py [--kv-tokens 65536,131072] [--max-tokens 4096]
       [--num-requests N] [--rate-scale 3] [--block-size 16] [--watermark 0.01] [--check]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stallfree import PagedScheduler  # noqa: E402
from stallfree.sim import load_bundled, simulate  # noqa: E402
from stallfree.sim.inputs.pricing import default_cost_model  # noqa: E402
from stallfree.sim.outputs.report import summarize_result  # noqa: E402
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig

ROWS = [
    ("completed", "{:,}"), ("rejected", "{:,}"), ("request_throughput", "{:.2f}"),
    ("output_throughput", "{:,.0f}"), ("median_ttft_ms", "{:,.0f}"), ("p90_ttft_ms", "{:,.0f}"),
    ("p99_ttft_ms", "{:,.0f}"), ("median_tpot_ms", "{:.1f}"), ("p99_tpot_ms", "{:.1f}"),
    ("p99_itl_ms", "{:.1f}"), ("mean_kv_utilization", "{:.1%}"), ("max_kv_utilization", "{:.1%}"),
    ("mean_running_decodes", "{:.1f}"), ("preemptions", "{:,}"), ("recomputed_tokens", "{:,}"),
    ("recomputed_share", "{:.2%}"), ("num_steps", "{:,}"), ("sim_wall_s", "{:.1f}"),
]


def run_pair(args: argparse.Namespace, kv: int, cost: object) -> list[dict[str, object]]:
    """Simulate both schedulers on `kv` tokens of KV; return their summaries."""
    work = load_bundled()
    if args.num_requests:
        work = work.head(args.num_requests)
    work = work.scale_rate(args.rate_scale)
    out = []
    res = simulate(work, SchedulerConfig(kv, args.budget, args.max_seqs), cost, max_tokens=args.max_tokens,
                   label="reserve")
    out.append(summarize_result(res) | {"preemptions": 0, "recomputed_tokens": 0, "recomputed_share": 0.0})
    made: list[PagedScheduler] = []

    def factory() -> object:
        s = PagedScheduler(args.budget, args.max_seqs, kv // args.block_size, args.block_size, args.watermark)
        made.append(s)
        return s

    # check=True wraps the scheduler in the invariant checker (its paged rules follow the config).
    res = simulate(work, factory, cost, max_tokens=args.max_tokens, label="paged",  # type: ignore[arg-type]
                   check=args.check)
    summary = summarize_result(res)
    s = made[0]
    computed = summary["total_input_tokens"] + summary["total_output_tokens"]
    st = s.stats()
    out.append(summary | {"preemptions": st.num_preemptions, "recomputed_tokens": st.num_recomputed_tokens,
                          "recomputed_share": st.num_recomputed_tokens / computed})
    return out


def main(argv: list[str] | None = None) -> int:
    """Print one table per KV capacity: a row per metric, a column per scheduler."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-tokens", default="65536,131072", help="KV capacities to compare, tokens")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--num-requests", type=int, default=0, help="first N requests of the trace (0: all)")
    # 3x with the library's default cost model (the floor): the load docs/paged.md was measured at.
    ap.add_argument("--rate-scale", type=float, default=3.0)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--watermark", type=float, default=0.01)
    ap.add_argument("--check", action="store_true", help="run the paged invariant checker (slow)")
    args = ap.parse_args(argv)
    cost, default_kv = default_cost_model()
    print(f"bundled trace x{args.rate_scale:g}, max_tokens {args.max_tokens}, budget {args.budget}, "
          f"max_seqs {args.max_seqs}, block_size {args.block_size}, watermark {args.watermark} "
          f"(the replica's own capacity would be {default_kv:,} tokens)")
    for kv in (int(x) for x in args.kv_tokens.split(",")):
        t0 = time.perf_counter()
        reserve, paged = run_pair(args, kv, cost)
        print(f"\nKV {kv:,} tokens ({kv // args.block_size:,} blocks), {time.perf_counter() - t0:.1f} s")
        print(f"{'metric':<22} {'reserve':>12} {'paged':>12}")
        for key, fmt in ROWS:
            cells = ["-" if r.get(key) is None else fmt.format(r[key]) for r in (reserve, paged)]
            print(f"{key:<22} {cells[0]:>12} {cells[1]:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
