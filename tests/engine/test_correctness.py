"""Greedy outputs of the engine under any budget, slot limit and arrival pattern equal running each
request alone, and equal Hugging Face transformers' generate on the same GGUF weights."""

from __future__ import annotations

import warnings

import pytest
import torch

from stallfree.engine import LLMEngine, SamplingParams, engine_config
from stallfree.engine.batch import BatchEntry, build_flat_batch
from stallfree.engine.kv_cache import KVCache

# Real-model runs compared with transformers and with each request alone: minutes on 2 cores.
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fib(n):"]
MAX_NEW = 6
# Where greedy paths differ, the reference's two best logits must be this close at the first
# divergence (float32 summation order alone can then flip the argmax).
MARGIN = 1e-4


def full_pass_logits(model, ids):
    """Logits [len(ids), V] of one unchunked, unbatched pass over `ids` with a fresh KV cache."""
    c = model.config
    blocks = -(-len(ids) // 16)
    kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, blocks, 16, model.dtype, model.device)
    batch = build_flat_batch([BatchEntry(ids, 0, list(range(blocks)), "all")], 16, model.device)
    return model.forward(batch, kv)


def assert_same_or_tied(model, prompt_ids, got, want):
    """Assert got == want, or that they part where the reference's top-2 margin is below MARGIN."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    assert i is not None, f"lengths differ: {got} vs {want}"
    top2 = full_pass_logits(model, prompt_ids + want[:i])[-1].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < MARGIN, f"diverged at token {i} ({got[i]} vs {want[i]}) with margin {margin}"


@pytest.fixture(scope="module")
def prompt_ids(checkpoint):
    """The test prompts as token ids."""
    return [checkpoint.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(model, checkpoint, prompt_ids):
    """Greedy tokens of each prompt run alone: one slot, a budget that never chunks."""
    out = []
    for ids in prompt_ids:
        eng = LLMEngine(model, checkpoint.tokenizer, scheduler=engine_config(4096, 1, 256))
        eng.add_request(0, ids, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
        out.append(toks)
    return out


def test_alone_matches_known_continuation(alone):
    """The first prompt's greedy continuation is " Paris.\\n\\nThe answer" (token ids from llama.cpp's
    vocabulary, also produced by transformers on these weights)."""
    assert alone[0] == [7042, 30, 198, 198, 504, 2988]


@pytest.mark.parametrize("budget", [1, 2, 3, 7, 64], ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("mode", ["slots4_together", "slots2_staggered"])
def test_batched_chunked_equals_alone(make_engine, model, prompt_ids, alone, budget, mode):
    """Every request's greedy tokens are those it gets alone, whatever the budget, slots and arrivals."""
    slots = 4 if mode == "slots4_together" else 2
    eng = make_engine(token_budget=budget, max_seqs=slots, kv_tokens=512)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompt_ids))}
    pending = list(enumerate(prompt_ids))
    step = 0
    chunked = False
    while pending or eng.has_unfinished():
        # Staggered: request k arrives at step 3k, often while others are mid-prefill or decoding.
        while pending and (mode == "slots4_together" or step >= 3 * pending[0][0]):
            rid, ids = pending.pop(0)
            eng.add_request(rid, ids, params)
        for o in eng.step():
            got[o.rid] += o.new_token_ids
        chunked |= any(not c.is_last for c in eng.last_plan.prefills)
        assert eng.last_plan.num_tokens <= budget
        step += 1
    assert chunked == (budget < max(len(p) for p in prompt_ids))
    for i, ids in enumerate(prompt_ids):
        assert_same_or_tied(model, ids, got[i], alone[i])
    assert eng.scheduler.kv_free == eng.scheduler.stats().kv_total
    assert eng.scheduler.stats().num_free_blocks == eng.kv.num_blocks == len(eng.scheduler.free_block_ids())


def test_alone_equals_transformers_generate(hf_model, model, prompt_ids, alone):
    """Each request alone generates what transformers' greedy generate does on the same GGUF weights."""
    m, _ = hf_model
    for ids, want in zip(prompt_ids, alone, strict=True):
        x = torch.tensor([ids])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                             do_sample=False, eos_token_id=None, pad_token_id=2)
        hf = out[0, len(ids):].tolist()
        assert_same_or_tied(model, ids, want, hf)


def test_logits_match_transformers(hf_model, model, prompt_ids):
    """A full pass's logits equal transformers' forward on the same weights within 2e-3 (max abs)."""
    m, _ = hf_model
    ids = prompt_ids[1]
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0]
    ours = full_pass_logits(model, ids)
    assert ref.shape == ours.shape == (len(ids), 49152)
    assert (ours - ref).abs().max().item() < 2e-3


def test_unpermuted_qk_equal_transformers(hf_model, checkpoint):
    """Our Q and K weights, un-permuted from llama.cpp's layout, equal transformers' exactly."""
    _, tensors = hf_model
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight"):
        assert torch.equal(checkpoint.tensors[name], torch.as_tensor(tensors[name]).float()), name


def test_chunked_batched_logits_match_full_pass(model, prompt_ids):
    """Logits of a prompt prefilled in chunks of 7, 7, rest, batched with another request's decodes,
    match one unbatched full pass within 1e-3 (max abs; float32 summation order)."""
    c = model.config
    kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 16, 16, model.dtype, model.device)
    long_ids = prompt_ids[1] + prompt_ids[3] + prompt_ids[0]  # 20+ tokens
    other = prompt_ids[2]
    dev = model.device
    # Blocks 0-3 belong to the long prompt, 8-9 to the other request (non-contiguous on purpose).
    table_a, table_b = [3, 0, 2, 1], [9, 8]
    model.forward(build_flat_batch([BatchEntry(other, 0, table_b)], 16, dev), kv)
    got = []
    pos, other_len = 0, len(other)
    while pos < len(long_ids):
        n = min(7, len(long_ids) - pos)
        batch = build_flat_batch([BatchEntry([5], other_len, table_b, "none"),
                                  BatchEntry(long_ids[pos:pos + n], pos, table_a, "all")], 16, dev)
        got.append(model.forward(batch, kv))
        pos, other_len = pos + n, other_len + 1
    chunked = torch.cat(got)
    full = full_pass_logits(model, long_ids)
    assert chunked.shape == full.shape
    assert (chunked - full).abs().max().item() < 1e-3


def test_paged_scheduler_with_preemption_equals_alone(make_engine, prompt_ids, alone):
    """Under PagedScheduler with a cache of 8 blocks of 4 tokens, requests get preempted and recomputed,
    and every request's greedy tokens are still those it gets alone (no token lost or emitted twice)."""
    from stallfree import PagedScheduler

    sched = PagedScheduler(token_budget=16, max_seqs=4, num_blocks=8, block_size=4, watermark=0.0)
    eng = make_engine(scheduler=sched)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        eng.add_request(i, ids, params)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompt_ids))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.rid] += o.new_token_ids
    assert sched.stats().num_preemptions > 0 and sched.stats().num_recomputed_tokens > 0
    assert [got[i] for i in range(len(prompt_ids))] == alone
    assert sched.stats().num_free_blocks == 8
