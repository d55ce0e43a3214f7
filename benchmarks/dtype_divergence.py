"""Greedy outputs in 16-bit against float32 and against transformers: the first divergence position.

Run from the repository root: PYTHONPATH=src python benchmarks/dtype_divergence.py
Four seeded prompts of 92-108 random token ids, 24 greedy tokens each, batched on the CPU (one
torch thread). For stallfree in float32, bfloat16 and float16 it prints, per request, the first
position where its tokens differ from transformers' in float32 (None = identical) and, in 16-bit,
from transformers' in the same dtype, and transformers' own 16-bit against its float32.
"""

import random
import sys

import torch

sys.path.insert(0, "benchmarks")  # engine_vs_hf sits beside this file
torch.set_num_threads(1)
from engine_vs_hf import first_difference, hf_generate, load_hf  # noqa: E402

from stallfree.engine import LLMEngine, SamplingParams, engine_config  # noqa: E402
from stallfree.engine.model import LlamaModel  # noqa: E402
from stallfree.engine.weights import load_checkpoint  # noqa: E402

ck = load_checkpoint()
rng = random.Random(0)
prompts = [[rng.randrange(300, 40000) for _ in range(100 + rng.randint(-8, 8))] for _ in range(4)]
N = 24
hf32 = hf_generate(load_hf("cpu", torch.float32), prompts, N)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    m = LlamaModel(ck.config, ck.tensors, dtype=dt)
    eng = LLMEngine(m, ck.tokenizer, scheduler=engine_config(512, 4, 1024))
    for i, p in enumerate(prompts):
        eng.add_request(i, p, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    got = {i: [] for i in range(4)}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.rid] += o.new_token_ids
    ours = [got[i] for i in range(4)]
    diffs = [first_difference(a, b) for a, b in zip(ours, hf32, strict=True)]
    line = f"{dt}: vs transformers float32 first differences {diffs}"
    if dt != torch.float32:
        hf = hf_generate(load_hf("cpu", dt), prompts, N)
        line += f"; vs transformers {dt} {[first_difference(a, b) for a, b in zip(ours, hf, strict=True)]}"
        line += f"; transformers {dt} vs its float32 {[first_difference(a, b) for a, b in zip(hf, hf32, strict=True)]}"
    print(line, flush=True)
