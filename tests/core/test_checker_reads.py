"""The invariant checker only reads: the same seeded run, driven through a bare Scheduler and through an
InvariantChecker around one, gives the same plans, counters and free block ids at every step.

With prefix caching a read that handed out a decode's promised block ids (block_table, free_block_ids)
evicted cached blocks earlier than a run that read no table, so the checked run hit more of the cache
(20 Mooncake requests: 29.6% against 27.5%); and a draft step's promise that no table was owed stayed
counted as used until a read claimed it, so an unchecked run kept KV it never gave back.
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

import pytest

from stallfree import Request, Scheduler
from stallfree.core.invariants import InvariantChecker
from stallfree.core.prefix_cache import hash_blocks
from stallfree.core.queries import peek_free_block_ids
from stallfree.core.request import RequestStatus


def _workload(seed: int, caching: bool) -> tuple[dict[str, Any], list[Request], list[int], random.Random]:
    """A seeded run on a tight pool: prompts share one of 3 prefixes (hits), the pool holds 1-3 of the
    largest requests (evictions, preemptions)."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 60))] for _ in range(3)]
    reqs = []
    for i in range(30):
        toks = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(1, 30))]
        reqs.append(Request(i, len(toks), rng.randint(1, 24),
                            block_hashes=hash_blocks(toks, bs) if caching else None))
    largest = max(-(-(r.prompt_len + r.max_new - 1) // bs) for r in reqs)
    config = {"token_budget": rng.choice([bs, rng.randint(bs, 32), rng.randint(bs, 256)]),
              "max_seqs": rng.randint(1, 8), "kv_tokens": rng.choice([largest, largest * 2, largest * 3]) * bs,
              "kv_policy": "paged", "block_size": bs, "enable_prefix_caching": caching}
    return config, reqs, sorted(rng.randint(0, 60) for _ in reqs), rng


def _run(seed: int, caching: bool, drafts: bool, checked: bool) -> tuple[list[Any], dict[str, Any]]:
    """Drive the seeded run (drafts: random draft tokens, verdicts a step late, some rejected); return each
    step's plan and figures, and the final stats."""
    config, reqs, arrive, rng = _workload(seed, caching)
    s = Scheduler(**config)
    face: Any = InvariantChecker(s) if checked else s
    rows: list[Any] = []
    i = 0
    late: list[Any] = []
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrive[i] <= s.step:
            face.add(reqs[i])
            i += 1
        if drafts:
            for rid in list(s._live):
                if s.request_state(rid).status is RequestStatus.DECODING and rng.random() < 0.7:
                    face.set_draft_tokens(rid, rng.randint(0, 4))
        plan = face.schedule()
        face.complete(plan)
        for rid in late:
            if rid in s._live and s.unsettled_drafts(rid):
                face.take_back(rid, rng.randint(0, s.unsettled_drafts(rid)[0]))
        late = [c.rid for c in plan.decodes if c.num_tokens > 1]
        st = s.stats()
        rows.append((plan.step, [(c.rid, c.num_tokens, c.start, c.is_last) for c in plan.prefills],
                     plan.decode_rids, plan.decode_tokens, plan.admitted, plan.preempted, st.num_evictions,
                     st.prefix_cache_hits, st.num_free_blocks, peek_free_block_ids(s)))
        assert len(rows) < 5000
    if checked:
        face.check_final()
    assert s.kv_free == s.stats().kv_total  # all KV came back, checked or not
    st = s.stats()
    return rows, {f.name: getattr(st, f.name) for f in fields(st)}


@pytest.mark.parametrize("caching, drafts", [(True, False), (True, True), (False, True)])
def test_a_checked_run_is_the_unchecked_run(caching, drafts):
    """20 seeded runs per option: every step's plan, evictions, hits, free blocks and free ids, and the final
    stats, are the same with the checker as without it; across them the cache hits and evicts."""
    hits = evictions = 0
    for seed in range(20):
        bare, bare_stats = _run(seed, caching, drafts, checked=False)
        checked, checked_stats = _run(seed, caching, drafts, checked=True)
        for a, b in zip(bare, checked, strict=True):
            assert a == b, f"seed {seed}, step {a[0]}"
        assert bare_stats == checked_stats, f"seed {seed}"
        hits += bare_stats["prefix_cache_hits"]
        evictions += bare_stats["num_evictions"]
    assert (hits > 0 and evictions > 0) == caching
