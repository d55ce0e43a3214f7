"""The engine with a CPU KV tier: greedy outputs are the same with the tier on and off (and with caching
off), while blocks the GPU cache evicted are loaded back from the tier; the host copies by hand."""

from __future__ import annotations

import pytest
import torch

from factories import run_engine
from stallfree.core.errors import InvalidConfig
from stallfree.engine.kv_cache import HostKVCache, KVCache
from stallfree.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = list(range(100, 164))  # 64 tokens: 4 blocks of 16


def run(eng, schedule, params=GREEDY):
    """schedule: list of (step, rid, token_ids); add each at its step, run to the end; tokens per rid."""
    return run_engine(eng, schedule, params)


def test_offload_then_load_round_trips_blocks():
    """2 layers, 4 GPU blocks of 2 tokens, 3 CPU blocks: GPU block 1 -> CPU 2 and GPU 3 -> CPU 0, then
    CPU 2 -> GPU 0: GPU block 0 now holds what block 1 held, in every layer, K and V."""
    cache = KVCache(2, 1, 3, 4, 2, torch.float32, torch.device("cpu"))
    cache.k[:, :8] = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 1, 3)
    cache.v[:, :8] = -cache.k[:, :8]
    host = HostKVCache(2, 1, 3, 3, 2, torch.float32)
    want_k, want_v = cache.k[:, 2:4].clone(), cache.v[:, 2:4].clone()
    host.offload(cache, ((1, 2), (3, 0)))
    assert torch.equal(host.k[:, 2], want_k) and torch.equal(host.v[:, 0], cache.v[:, 6:8])
    host.load(cache, ((2, 0),))
    assert torch.equal(cache.k[:, 0:2], want_k) and torch.equal(cache.v[:, 0:2], want_v)
    assert host.nbytes == 2 * 2 * 3 * 2 * 1 * 3 * 4


@pytest.mark.slow
def test_tier_on_and_off_give_the_same_greedy_outputs_and_hits_after_an_eviction(make_engine):
    """8 GPU blocks of 16. 'a' (SYSTEM + 3, 4 full blocks) caches them; 'c' (100 tokens, 7 blocks)
    evicts 3 of them (tail first) into the CPU tier of 16 blocks; 'b' (= a) then hits block 0 on the
    GPU and blocks 1-3 in the CPU tier: 64 tokens, 48 of them loaded (3 blocks). Outputs equal those
    with caching off and with GPU-only caching (which hits 16 tokens only)."""
    p = SYSTEM + [5, 6, 7]
    sched = [(0, "a", p), (12, "c", list(range(300, 400))), (24, "b", p)]
    kw = dict(kv_policy="paged", block_size=16, kv_tokens=16 * 8)
    off = run(make_engine(**kw), sched)
    gpu = make_engine(**kw, enable_prefix_caching=True)
    on_gpu = run(gpu, sched)
    tier = make_engine(**kw, enable_prefix_caching=True, cpu_kv_tokens=16 * 16)
    on_tier = run(tier, sched)
    assert on_tier == off == on_gpu and on_tier["a"] == on_tier["b"]
    assert gpu.scheduler.stats().prefix_cache_hits == 16
    st = tier.stats()
    assert tier.scheduler.stats().prefix_cache_hits == 64 and st.prefix_cache_cpu_hits == 48
    assert st.kv_blocks_loaded == 3 and st.kv_blocks_offloaded >= 3


def test_cpu_tier_needs_paged_caching_and_a_block():
    """Checked before the checkpoint loads."""
    from stallfree.engine import LLMEngine

    with pytest.raises(InvalidConfig, match="enable_prefix_caching=True"):
        LLMEngine.from_pretrained(kv_policy="paged", cpu_kv_tokens=64)
    with pytest.raises(InvalidConfig, match="no block"):
        LLMEngine.from_pretrained(kv_policy="paged", enable_prefix_caching=True, cpu_kv_tokens=8, block_size=16)
    with pytest.raises(InvalidConfig, match="cpu_kv_tokens"):
        LLMEngine.from_pretrained(kv_policy="paged", enable_prefix_caching=True, cpu_kv_tokens=-1)
    with pytest.raises(InvalidConfig, match="kv_offloading_size"):
        LLMEngine.from_pretrained(kv_policy="paged", enable_prefix_caching=True, kv_offloading_size=0)
    with pytest.raises(InvalidConfig, match="give one"):
        LLMEngine.from_pretrained(kv_policy="paged", enable_prefix_caching=True, cpu_kv_tokens=64,
                                  kv_offloading_size=1)
