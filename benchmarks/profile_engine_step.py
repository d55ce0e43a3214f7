"""Profile the engine's decode step: where the time of one step goes with N requests decoding.

Run from the repository root:
    PYTHONPATH=src python benchmarks/profile_engine_step.py [--running 16 256] [--steps 5]

For each N it fills the engine with N greedy requests (prompt of --prompt-len random tokens), runs
until every request decodes, then profiles --steps decode steps with torch.profiler and splits each
step's wall time into:

    linear     aten::linear or, with pre-packed weights, mkldnn::_linear_pointwise (QKV, output
               projection, SwiGLU, LM head), all their children
    attention  SDPA and what it calls (softmax, bmm/matmul outside linear), and the masks
    gather     reading keys and values out of the paged cache (index_select, index, gather)
    writes     the cache writes and the zeroing of new blocks (index_copy_, index_put_, index_fill_)
    other ops  every other top-level aten op (RMSNorm, RoPE, embedding, sampling, batch building)
    python     step wall time minus the time inside top-level aten ops: interpreter work of the
               scheduler, the engine, the batch builder and the model's layer loop

It prints one line per N with median step ms and the shares, and writes --json if given. One torch
thread (the machine is shared; set --threads to change).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from stallfree.engine import LLMEngine, SamplingParams, engine_config

LINEAR = {"aten::linear", "mkldnn::_linear_pointwise"}  # the latter: weights pre-packed (16-bit on a CPU)
ATTENTION = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math",
             "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::softmax", "aten::_softmax",
             "aten::bmm", "aten::matmul", "aten::einsum", "aten::baddbmm", "aten::masked_fill",
             "aten::where", "aten::le", "aten::lt", "aten::ge"}
GATHER = {"aten::index_select", "aten::index", "aten::gather"}
WRITES = {"aten::index_copy_", "aten::index_put_", "aten::index_fill_"}
PARTS = ("linear", "attention", "gather", "writes", "other_ops", "python")


def profile_step(eng: LLMEngine, steps: int) -> dict[str, float]:
    """Profile `steps` decode steps; return median ms per step of each part."""
    rows: list[dict[str, float]] = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            eng.step()
            wall = (time.perf_counter() - t0) * 1e6
        parts = dict.fromkeys(PARTS[:-1], 0.0)
        for ev in prof.events():
            if ev.cpu_parent is not None:
                continue
            us = ev.cpu_time_total
            if ev.name in LINEAR:
                parts["linear"] += us
            elif ev.name in ATTENTION:
                parts["attention"] += us
            elif ev.name in GATHER:
                parts["gather"] += us
            elif ev.name in WRITES:
                parts["writes"] += us
            else:
                parts["other_ops"] += us
        parts["python"] = max(0.0, wall - sum(parts.values()))
        parts["step"] = wall
        rows.append({k: v / 1e3 for k, v in parts.items()})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--steps", type=int, default=5, help="profiled decode steps per N (median)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[100, 24],
                    help="prompt tokens, one per --running value (or one for all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the engine's default)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = LLMEngine.from_pretrained(token_budget=512, max_seqs=1, kv_tokens=4096, device="cpu",
                                     dtype=args.dtype)
    lens = args.prompt_len if len(args.prompt_len) == len(args.running) else args.prompt_len[:1] * len(args.running)
    out = []
    for n, plen in zip(args.running, lens, strict=True):
        # Room for every request's reservation (prompt + 64 tokens, in whole blocks of 16).
        eng = LLMEngine(base.model, base.tokenizer, base.model_name,
                        scheduler=engine_config(512, n, n * -(-(plen + 64) // 16) * 16))
        rng = random.Random(n)
        for i in range(n):
            eng.add_request(i, [rng.randrange(300, 40000) for _ in range(plen)],
                            SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        while eng.last_plan is None or eng.last_plan.num_decodes < n:
            eng.step()
            if eng.last_plan.step > 4 * n * plen:
                raise SystemExit(f"{n} requests never all decode together (KV too small?)")
        for _ in range(2):  # warm-up decode steps
            eng.step()
        r = profile_step(eng, args.steps)
        r.update(running=n, prompt_len=plen)
        out.append(r)
        shares = ", ".join(f"{k} {r[k]:.0f} ms {100 * r[k] / r['step']:.0f}%" for k in PARTS)
        print(f"{n:4d} running (context ~{plen + 3} tokens): step {r['step']:.1f} ms "
              f"(median of {args.steps}); {shares}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
