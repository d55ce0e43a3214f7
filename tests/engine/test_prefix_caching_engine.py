"""The engine with prefix caching: greedy outputs are the same with caching on and off, while the
scheduler reports hits (so the cached KV blocks really were read instead of recomputed)."""

from __future__ import annotations

import pytest

from factories import run_engine
from stallfree.core.errors import InvalidConfig
from stallfree.engine.sampling import SamplingParams

# Real-model runs with caching on and off, compared token for token.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run(eng, schedule, params=GREEDY):
    """schedule: list of (step, rid, token_ids); add each at its step, run to the end; tokens per rid."""
    return run_engine(eng, schedule, params)


def both(make_engine, schedule, params=GREEDY, **kw):
    """Outputs with caching off and on (paged, blocks of 16), and the caching engine's hit tokens."""
    off = run(make_engine(kv_policy="paged", block_size=16, **kw), schedule, params)
    eng = make_engine(kv_policy="paged", block_size=16, enable_prefix_caching=True, **kw)
    on = run(eng, schedule, params)
    both.last = eng  # type: ignore[attr-defined]
    return off, on, eng.scheduler.stats().prefix_cache_hits


SYSTEM = list(range(100, 164))  # 64 tokens: 4 blocks


def test_same_prompt_twice(make_engine):
    """The second copy (67 tokens, 4 full blocks), added after the first finished, hits all 4 blocks
    (64 tokens; 3 are left to compute) and generates the same tokens."""
    p = SYSTEM + [5, 6, 7]
    off, on, hits = both(make_engine, [(0, "a", p), (12, "b", p)])
    assert on == off and on["a"] == on["b"]
    assert hits == 64


def test_shared_system_prompt_at_different_steps(make_engine):
    """Two prompts sharing 64 tokens of system prompt, the second added 3 steps later."""
    off, on, hits = both(make_engine, [(0, "a", SYSTEM + [1, 2, 3, 4]), (3, "b", SYSTEM + [9, 8, 7])])
    assert on == off
    assert hits == 64


def test_hit_ending_exactly_on_a_block_boundary(make_engine):
    """The second prompt shares exactly the first 32 tokens (2 blocks) and then differs."""
    off, on, hits = both(make_engine, [(0, "a", SYSTEM), (12, "b", SYSTEM[:32] + [7] * 20)])
    assert on == off
    assert hits == 32


def test_prompt_entirely_cached_but_its_last_token(make_engine):
    """A 65-token prompt whose first 64 are cached: only the last token is computed."""
    off, on, hits = both(make_engine, [(0, "a", SYSTEM + [1, 2]), (12, "b", SYSTEM + [1])])
    assert on == off
    assert hits == 64


def test_hit_after_preemption(make_engine):
    """A cache of 8 blocks of 16, budget 64: two requests sharing the 4-block system prompt, 79 tokens
    each and 24 new tokens (7 blocks each alone, 10 shared), so a decode finds no block and the newer
    request is preempted; readmitted it hits the shared blocks again, outputs unchanged."""
    sched = [(0, "a", SYSTEM + [1] * 15), (0, "b", SYSTEM + [2] * 15)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off, on, hits = both(make_engine, sched, params, kv_tokens=16 * 8)
    assert on == off
    assert both.last.scheduler.stats().num_preemptions >= 1  # type: ignore[attr-defined]
    assert hits >= 64


def test_caching_needs_the_paged_policy(make_engine):
    """enable_prefix_caching=True under the reservation policy is an InvalidConfig naming it."""
    with pytest.raises(InvalidConfig, match="kv_policy='paged'"):
        make_engine(enable_prefix_caching=True)


def test_cache_salt_keeps_prefixes_apart(make_engine):
    """Issue 37: the same 64-token prompt sent after one salted "a" is a 48-token hit (3 blocks; the
    last block is recomputed for its token) with salt "a", 0 with salt "b" or none; salted outputs equal
    the unsalted ones; salt_block_hashes is deterministic and changes every hash."""
    from stallfree.core.prefix_cache import hash_blocks
    from stallfree.engine.engine import salt_block_hashes

    plain = hash_blocks(SYSTEM, 16)
    assert salt_block_hashes(plain, "a") == salt_block_hashes(plain, "a")
    assert not set(salt_block_hashes(plain, "a")) & (set(plain) | set(salt_block_hashes(plain, "b")))
    eng = make_engine(kv_policy="paged", block_size=16, enable_prefix_caching=True)
    got = {}
    for rid, salt in (("first", "a"), ("same", "a"), ("other", "b"), ("none", None)):
        eng.add_request(rid, SYSTEM, GREEDY, cache_salt=salt)
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                toks.extend(o.new_token_ids)
                last = o
        got[rid] = (last.num_cached_tokens, toks)
    assert {r: c for r, (c, _) in got.items()} == {"first": 0, "same": 48, "other": 0, "none": 0}
    assert len({tuple(t) for _, t in got.values()}) == 1
    with pytest.raises(ValueError, match="cache_salt"):
        eng.add_request("empty", SYSTEM, GREEDY, cache_salt="")
    assert not eng.has_unfinished()
