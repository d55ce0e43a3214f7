"""The CPU KV tier (core/kv_tier.py): offloads on eviction, hits across both tiers, loads in the plan,
the LRU of the CPU tier, bad input, and seeded randomized runs under the tier's checker with preemption."""

from __future__ import annotations

import random

import pytest

from factories import drive_randomly
from stallfree import Request, Scheduler
from stallfree.core.errors import InvalidConfig
from stallfree.core.invariants import InvariantViolation
from stallfree.core.invariants_tier import TieredInvariantChecker
from stallfree.core.kv_tier import CpuTier, TieredKV
from stallfree.core.prefix_cache import hash_blocks


def tiered(budget: int, seqs: int, kv_tokens: int, bs: int, cpu_blocks: int, **options: object) -> Scheduler:
    """A paged, caching Scheduler whose config has a CPU tier of cpu_blocks blocks (its manager a TieredKV)."""
    return Scheduler(budget, seqs, kv_tokens, kv_policy="paged", block_size=bs, enable_prefix_caching=True,
                     cpu_kv_tokens=cpu_blocks * bs if not isinstance(cpu_blocks, bool) else cpu_blocks, **options)

def run_to_end(s):
    plans = []
    while s.has_unfinished():
        p = s.schedule()
        plans.append(p)
        s.complete(p)
    return plans


def test_evicted_blocks_move_to_the_cpu_tier_and_load_back_on_a_hit():
    """4 GPU blocks of 4 tokens, 8 CPU blocks. 'a' (13 tokens, hashes x y z) fills GPU 0-2; 'b' evicts
    them (tail first: z, y, x to CPU 0, 1, 2). 'c' (= 'a') hits all three in the CPU tier: 12 tokens,
    one token computed, three loads, and b's three cached blocks offloaded first."""
    s = tiered(64, 8, 16, 4, cpu_blocks=8)
    kv = s.kv_manager
    assert isinstance(kv, TieredKV)
    s.add(Request("a", 13, 2, block_hashes=("x", "y", "z")))
    assert all(p.kv_offloads == () and p.kv_loads == () for p in run_to_end(s))
    s.add(Request("b", 13, 2, block_hashes=("p", "q", "r")))
    plans = run_to_end(s)
    assert plans[0].kv_offloads == ((2, 0), (1, 1), (0, 2)) and plans[0].kv_loads == ()
    assert dict(kv.tier_view().block_of) == {"z": 0, "y": 1, "x": 2}
    s.add(Request("c", 13, 2, block_hashes=("x", "y", "z")))
    plans = run_to_end(s)
    first = plans[0]
    assert [(c.rid, c.start, c.num_tokens) for c in first.prefills] == [("c", 12, 1)]
    # b's blocks 1, 2, 3 go to fresh CPU blocks 3, 4, 5 (0-2 are busy with the loads); x y z load
    # into GPU 0 (free), 1 and 2 (just offloaded).
    assert first.kv_offloads == ((1, 3), (2, 4), (3, 5))
    assert first.kv_loads == ((2, 0), (1, 1), (0, 2))
    assert s.stats().prefix_cache_hits == 12 and kv.tier_stats.cpu_hits == 12 and kv.tier_stats.gpu_hits == 0
    assert dict(kv.tier_view().block_of) == {"r": 3, "q": 4, "p": 5}


def test_the_cpu_tier_drops_its_least_recently_stored_block_when_full():
    t = CpuTier(2)
    assert (t.store("a"), t.store("b"), t.store("c")) == (0, 1, 0)
    assert t.get("a") is None and t.num_drops == 1 and dict(t._lru) == {"b": 1, "c": 0}
    assert t.take("b") == 1 and t.num_free == 0  # busy until the step ends
    assert t.store("d") == 0 and t.get("c") is None  # the busy block is not reused in the same step
    t.end_step()
    assert t.num_free == 1 and t.store("e") == 1


def test_a_hash_computed_again_on_the_gpu_leaves_the_cpu_tier():
    """Tiers are exclusive: 'b' computes block x while x sits in the CPU tier (it was admitted
    before x was cached); registering it on the GPU drops the CPU copy."""
    kv = TieredKV(8, 4, 0.0, 4)
    kv.tier.store("x")
    table = [5]
    kv.cache._take(table, 0)
    kv.cache.register(table, ("x",), 0, 1)
    assert kv.tier.get("x") is None and kv.cache.cached_block("x") == 5 and kv.tier.num_free == 4


def test_lookup_spans_both_tiers_and_admission_counts_a_load_as_a_block():
    """3 GPU blocks of 4 tokens. GPU block 0 holds x (evictable), the CPU tier y: c's hit is both
    blocks (8 tokens). Admitting c needs x pinned (1, it is evictable), a block for y's load (1) and
    one for its first chunk (1): 3. While 'hog' holds a block only 2 are free, so c waits, and
    nothing changes; then it is admitted with one load, from CPU block 0."""
    s = tiered(64, 8, 12, 4, cpu_blocks=4, watermark=0.0)
    kv = s.kv_manager
    assert isinstance(kv, TieredKV)
    s.add(Request("a", 5, 1, block_hashes=("x",)))
    run_to_end(s)
    kv.tier.store("y")
    req = Request("c", 9, 1, block_hashes=("x", "y"))
    assert s.cached_prefix_len(req) == 8
    s.add(Request("hog", 2, 2))
    s.complete(s.schedule())
    s.add(req)
    plan = s.schedule()
    assert plan.admitted == () and kv.tier.get("y") == 0 and plan.kv_loads == ()
    s.complete(plan)
    plans = run_to_end(s)
    first = next(p for p in plans if p.admitted == ("c",))
    assert len(first.kv_loads) == 1 and first.kv_loads[0][0] == 0 and first.kv_loads[0][1] != 0
    assert [(c.start, c.num_tokens) for c in first.prefills] == [(8, 1)]
    assert kv.tier_stats.first_cpu_hits == 4 and kv.tier_stats.first_gpu_hits == 4
    assert kv.tier.get("y") is None and s.prefix_cache.cached_block("y") == first.kv_loads[0][1]


def test_bad_tier_sizes_are_named():
    with pytest.raises(InvalidConfig, match="cpu_blocks"):
        TieredKV(8, 4, 0.0, 0)
    with pytest.raises(InvalidConfig, match="cpu_kv_tokens"):
        tiered(64, 8, 16, 4, cpu_blocks=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="cpu_kv_tokens=2 holds no block of block_size=4"):
        Scheduler(64, 8, 16, kv_policy="paged", block_size=4, enable_prefix_caching=True, cpu_kv_tokens=2)
    with pytest.raises(InvalidConfig, match="needs kv_policy='paged' and enable_prefix_caching=True"):
        Scheduler(64, 8, 16, kv_policy="paged", block_size=4, cpu_kv_tokens=8)


# ---------------------------------------------------------------- randomized


def random_tiered_run(seed: int, num_requests: int = 24) -> TieredInvariantChecker:
    """One seeded run on a tight GPU cache and a small CPU tier: prompts share one of 3 prefixes,
    so hits in both tiers, offloads, drops, loads and preemptions all happen; aborts and stops too."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    budget = rng.choice([bs, rng.randint(bs, 32), rng.randint(bs, 128)])
    prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 40))] for _ in range(3)]
    reqs = []
    for i in range(num_requests):
        toks = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(1, 20))]
        reqs.append(Request(i, len(toks), rng.randint(1, 16), block_hashes=hash_blocks(toks, bs)))
    largest = max(-(-(r.prompt_len + r.max_new - 1) // bs) for r in reqs)
    num_blocks = rng.choice([largest, largest + rng.randint(0, largest // 2 + 1), largest * 2])
    s = tiered(budget, rng.randint(1, 6), num_blocks * bs, bs, rng.choice([1, 3, largest, 4 * largest]),
               watermark=rng.choice([0.0, 0.01, 0.1]), policy=rng.choice(["fcfs", "fcfs", "priority"]))
    chk = TieredInvariantChecker(s)
    arrive = sorted(rng.randint(0, 40) for _ in reqs)
    p_abort, p_stop = rng.choice([0.0, 0.05]), rng.choice([0.0, 0.05])
    drive_randomly(chk, s, reqs, arrive, rng, p_abort, p_stop)
    return chk


@pytest.mark.parametrize("seeds", [range(6), pytest.param(range(6, 60), marks=pytest.mark.slow)])
def test_randomized_runs_with_the_tier_hold_every_invariant(capsys, seeds):
    """Seeded runs keep every invariant (the base checker's and the tier's); across them CPU hits,
    loads, offloads, CPU drops and preemptions all happen."""
    cpu_hits = loads = offloads = drops = preemptions = 0
    for seed in seeds:
        chk = random_tiered_run(seed)
        kv = chk.scheduler.kv_manager
        assert isinstance(kv, TieredKV)
        cpu_hits += kv.tier_stats.cpu_hits
        loads += kv.tier.num_loads
        offloads += kv.tier.num_stores
        drops += kv.tier.num_drops
        preemptions += chk.num_preemptions
    with capsys.disabled():
        print(f"\n[tier invariants] {len(seeds)} runs: {cpu_hits} CPU hit tokens, {loads} loads, {offloads} offloads, "
              f"{drops} drops, {preemptions} preemptions")
    assert cpu_hits > 0 and loads > 0 and offloads > 0 and drops > 0 and preemptions > 0


@pytest.mark.pure_python
@pytest.mark.parametrize("fault", ["no_cpu_hits", "no_offload", "mru_drop"])
def test_the_tier_checker_catches_a_broken_tier(monkeypatch, fault):
    """A lookup that ignores the CPU tier, an eviction that forgets its offload, or a CPU tier that
    drops its most recent block fails the seeded runs."""
    from stallfree.core import kv_tier

    if fault == "no_cpu_hits":
        monkeypatch.setattr(kv_tier.TieredKV, "_hits", lambda self, hashes, m: self.cache.lookup(hashes, m))
    elif fault == "no_offload":
        store = kv_tier.CpuTier.store

        def lost(self, h):
            c = store(self, h)
            return None if c == 0 else c
        monkeypatch.setattr(kv_tier.CpuTier, "store", lost)
    else:
        def mru(self, h):
            if len(self._lru) + len(self._busy) >= self.num_blocks and self._lru:
                c = self._lru.popitem(last=True)[1]
                self._lru[h] = c
                return c
            return kv_tier.CpuTier.__dict__["_store_orig"](self, h)
        monkeypatch.setattr(kv_tier.CpuTier, "_store_orig", kv_tier.CpuTier.store, raising=False)
        monkeypatch.setattr(kv_tier.CpuTier, "store", mru)
    with pytest.raises(InvariantViolation):
        for seed in range(6):
            random_tiered_run(seed)
