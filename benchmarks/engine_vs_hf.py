"""Side by side: the stallfree engine against Hugging Face transformers' generate() on the same
weights, the same prompts and one torch thread each, alternating which runs first, medians of reps.

Run from the repository root:
    PYTHONPATH=src python benchmarks/engine_vs_hf.py [--quick] [--reps 3] [--json out.json] [--compile]
    PYTHONPATH=src python benchmarks/engine_vs_hf.py --device cuda --dtype bfloat16   # on a GPU

Workloads (greedy, EOS ignored, so both sides make exactly the tokens asked for):
  one      one request at a time (--one-prompts of the prompts, one after another)
  batch16  all --num prompts at once: ours continuously batched (token budget 512); transformers
           one generate() over the left-padded batch
  stagger  the --num requests arrive --gap-s apart with mixed output lengths (16..128 tokens);
           ours adds each request when it arrives and steps continuously; transformers is served
           the way a static-batching server does it: whenever it is idle it takes every request
           that has arrived (up to --num) as one left-padded batch and generates until the longest
           of them is done, while later arrivals wait for the next batch
Both sides run in --dtype (float32 by default, where greedy outputs are identical). In bfloat16 on
a CPU the engine pre-packs its weights for oneDNN (its default there on CPUs with AMX) and
transformers multiplies plain bf16 weights; the outputs then part after a few tokens on both sides.
Figures: output tokens/s (output tokens / wall time from the first arrival to the last token),
and for stagger the mean end-to-end latency; the ratio is ours / transformers. Prompts are
--prompt-len +- 8 random token ids (seeded). Greedy outputs are compared request by request
(identical, or the first position where they differ).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from stallfree.engine import LLMEngine, SamplingParams, engine_config


def load_hf(device: str, dtype: torch.dtype) -> Any:
    """transformers' LlamaForCausalLM from the bundled GGUF file, by transformers' own reader."""
    from stallfree.engine.reference import transformers_reference

    model, _ = transformers_reference()
    return model.to(device=device, dtype=dtype)


def hf_generate(m: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """One left-padded greedy generate() over `prompts`; returns each one's new tokens."""
    width = max(len(p) for p in prompts)
    dev = m.device
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = m.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=2)
    return [row[width:].tolist() for row in out]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ours(base: LLMEngine, work: list[tuple[list[int], int, float]], max_seqs: int,
             device: str) -> tuple[float, list[list[int]], list[float]]:
    """Run `work` (prompt, max_new, arrival s) continuously batched; return (wall s, tokens, e2e s)."""
    # Room for every request at once: the scheduler reserves prompt + max_new in whole blocks.
    bs = base.block_size
    kv = sum(-(-(len(p) + n) // bs) * bs for p, n, _ in work)
    eng = LLMEngine(base.model, base.tokenizer, base.model_name, scheduler=engine_config(512, max_seqs, kv))
    toks: list[list[int]] = [[] for _ in work]
    done = [0.0] * len(work)
    pending = sorted(range(len(work)), key=lambda i: work[i][2])
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        while pending and work[pending[0]][2] <= now:
            i = pending.pop(0)
            eng.add_request(i, work[i][0], SamplingParams(max_tokens=work[i][1], temperature=0,
                                                           ignore_eos=True))
        if not eng.has_unfinished():
            time.sleep(max(0.0, work[pending[0]][2] - now))
            continue
        outs = eng.step()
        _sync(device)
        now = time.perf_counter() - t0
        for o in outs:
            toks[o.rid] += o.new_token_ids
            if o.finished:
                done[o.rid] = now - work[o.rid][2]
    return time.perf_counter() - t0, toks, done


def run_hf(m: Any, work: list[tuple[list[int], int, float]], max_batch: int,
           device: str) -> tuple[float, list[list[int]], list[float]]:
    """Serve `work` as a static-batching server: batch whatever has arrived, run it to its longest."""
    toks: list[list[int]] = [[] for _ in work]
    done = [0.0] * len(work)
    pending = sorted(range(len(work)), key=lambda i: work[i][2])
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if work[pending[0]][2] > now:
            time.sleep(work[pending[0]][2] - now)
            now = time.perf_counter() - t0
        batch = [i for i in pending if work[i][2] <= now][:max_batch]
        pending = [i for i in pending if i not in batch]
        out = hf_generate(m, [work[i][0] for i in batch], max(work[i][1] for i in batch))
        _sync(device)
        now = time.perf_counter() - t0
        for i, row in zip(batch, out, strict=True):
            toks[i] = row[: work[i][1]]
            done[i] = now - work[i][2]
    return time.perf_counter() - t0, toks, done


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (None when identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 requests, 16 new tokens, 1 rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num", type=int, default=16, help="requests in batch16 and stagger")
    ap.add_argument("--one-prompts", type=int, default=4, help="requests in the one-at-a-time run")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gap-s", type=float, default=0.5, help="seconds between staggered arrivals")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="torch.compile our model's dense layers")
    ap.add_argument("--workloads", nargs="+", default=["one", "batch16", "stagger"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.num, args.one_prompts, args.max_new = 1, 4, 2, 16
    torch.set_num_threads(args.threads)
    extra = {"compile": True} if args.compile else {}
    base = LLMEngine.from_pretrained(token_budget=512, max_seqs=1, kv_tokens=4096, device=args.device,
                                     dtype=args.dtype, **extra)
    hf = load_hf(args.device, base.model.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 40000) for _ in range(args.prompt_len + rng.randint(-8, 8))]
               for _ in range(args.num)]
    stagger_new = [rng.randint(16, 128) if not args.quick else rng.randint(8, 24) for _ in prompts]
    work = {
        "one": [(p, args.max_new, 0.0) for p in prompts[: args.one_prompts]],
        "batch16": [(p, args.max_new, 0.0) for p in prompts],
        "stagger": [(p, n, i * args.gap_s) for i, (p, n) in enumerate(zip(prompts, stagger_new, strict=True))],
    }
    run_ours(base, work["batch16"][:2], 2, args.device)  # warm-up: first-use costs on both sides
    hf_generate(hf, [prompts[0], prompts[1]], 2)
    results: dict[str, Any] = {"device": args.device, "dtype": str(base.model.dtype),
                               "threads": torch.get_num_threads(), "reps": args.reps,
                               "num": args.num, "max_new": args.max_new, "workloads": {}}
    for name in args.workloads:
        w = work[name]
        n_out = sum(n for _, n, _ in w)
        rows: dict[str, list[dict[str, float]]] = {"stallfree": [], "transformers": []}
        outs: dict[str, list[list[int]]] = {}
        for rep in range(args.reps):
            order = ["stallfree", "transformers"] if rep % 2 == 0 else ["transformers", "stallfree"]
            for side in order:
                if name == "one":
                    wall, toks, e2e = 0.0, [], []
                    for item in w:
                        if side == "stallfree":
                            s, t, e = run_ours(base, [item], 1, args.device)
                        else:
                            s, t, e = run_hf(hf, [item], 1, args.device)
                        wall, toks, e2e = wall + s, toks + t, e2e + e
                elif side == "stallfree":
                    wall, toks, e2e = run_ours(base, w, args.num, args.device)
                else:
                    wall, toks, e2e = run_hf(hf, w, args.num, args.device)
                rows[side].append({"tokens_per_s": n_out / wall, "wall_s": wall,
                                   "mean_e2e_s": statistics.fmean(e2e)})
                outs[side] = toks
        med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in rows.items()}
        diffs = [first_difference(a, b) for a, b in zip(outs["stallfree"], outs["transformers"], strict=True)]
        res = {"requests": len(w), "output_tokens": n_out, "median": med, "runs": rows,
               "ratio_tokens_per_s": med["stallfree"]["tokens_per_s"] / med["transformers"]["tokens_per_s"],
               "identical_outputs": sum(d is None for d in diffs),
               "first_differences": [d for d in diffs if d is not None]}
        results["workloads"][name] = res
        print(f"{name:8s} {len(w):2d} requests, {n_out} output tokens: stallfree "
              f"{med['stallfree']['tokens_per_s']:.1f} tok/s, transformers "
              f"{med['transformers']['tokens_per_s']:.1f} tok/s -> {res['ratio_tokens_per_s']:.2f}x; "
              f"mean E2E {med['stallfree']['mean_e2e_s']:.2f} s vs {med['transformers']['mean_e2e_s']:.2f} s; "
              f"identical greedy outputs {res['identical_outputs']}/{len(w)}"
              + (f" (first differences at {res['first_differences']})" if diffs and res["first_differences"] else ""),
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
