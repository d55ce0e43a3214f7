"""Prefix caching in the paged KV policy: hashes, hits at admission, reference counts and eviction,
bad input, and seeded randomized runs under the invariant checker with caching on."""

from __future__ import annotations

import hashlib
import random

import pytest

from factories import drive_randomly
from stallfree import Request, Scheduler
from stallfree.core.errors import InvalidConfig, RequestRejected
from stallfree.core.invariants import InvariantChecker
from stallfree.core.kv import CachingBlockPool
from stallfree.core.prefix_cache import hash_blocks


def cached(budget=64, max_seqs=8, kv_tokens=1024, block_size=16, watermark=0.0, **kw):
    """A paged scheduler with prefix caching on."""
    return Scheduler(budget, max_seqs, kv_tokens, kv_policy="paged", block_size=block_size,
                     watermark=watermark, enable_prefix_caching=True, **kw)


def hashed(rid, tokens, max_new, bs=16, **kw):
    """A Request whose block_hashes come from `tokens`."""
    return Request(rid, len(tokens), max_new, block_hashes=hash_blocks(tokens, bs), **kw)


def run_to_end(s):
    while s.has_unfinished():
        s.complete(s.schedule())


# ---------------------------------------------------------------- hash_blocks


def test_hash_blocks_matches_an_independent_sha256_chain():
    """Two full blocks of 4 tokens (the partial third has no hash), each the first 16 bytes of SHA-256 over
    the parent's 16 bytes and the block's tokens as 8-byte little-endian signed integers."""
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    parent = bytes(16)
    want = []
    for blk in ([1, 2, 3, 4], [5, 6, 7, 8]):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in blk)).digest()[:16]
        want.append(int.from_bytes(parent, "little"))
    assert hash_blocks(toks, 4) == tuple(want)
    assert hash_blocks(toks[:3], 4) == ()


def test_hash_blocks_chains_the_prefix():
    """Equal blocks after different prefixes hash differently; equal prefixes hash equally."""
    a = hash_blocks([1, 1, 2, 2], 2)
    b = hash_blocks([3, 3, 2, 2], 2)
    assert a[1] != b[1]
    assert hash_blocks([1, 1, 2, 2, 9, 9], 2)[:2] == a


@pytest.mark.parametrize("tokens", [[1, 2.0], [1, True], [1, 2**63]])
def test_hash_blocks_rejects_bad_token_ids(tokens):
    """A token id that is not a 64-bit integer is named by position."""
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        hash_blocks(tokens, 2)


# ---------------------------------------------------------------- hits at admission


def test_second_request_hits_the_first_ones_full_blocks():
    """40-token prompt, blocks of 16: two full blocks cached; the same prompt again computes 40 - 32 = 8."""
    s = cached()
    toks = list(range(40))
    s.add(hashed(1, toks, 3))
    s.complete(s.schedule())
    s.add(hashed(2, toks, 3))
    plan = s.schedule()
    assert [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills] == [(2, 8, 32, True)]
    assert s.block_table(2)[:2] == s.block_table(1)[:2]
    assert s.block_table(2)[2] != s.block_table(1)[2]
    s.complete(plan)
    assert (s.stats().prefix_cache_queries, s.stats().prefix_cache_hits, s.num_cached_tokens(2)) == (80, 32, 32)
    assert s.request_state(2).num_prefilled == 40


def test_fully_cached_prompt_still_computes_its_last_token_block():
    """32 tokens = 2 full blocks, both cached: the hit stops at 1 block so the last 16 are computed
    (the last token must be computed to sample; the hit is whole blocks)."""
    s = cached()
    toks = list(range(32))
    s.add(hashed(1, toks, 2))
    run_to_end(s)
    s.add(hashed(2, toks, 2))
    plan = s.schedule()
    assert [(c.num_tokens, c.start) for c in plan.prefills] == [(16, 16)]


def test_hit_ending_exactly_on_a_block_boundary():
    """A 48-token prompt sharing exactly the first 32 tokens of a 40-token one hits 2 blocks, computes 16."""
    s = cached()
    s.add(hashed(1, list(range(40)), 2))
    run_to_end(s)
    s.add(hashed(2, list(range(32)) + [99] * 16, 2))
    plan = s.schedule()
    assert [(c.num_tokens, c.start) for c in plan.prefills] == [(16, 32)]


def test_blocks_of_a_prompt_still_prefilling_are_reusable_after_their_chunk():
    """Budget 16: request 1 (64 tokens) prefills a block per step; request 2 with the same prompt, added
    after two chunks, hits those 2 blocks (admission waits behind the partial prefill, so it is admitted
    when request 1's last chunk has run)."""
    s = cached(budget=16)
    toks = list(range(64))
    s.add(hashed(1, toks, 2))
    s.complete(s.schedule())
    s.complete(s.schedule())
    assert s.stats().prefix_cache_hits == 0
    s.add(hashed(2, toks, 2))
    s.complete(s.schedule())  # chunk 3 of request 1
    plan = s.schedule()  # chunk 4 of request 1 uses the budget
    s.complete(plan)
    plan = s.schedule()
    admitted = [(c.rid, c.start) for c in plan.prefills]
    assert admitted == [(2, 48)]


def test_evictable_blocks_count_as_free_and_lru_tail_goes_first():
    """4 blocks of 4: request 1 (8 tokens) caches 2 blocks and finishes: both evictable, all 4 free.
    A request of 12 other tokens takes the 2 empty blocks and then evicts request 1's tail block (its
    second) first, so request 1's first block is still cached."""
    s = cached(budget=16, kv_tokens=16, block_size=4)
    s.add(hashed(1, list(range(8)), 1, bs=4))
    run_to_end(s)
    assert (s.stats().num_free_blocks, s.stats().num_evictable_blocks, s.stats().num_used_blocks) == (4, 2, 0)
    s.add(hashed(2, list(range(100, 112)), 1, bs=4))
    s.complete(s.schedule())
    assert s.stats().num_evictions == 1
    cache = s._kv.cache
    h1 = hash_blocks(list(range(8)), 4)
    assert cache.cached_block(h1[0]) is not None and cache.cached_block(h1[1]) is None


def test_same_block_filled_twice_in_one_step_keeps_the_first_in_plan_order():
    """Two requests with the same prompt admitted in one step both compute block 0; the copy of the one
    earlier in the plan (request 1) stays cached, request 2's is private and goes back free at its end."""
    s = cached(budget=64)
    toks = list(range(20))
    s.add(hashed(1, toks, 1))
    s.add(hashed(2, toks, 1))
    s.schedule()
    plan = s._inflight
    b1, b2 = s.block_table(1)[0], s.block_table(2)[0]
    s.complete(plan)
    cache = s._kv.cache
    assert cache.cached_block(hash_blocks(toks, 16)[0]) == b1
    assert cache.hash_of(b2) is None
    assert (s.stats().num_evictable_blocks, s.stats().num_free_blocks) == (1, 64)


@pytest.mark.parametrize("checked", [True, False])
def test_preempted_request_hits_its_own_blocks_on_readmission(checked):
    """6 blocks of 4, budget 32. Step 0: request 1 (prompt 8) takes 2 blocks, request 2 (prompt 9) 3, and
    each caches its full prompt blocks. Step 4: request 1 needs its 6th... block while none is free, so
    request 2 (the newest) is preempted: its 2 cached blocks become evictable, its third goes free.
    Step 9: request 1 takes one more and evicts request 2's tail block (block 1 of its prefix) first.
    Step 12, request 1 done: request 2 is readmitted, hits its own first block (4 tokens) and
    recomputes 9 + 4 generated - 4 = 9 tokens from token 4. The same without the checker: the block of
    step 9 is promised, never given its id (no table is read), yet its eviction happens in step 9."""
    s = cached(budget=32, max_seqs=4, kv_tokens=24, block_size=4)
    chk = InvariantChecker(s) if checked else s
    chk.add(hashed(1, list(range(8)), 12, bs=4))
    chk.add(hashed(2, list(range(50, 59)), 8, bs=4))
    seen = {}
    while s.has_unfinished():
        plan = chk.schedule()
        seen[plan.step] = ([(c.rid, c.num_tokens, c.start) for c in plan.prefills], plan.preempted,
                           s.stats().num_evictable_blocks)
        chk.complete(plan)
    if checked:
        chk.check_final()
    assert seen[4][1] == (2,) and seen[4][2] == 2
    assert seen[9][2] == 1 and s.stats().num_evictions >= 1
    assert seen[12][0] == [(2, 9, 4)]
    assert (s.stats().prefix_cache_hits, s.stats().prefix_cache_queries) == (4, 8 + 9 + 13)


# ---------------------------------------------------------------- bad input


def test_hashes_to_a_scheduler_without_caching_name_the_option_and_change_nothing():
    """Reserve and paged-without-caching refuse a request with block_hashes; nothing is queued."""
    for s in (Scheduler(16, 4, 256), Scheduler(16, 4, 256, kv_policy="paged", block_size=4)):
        with pytest.raises(RequestRejected, match="enable_prefix_caching=True"):
            s.add(Request(1, 8, 2, block_hashes=(1, 2)))
        assert s.num_waiting == 0 and not s.has_unfinished()
        s.add(Request(1, 8, 2))  # the rid is still free


@pytest.mark.parametrize("n", [0, 1, 3])
def test_wrong_number_of_hashes_is_named_and_changes_nothing(n):
    """A 40-token prompt with blocks of 16 needs exactly 2 hashes."""
    s = cached()
    with pytest.raises(RequestRejected, match=rf"block_hashes has {n} hashes.*40 // 16 = 2"):
        s.add(Request(1, 40, 2, block_hashes=tuple(range(n))))
    assert s.num_waiting == 0


@pytest.mark.parametrize("bad", ["ab", b"ab", 5, ([1],)])
def test_request_rejects_bad_block_hashes(bad):
    """A string, bytes, a non-sequence or an unhashable element is named."""
    with pytest.raises(RequestRejected, match="block_hashes"):
        Request(1, 8, 2, block_hashes=bad)


def test_caching_needs_the_paged_policy_and_a_bool():
    """enable_prefix_caching under "reserve", or not a bool, is an InvalidConfig naming it."""
    with pytest.raises(InvalidConfig, match="kv_policy='paged'"):
        Scheduler(16, 4, 256, enable_prefix_caching=True)
    with pytest.raises(InvalidConfig, match="enable_prefix_caching"):
        Scheduler(16, 4, 256, kv_policy="paged", block_size=4, enable_prefix_caching=1)  # type: ignore[arg-type]


def test_request_keeps_block_hashes_as_a_tuple():
    """A list is stored as a tuple (the Request is frozen and hashable)."""
    assert Request(1, 8, 2, block_hashes=[1, 2]).block_hashes == (1, 2)


def test_million_block_pool_allocates_no_object_per_block():
    """A caching pool of 10**6 blocks holds empty maps until used."""
    pool = CachingBlockPool(10**6, 16)
    assert pool.num_free == 10**6 and pool.num_cached == 0 and len(pool._free) == 0


def test_partial_prefills_look_up_hits_and_judge_long_after_them():
    """K = 2, T = 16, L = 1, budget 40, blocks of 16: after a 40-token prompt A has run, a new 40-token
    prompt B (long: 40 > T) takes 16 tokens, then C (A's first 32 tokens + 8 new) hits A's 2 blocks and
    has 8 left to compute, so it is short: admitted beside the long B (without the hit it would be a
    second long prompt and wait) with one 8-token chunk from token 32; the 16 tokens left go back to
    B (16 + 16 = 32 of 40). Next step B's last 8 tokens. Hits: 32 of the 40 + 40 tokens looked up."""
    s = cached(budget=40, max_num_partial_prefills=2, long_prefill_token_threshold=16)
    chk = InvariantChecker(s)
    a = list(range(40))
    chk.add(hashed("a", a, 1))
    while s.has_unfinished():
        chk.complete(chk.schedule())
    queries, hits = s.stats().prefix_cache_queries, s.stats().prefix_cache_hits
    chk.add(hashed("b", list(range(100, 140)), 1))
    chk.add(hashed("c", a[:32] + [7] * 8, 1))
    plan = chk.schedule()
    assert [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills] == [
        ("b", 32, 0, False), ("c", 8, 32, True)]
    assert plan.admitted == ("b", "c")
    chk.complete(plan)
    assert s.num_cached_tokens("b") == 0
    plan = chk.schedule()
    assert [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills] == [("b", 8, 32, True)]
    chk.complete(plan)
    assert (s.stats().prefix_cache_queries - queries, s.stats().prefix_cache_hits - hits) == (80, 32)
    chk.check_final()


def test_promise_counts_evictable_blocks_and_evicts_at_once():
    """A pool of 4 blocks, 3 of them cached and released (evictable), 1 free-and-empty: promising 3 succeeds
    (num_free = 1 + 3) and evicts the least recently released two at once (the promised blocks are
    free-and-empty ones), so that claiming them, whenever a table is read, evicts nothing more; an
    allocation meanwhile leaves the promised blocks alone and evicts the last cached one."""
    pool = CachingBlockPool(4, 2)
    table = []
    pool.allocate(table, 3)
    pool.register(table, ("a", "b", "c"), 0, 3)
    pool.release(table)  # tail first: block 2, then 1, then 0 become evictable
    assert pool.num_free == 4 and pool.evictable_ids() == (2, 1, 0)
    assert pool.try_promise(3) and pool.num_free == 1
    assert pool.num_evictions == 2 and pool.evictable_ids() == (0,) and pool.cached_block("c") is None
    other: list[int] = []
    pool.allocate(other, 1)
    assert other == [0] and pool.num_evictions == 3 and pool.num_cached == 0
    got: list[int] = []
    pool.claim(got, 3)
    assert sorted(got) == [1, 2, 3] and pool.num_evictions == 3
    assert not pool.try_promise(1) and pool.num_promised == 0


# ---------------------------------------------------------------- randomized


def random_cached_run(seed: int, num_requests: int = 30) -> InvariantChecker:
    """One seeded run on a tight cache: prompts are a prefix drawn from a pool of 3 plus a random tail,
    so that hits, evictions and preemptions all happen; aborts and early stops too; one partial
    prefill, or K = 2 or 3 of them (half the runs)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    budget = rng.choice([bs, rng.randint(bs, 32), rng.randint(bs, 256)])
    prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 60))] for _ in range(3)]
    reqs = []
    for i in range(num_requests):
        toks = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(1, 30))]
        reqs.append(Request(i, len(toks), rng.randint(1, 24), block_hashes=hash_blocks(toks, bs)))
    largest = max(-(-(r.prompt_len + r.max_new - 1) // bs) for r in reqs)
    num_blocks = rng.choice([largest, largest + rng.randint(0, largest // 2 + 1), largest * 3])
    k = rng.choice([1, 1, 2, 3])  # partial prefills: one (the contract), or K > 1 with L and T drawn
    partial = {} if k == 1 else {"max_num_partial_prefills": k, "max_long_partial_prefills": rng.randint(1, k),
                                 "long_prefill_token_threshold": rng.choice([bs, 4 * bs, 64])}
    s = Scheduler(budget, rng.randint(1, 8), num_blocks * bs, kv_policy="paged", block_size=bs,
                  watermark=rng.choice([0.0, 0.01, 0.1]), enable_prefix_caching=True,
                  policy=rng.choice(["fcfs", "fcfs", "priority"]), **partial)
    chk = InvariantChecker(s)
    arrive = sorted(rng.randint(0, 60) for _ in reqs)
    p_abort, p_stop = rng.choice([0.0, 0.05]), rng.choice([0.0, 0.05])
    drive_randomly(chk, s, reqs, arrive, rng, p_abort, p_stop)
    return chk


def test_randomized_runs_with_caching_hold_every_invariant(capsys):
    """40 seeded runs keep every invariant (cache rules included); across them hits, evictions and
    preemptions all happen, with one partial prefill and with K > 1 (hits in both)."""
    hits = evictions = preemptions = 0
    multi_hits = 0
    for seed in range(40):
        chk = random_cached_run(seed)
        s = chk.scheduler
        hits += s.stats().prefix_cache_hits
        multi_hits += s.stats().prefix_cache_hits if s.config.max_num_partial_prefills > 1 else 0
        evictions += s.stats().num_evictions
        preemptions += chk.num_preemptions
    with capsys.disabled():
        print(f"\n[prefix caching invariants] 40 runs: {hits} hit tokens, {evictions} evictions, "
              f"{preemptions} preemptions; {multi_hits} hit tokens with K > 1")
    assert hits > 0 and evictions > 0 and preemptions > 0 and 0 < multi_hits < hits


@pytest.mark.pure_python
@pytest.mark.parametrize("fault", ["no_hits", "no_unpin"])
def test_the_checker_catches_a_broken_cache(monkeypatch, fault):
    """A lookup that never hits (chunks start at 0, the shadow says after the hit), or a release that
    forgets to drop a reference (reference count != tables holding the block), is an InvariantViolation."""
    from stallfree.core.invariants import InvariantViolation
    from stallfree.core.kv import PagedKV

    if fault == "no_hits":
        monkeypatch.setattr(PagedKV, "lookup", lambda self, rec: (0, ()))  # never a hit
    else:
        def drop(self, table, keep, hashed):
            self._free.extend(b for b in reversed(table[keep:]) if b not in self._refs)
            del table[keep:]
        monkeypatch.setattr(CachingBlockPool, "_drop", drop)
    s = cached()
    chk = InvariantChecker(s)
    toks = list(range(40))
    with pytest.raises(InvariantViolation):
        chk.add(hashed(1, toks, 2))
        while s.has_unfinished():
            chk.complete(chk.schedule())
        chk.add(hashed(2, toks, 2))
        while s.has_unfinished():
            chk.complete(chk.schedule())
        chk.check_final()


@pytest.mark.pure_python
@pytest.mark.parametrize("fault", ["newest_first", "lookup_short"])
def test_the_checkers_own_cache_view_catches_eviction_and_lookup_faults(monkeypatch, fault):
    """The checker evicts and looks up in its own view of the cache: a pool that evicts the most
    recently released block first, or a lookup that stops one block short, fails the seeded runs."""
    from stallfree.core.invariants import InvariantViolation
    from stallfree.core.kv import PagedKV

    if fault == "newest_first":
        take = CachingBlockPool._take

        def newest_first(self, table, n):
            self._evictable = type(self._evictable)(reversed(self._evictable.items()))
            take(self, table, n)
            self._evictable = type(self._evictable)(reversed(self._evictable.items()))
        monkeypatch.setattr(CachingBlockPool, "_take", newest_first)
    else:
        lookup = PagedKV.lookup

        def short(self, rec):  # one block short of the real hit
            tokens, hits = lookup(self, rec)
            return (tokens - self.block_size, hits[:-1]) if hits else (tokens, hits)

        monkeypatch.setattr(PagedKV, "lookup", short)
    with pytest.raises(InvariantViolation):
        for seed in range(40):
            random_cached_run(seed)


def test_cached_prefix_len_is_a_pure_query_capped_like_admission():
    """After a 40-token prompt (blocks of 16) completes, a request sharing its first 36 tokens finds 2 blocks =
    32 tokens; a 32-token prompt equal to the first two blocks finds only 1 block (16 tokens), since its last
    token must be computed. The query pins nothing: the free count is unchanged."""
    s = cached()
    toks = list(range(40))
    s.add(hashed(1, toks, 1))
    run_to_end(s)
    free = s.kv_free
    assert s.cached_prefix_len(hashed(2, toks[:36] + [99, 98, 97, 96], 3)) == 32
    assert s.cached_prefix_len(hashed(3, toks[:32], 3)) == 16
    assert s.cached_prefix_len(Request(4, 40, 3)) == 0  # no block hashes
    assert s.kv_free == free and not s.has_unfinished()
    plain = Scheduler(64, 8, 1024, kv_policy="paged", block_size=16)
    assert plain.cached_prefix_len(hashed(5, toks, 3)) == 0
