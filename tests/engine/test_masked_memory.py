"""Memory the engine never wrote never reaches an output: with every unwritten KV slot holding NaN
or a huge value, batches whose sequences differ in length (decodes, prefill chunks, recompute after
preemption) give exactly the outputs of a clean cache (issue 19 item 4; case B39)."""

from __future__ import annotations

import pytest
import torch

from stallfree import PagedScheduler
from stallfree.engine import LLMEngine, SamplingParams, engine_config
from stallfree.engine.batch import BatchEntry, build_flat_batch
from stallfree.engine.kv_cache import KVCache

# Real-model runs over caches filled with NaN and huge values, several budgets each.
pytestmark = pytest.mark.slow

FILLS = {"zero": 0.0, "nan": float("nan"), "huge": 3e38}
PROMPTS = ["The capital of France is", "one, two, three,", "Write a haiku about the sea.", "def fib(n):"]
GREEDY = dict(temperature=0, ignore_eos=True)


def fill_unwritten(kv: KVCache, value: float) -> None:
    """Fill every slot blocks can be handed out from (all but the pad block) with `value`."""
    kv.k[:, : kv.num_slots] = value
    kv.v[:, : kv.num_slots] = value


@pytest.fixture(scope="module")
def alone(model, checkpoint):
    """Greedy tokens (8 each) of each prompt run alone on a zero-filled cache."""
    out = {}
    for i, p in enumerate(PROMPTS):
        eng = LLMEngine(model, checkpoint.tokenizer, scheduler=engine_config(4096, 1, 256))
        fill_unwritten(eng.kv, 0.0)
        eng.add_request(i, p, SamplingParams(max_tokens=8, **GREEDY))
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
        out[i] = toks
    return out


@pytest.mark.parametrize("fill", ["nan", "huge"])
def test_forward_logits_ignore_unwritten_slots(model, fill):
    """Decodes of contexts 9, 3 and 1 and two chunks of 3 and 6 tokens, batched, give bitwise the
    logits of a zero-filled cache, whatever the unwritten slots hold."""
    c = model.config
    dev = model.device

    def run(value):
        kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 12, 4, model.dtype, dev)
        fill_unwritten(kv, value)
        # First step: prompts of 8, 2 and 0 tokens for the decoders; non-contiguous tables.
        tables = {"a": [5, 2, 9], "b": [7], "c": [0], "d": [3, 11], "e": [1, 4]}
        model.forward(build_flat_batch([BatchEntry(list(range(100, 108)), 0, tables["a"], "none"),
                                        BatchEntry([200, 201], 0, tables["b"], "none")], 4, dev,
                                       kv.pad_block), kv)
        batch = build_flat_batch([
            BatchEntry([300], 8, tables["a"]), BatchEntry([301], 2, tables["b"]),
            BatchEntry([302], 0, tables["c"]),
            BatchEntry([400, 401, 402], 0, tables["d"], "all"),
            BatchEntry([500, 501, 502, 503, 504, 505], 0, tables["e"], "all"),
        ], 4, dev, kv.pad_block)
        return model.forward(batch, kv)

    want, got = run(0.0), run(FILLS[fill])
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("fill", ["nan", "huge"])
@pytest.mark.parametrize("budget", [3, 7, 64], ids=lambda b: f"budget{b}")
def test_engine_outputs_ignore_unwritten_slots(model, checkpoint, alone, fill, budget):
    """Four requests of different lengths, arriving at steps 0, 2, 4, 6 into a cache full of
    garbage, with chunked prefill: each gets exactly its greedy tokens alone on a clean cache."""
    eng = LLMEngine(model, checkpoint.tokenizer, scheduler=engine_config(budget, 3, 512))
    fill_unwritten(eng.kv, FILLS[fill])
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    step = 0
    while step < 8 or eng.has_unfinished():
        if step % 2 == 0 and step // 2 < len(PROMPTS):
            eng.add_request(step // 2, PROMPTS[step // 2], SamplingParams(max_tokens=8, **GREEDY))
        for o in eng.step():
            got[o.rid] += o.new_token_ids
        step += 1
    assert got == alone


@pytest.mark.parametrize("fill", ["zero", "nan", "huge"])
def test_b39_recompute_after_preemption(model, checkpoint, fill):
    """Case B39: two requests under PagedScheduler(budget 8, 2 slots, 6 blocks of 4) need 4 blocks
    each; one is preempted and recomputed (13 tokens in chunks of 6 and 7) and both still produce
    their greedy tokens alone, with the cache's unwritten slots holding `fill`; all 6 blocks free."""
    sched = PagedScheduler(token_budget=8, max_seqs=2, num_blocks=6, block_size=4, watermark=0)
    eng = LLMEngine(model, checkpoint.tokenizer, scheduler=sched)
    fill_unwritten(eng.kv, FILLS[fill])
    eng.add_request("a", PROMPTS[0], SamplingParams(max_tokens=10, **GREEDY))
    eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=10, **GREEDY))
    got: dict[str, list[int]] = {"a": [], "b": []}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.rid] += o.new_token_ids
    assert got == {"a": [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34],
                   "b": [1876, 28, 2531, 28, 2976, 28, 4962, 28, 4475, 28]}
    assert (sched.stats().num_preemptions, sched.stats().num_recomputed_tokens) == (1, 13)
    assert sched.stats().num_free_blocks == 6
