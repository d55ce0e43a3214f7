"""SchedulerConfig (one place for every option) and the core's queries: stats(), headroom(), would_wait()."""

from __future__ import annotations

import dataclasses
import random

import pytest

from stallfree import InvalidConfig, Request, Scheduler
from stallfree.core import SchedulerConfig, SchedulerStats
from stallfree.core.prefix_cache import hash_blocks


def _plans(s: Scheduler, reqs: list[Request], steps: int) -> list[tuple]:
    for r in reqs:
        s.add(r)
    out = []
    for _ in range(steps):
        plan = s.schedule()
        out.append(tuple((c.rid, c.num_tokens, c.is_prefill) for c in plan))
        s.complete(plan)
    return out


def test_config_and_keyword_forms_build_the_same_scheduler():
    """Scheduler(SchedulerConfig(...)) plans exactly as Scheduler(... keywords ...), and keeps the config."""
    kw = {"kv_policy": "paged", "block_size": 4, "policy": "priority", "max_num_partial_prefills": 2,
          "long_prefill_token_threshold": 8}
    cfg = SchedulerConfig(16, 3, 64, **kw)
    reqs = [Request(i, 5 + 7 * i, 4, priority=i % 2) for i in range(5)]
    a = Scheduler(cfg)
    b = Scheduler(16, 3, 64, **kw)
    assert a.config == b.config == cfg
    assert _plans(a, reqs, 30) == _plans(b, [dataclasses.replace(r) for r in reqs], 30)
    st = a.stats()
    assert (st.num_blocks, st.watermark_blocks, a.config.chunks_aligned, a.config.partial_prefill_limits[1]) == (
        16, 0, False, 1)


def test_config_is_frozen_and_checked_in_one_place():
    """A bad field raises InvalidConfig naming it and its value, from the config as from the keywords; a
    config with other options is refused; replace() checks again."""
    for bad, word in (({"max_seqs": 0}, "max_seqs must be an integer >= 1, got 0"),
                      ({"watermark": 1.5}, "watermark must be a number in [0, 1), got 1.5"),
                      ({"kv_policy": "lru"}, "kv_policy must be 'reserve' or 'paged', got 'lru'")):
        args = {"token_budget": 8, "max_seqs": 2, "kv_tokens": 64, **bad}
        with pytest.raises(InvalidConfig, match=word.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            SchedulerConfig(**args)
        with pytest.raises(InvalidConfig, match="must be"):
            Scheduler(**args)
    cfg = SchedulerConfig(8, 2, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_seqs = 3  # type: ignore[misc]
    with pytest.raises(InvalidConfig, match="takes no other options"):
        Scheduler(cfg, 2)
    with pytest.raises(InvalidConfig, match="enable_prefix_caching=True needs kv_policy='paged'"):
        cfg.replace(enable_prefix_caching=True)
    assert cfg.replace(max_seqs=5).max_seqs == 5 and cfg.max_seqs == 2


def test_stats_by_hand_under_paged_caching():
    """Blocks of 4, 16 blocks, watermark 0: a 9-token prompt (2 full hashed blocks) runs a step of budget 8
    (2 blocks held); its twin arrives after it finished and hits its 2 cached blocks (8 tokens capped at
    prompt_len - 1 = 8), and once it finishes too the 2 blocks are evictable again."""
    s = Scheduler(8, 4, 64, kv_policy="paged", block_size=4, watermark=0.0, enable_prefix_caching=True)
    h = hash_blocks(list(range(9)), 4)
    s.add(Request("a", 9, 1, block_hashes=h))
    s.complete(s.schedule())
    st = s.stats()
    assert isinstance(st, SchedulerStats)
    assert (st.num_running, st.num_waiting, st.num_used_blocks, st.num_free_blocks, st.kv_free) == (1, 0, 2, 14, 56)
    s.complete(s.schedule())  # the last token: "a" finishes, its 2 full blocks stay cached
    s.add(Request("b", 9, 1, block_hashes=h))
    s.complete(s.schedule())  # "b" computes its last token only, samples its one token and finishes
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.num_evictable_blocks) == (18, 8, 2)
    assert (st.enable_prefix_caching, st.block_size, st.num_preemptions) == (True, 4, 0)


def test_would_wait_and_headroom_by_hand():
    """Budget 8, max_seqs 2, one decode running: the next step has 7 tokens for prompts. Of a 5-token and a
    3-token prompt the first is admitted whole (2 left), the second takes 2 tokens and runs too; a third
    finds no slot. Under priority an urgent third takes the first's slot, and the first waits."""
    s = Scheduler(8, 2, 1000, policy="priority")
    s.add(Request("run", 1, 50))
    s.complete(s.schedule())
    new = [Request("x", 5, 4, priority=1), Request("y", 3, 4, priority=1), Request("z", 2, 4, priority=0)]
    assert s.would_wait(new[:2]) == 1  # one slot is left: "y" waits
    assert s.would_wait(new) == 2  # "z" (more urgent) takes the slot, "x" and "y" wait
    h = s.headroom(new[:1])
    assert (h.will_wait, h.slots, h.budget_tokens, h.num_tokens, h.num_admitted) == (0, 0, 2, 6, 1)
    assert s.num_waiting == 0 and s.step == 1  # nothing changed


@pytest.mark.parametrize("seed", range(6))
def test_would_wait_equals_the_next_step(seed):
    """Seeded runs under paged KV, priority, prefix caching and several partial prefills: before each step,
    would_wait(new) equals how many of `new`, really added, are still waiting after the real step."""
    rng = random.Random(seed)
    s = Scheduler(rng.choice([16, 32]), rng.randint(2, 5), 4 * rng.randint(20, 60), kv_policy="paged",
                  block_size=4, policy="priority", enable_prefix_caching=True, max_num_partial_prefills=3,
                  max_long_partial_prefills=2, long_prefill_token_threshold=8)
    prompts = [list(range(n)) for n in (9, 13, 21, 30)]
    rid = 0
    checked = 0
    for _ in range(40):
        new = []
        for _ in range(rng.randint(0, 3)):
            p = rng.choice(prompts)[: rng.randint(4, 30)]
            new.append(Request(rid, len(p), rng.randint(1, 12), priority=rng.randint(0, 2),
                               block_hashes=hash_blocks(p, 4)))
            rid += 1
        guess = s.would_wait(new)
        for r in new:
            s.add(r)
        plan = s.schedule()
        assert guess == sum(1 for r in new if s.request_state(r.rid).status.name == "WAITING")
        checked += bool(new)
        s.complete(plan)
    assert checked > 10 and s.stats().num_preemptions + s.stats().prefix_cache_hits > 0


def test_a_snapshot_runs_on_exactly_as_the_original():
    """snapshot() is detached and whole: the copy shares no mutable state (the decode set and its finish
    index are one object per copy) and, stepped to the end, plans every step as the original does."""
    s = Scheduler(24, 4, 80, kv_policy="paged", block_size=4, policy="priority", enable_prefix_caching=True,
                  num_spec_tokens=1)
    for i in range(8):
        s.add(Request(i, 6 + 5 * i, 3 + i, priority=i % 3, block_hashes=hash_blocks(list(range(6 + 5 * i)), 4)))
    for _ in range(4):
        s.complete(s.schedule())
    t = s.snapshot()
    assert t._due is t._decodes.due and t._due is not s._due and t._kv is not s._kv
    a, b = [], []
    for sched, out in ((s, a), (t, b)):
        while sched.has_unfinished():
            plan = sched.schedule()
            out.append((tuple((c.rid, c.num_tokens) for c in plan), plan.preempted))
            sched.complete(plan)
    assert a == b and len(a) > 5
