"""One Scheduler, two KV policies: bad configurations, the priority victim rule, paged KV that never
binds planning exactly like the reservation policy, and every option under paged KV with preemption."""

from __future__ import annotations

import itertools
import random

import pytest

from factories import RandomWorkload
from stallfree import InvalidConfig, PagedScheduler, Request, Scheduler
from stallfree.core.invariants import InvariantChecker, PagedInvariantChecker

COMBOS = [
    dict(block_size=b, num_spec_tokens=k, **extra)
    for b, k, extra in itertools.product(
        [None, 4],
        [0, 2],
        [{}, {"decode_overflow": "rotate"}, {"policy": "priority"}, {"policy": "priority", "aging_interval": 3}],
    )
]


def _ids(o: dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in o.items() if v) or "default"


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"kv_policy": "blocks"}, "kv_policy"), ({"kv_policy": "paged"}, "block_size"),
     ({"kv_policy": "paged", "block_size": 4, "watermark": 1.0}, "watermark"),
     ({"kv_policy": "paged", "block_size": 4, "watermark": -0.5}, "watermark"),
     ({"align_chunks": True}, "align_chunks"), ({"kv_policy": "paged", "block_size": 0}, "block_size")],
    ids=["unknown-policy", "paged-no-block-size", "watermark-1", "watermark-neg", "align-no-block", "block-0"],
)
def test_bad_kv_configuration_is_invalid_config_naming_the_field(kw, field):
    """An unknown kv_policy, paged without block_size, a watermark out of [0, 1) and aligned chunks
    without a block size raise InvalidConfig naming the field."""
    with pytest.raises(InvalidConfig, match=field):
        Scheduler(8, 4, 1000, **kw)


def test_paged_pool_is_kv_tokens_over_block_size_rounded_down_and_paged_scheduler_is_the_same_class():
    """kv_tokens // block_size blocks; PagedScheduler(...) builds a Scheduler with kv_policy="paged"."""
    s = Scheduler(8, 4, 1001, kv_policy="paged", block_size=16)
    st = s.stats()
    assert (st.num_blocks, st.kv_total, s.config.kv_policy, s.config.chunks_aligned) == (62, 992, "paged", False)
    p = PagedScheduler(8, 4, 62, 16, 0.01)
    pt = p.stats()
    assert isinstance(p, Scheduler) and (pt.num_blocks, pt.kv_total, p.config.kv_policy) == (62, 992, "paged")
    assert Scheduler(16, 4, 1001, block_size=16).config.chunks_aligned is True
    assert Scheduler(16, 4, 1001, block_size=16).block_table is not None  # ids out of the reservations
    assert Scheduler(16, 4, 1001).block_table is None  # no block size: tokens are counted, not blocks


def _victim_run(policy: str) -> list[tuple[tuple[object, ...], tuple[object, ...]]]:
    """Blocks of 2, 6 blocks, no watermark: a (priority 0) and b (priority 5) at step 0, c (priority 1)
    at step 1; at step 3 a's decode needs a block and none is free."""
    s = Scheduler(16, 4, 12, kv_policy="paged", block_size=2, watermark=0.0, policy=policy)
    chk = InvariantChecker(s)
    chk.add(Request("a", 2, 8, priority=0))
    chk.add(Request("b", 2, 8, priority=5))
    out = []
    for step in range(4):
        if step == 1:
            chk.add(Request("c", 2, 8, priority=1))
        plan = chk.schedule()
        out.append((plan.decode_rids, plan.preempted))
        chk.complete(plan)
    return out


def test_priority_victim_is_the_least_urgent_admitted_after_the_one_that_needs_the_block():
    """Worked by hand: steps 0-2 need 2, then 2 + 1, then 1 blocks (6 of 6); at step 3 a and b each
    cross a block. Under fcfs the newest running request (c) is the victim; under priority the least
    urgent admitted after a: b (priority 5), although c was admitted later. b keeps its priority."""
    fcfs = _victim_run("fcfs")
    prio = _victim_run("priority")
    assert fcfs[3] == (("a", "b"), ("c",))
    assert prio[3] == (("a", "c"), ("b",))
    assert prio[:3] == fcfs[:3] == [((), ()), (("a", "b"), ()), (("a", "b", "c"), ())]


def _paged_twin(options: dict[str, object], budget: int, max_seqs: int) -> Scheduler:
    opts = dict(options)
    b = opts.pop("block_size", None)
    return Scheduler(budget, max_seqs, 10**9, kv_policy="paged", block_size=b or 16, watermark=0.0,
                     align_chunks=b is not None, **opts)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", COMBOS, ids=_ids)
def test_paged_kv_that_never_binds_plans_exactly_like_the_reservation_policy(options):
    """Differential: 20 seeded runs per option combination (random arrivals, per-step budgets, aborts,
    early stops, accepted speculative tokens); with a pool that never runs out, the paged policy's
    plans equal the reservation policy's, entry for entry, and so do their emitted tokens."""
    for seed in range(20):
        rng = random.Random(seed)
        floor = int(options.get("block_size") or 1)  # type: ignore[call-overload]
        budget = max(floor, rng.choice([1, 3, rng.randint(1, 16), rng.randint(1, 128)]))
        max_seqs = rng.randint(1, 9)
        res = Scheduler(budget, max_seqs, 10**9, **options)  # type: ignore[arg-type]
        pag = _paged_twin(options, budget, max_seqs)
        reqs = [Request(i, rng.randint(1, 120), rng.randint(1, 40), priority=rng.randint(0, 3)) for i in range(30)]
        arrive = sorted(rng.randint(0, 80) for _ in reqs)
        i = 0
        while i < len(reqs) or res.has_unfinished():
            while i < len(reqs) and arrive[i] <= res.step:
                res.add(reqs[i])
                pag.add(reqs[i])
                i += 1
            if rng.random() < 0.03 and i:
                rid = rng.choice(reqs[:i]).rid
                res.abort(rid)
                pag.abort(rid)
            step_budget = rng.randint(1, budget) if rng.random() < 0.3 else None
            a, b = res.schedule(step_budget), pag.schedule(step_budget)
            assert list(a) == list(b) and a.admitted == b.admitted and not b.preempted, (seed, a.step)
            stopped = [r for r in a.sampled_rids if rng.random() < 0.05]
            acc = {c.rid: rng.randint(1, c.num_tokens) for c in a.decodes} if options["num_spec_tokens"] else None
            assert res.complete(a, stopped, acc) == pag.complete(b, stopped, acc)
            assert res.last_finished == pag.last_finished
            assert res.step < 20_000
        assert not pag.has_unfinished() and pag.stats().num_free_blocks == pag.stats().num_blocks


def _paged_maker(options: dict[str, object]):
    def make(budget: int, max_seqs: int, kv: int, **opts: object) -> Scheduler:
        b = opts.pop("block_size", None)
        bs = int(b) if b else 4  # type: ignore[call-overload]
        # kv + 2 blocks: every request that passes the reservation's add() passes the paged one; tight
        # enough that runs preempt.
        return Scheduler(budget, max_seqs, kv + 2 * bs, kv_policy="paged", block_size=bs,
                         watermark=0.02, align_chunks=b is not None, **opts)  # type: ignore[arg-type]

    return make


@pytest.mark.slow
@pytest.mark.parametrize("options", COMBOS, ids=_ids)
def test_randomized_paged_simulations_for_every_option_combination(options):
    """13 seeded runs per option combination under paged KV with tight pools, random per-step budgets,
    aborts and early stops keep every invariant of the one checker (preemptions included), and some
    of them preempt (seed 12 does under every combination; 7, 8 or 11 under most)."""
    preempted = 0
    for seed in range(13):
        chk = RandomWorkload(seed, options=options, vary_budget=True).run(_paged_maker(options))
        preempted += chk.num_preemptions > 0
    assert preempted >= 1


def test_paged_checker_name_is_the_one_checker():
    """PagedInvariantChecker, the paged checker's former name, is the one InvariantChecker."""
    assert PagedInvariantChecker is InvariantChecker


def test_reserve_block_tables_by_hand():
    """Reserve with blocks of 4 (kv 32 = 8 blocks, chunks not aligned, budget 8): a (7 + 3) reserves 3
    blocks, b (4 + 1) 2; step 0 runs a's 7 and b's first token; a's table, read first, gets blocks 0
    and 1, b's block 2; a's decode at position 8 takes block 3; reading tables never moves kv_free
    (12, 20 once b is done, 32 at the end), and every id goes back."""
    s = Scheduler(8, 2, 32, block_size=4, align_chunks=False)
    s.add(Request("a", 7, 3))
    s.add(Request("b", 4, 1))
    p0 = s.schedule()
    assert [(c.rid, c.num_tokens) for c in p0] == [("a", 7), ("b", 1)]
    table = s.block_table
    assert table is not None
    assert (table("a"), table("b"), s.kv_free) == ((0, 1), (2,), 32 - 12 - 8)
    s.complete(p0)
    assert (table("a"), table("b"), s.kv_free) == ((0, 1), (2,), 12)  # b has 1 token in its KV: 1 block
    p1 = s.schedule()  # a's decode at 7, b's chunk of 3
    assert (table("a"), table("b")) == ((0, 1), (2,))
    s.complete(p1)  # b finishes on its first token
    assert table("a") == (0, 1) and s.kv_free == 32 - 12
    with pytest.raises(KeyError, match="'b'"):
        table("b")
    p2 = s.schedule()  # a's decode at 8: a third block, the last freed first
    assert table("a") == (0, 1, 2)
    s.complete(p2)
    assert not s.has_unfinished() and s.kv_free == 32 and sorted(s.free_block_ids()) == list(range(8))


@pytest.mark.parametrize("spec", [0, 2], ids=["plain", "spec2"])
def test_reserve_tables_read_like_an_engine_cover_each_entry_and_keep_the_plans(spec):
    """10 seeded checked runs under reserve with blocks of 4 (aborts, early stops, accepted speculative
    tokens): tables read after every schedule() cover exactly each entry's tokens, never share a block,
    and reading them changes neither kv_free nor the plans (they equal a twin's that is never read)."""
    for seed in range(10):
        rng = random.Random(seed)
        budget, max_seqs = rng.randint(4, 40), rng.randint(1, 6)
        reqs = [Request(i, rng.randint(1, 60), rng.randint(1, 20)) for i in range(20)]
        kv = max(-(-(r.prompt_len + r.max_new) // 4) * 4 for r in reqs) * rng.choice([1, 3])
        chk = InvariantChecker(Scheduler(budget, max_seqs, kv, block_size=4, num_spec_tokens=spec))
        twin = Scheduler(budget, max_seqs, kv, block_size=4, num_spec_tokens=spec)
        s = chk.scheduler
        arrive = sorted(rng.randint(0, 30) for _ in reqs)
        i = 0
        while i < len(reqs) or s.has_unfinished():
            while i < len(reqs) and arrive[i] <= s.step:
                chk.add(reqs[i])
                twin.add(reqs[i])
                i += 1
            plan, other = chk.schedule(), twin.schedule()
            assert list(plan) == list(other) and s.kv_free == twin.kv_free, (seed, plan.step)
            seen: set[int] = set()
            for c in plan:
                table = s._block_table(c.rid)
                assert len(table) == -(-(c.start + c.num_tokens) // 4) and not seen.intersection(table)
                seen.update(table)
            assert s.kv_free == twin.kv_free
            stopped = [r for r in plan.sampled_rids if rng.random() < 0.05]
            acc = {c.rid: rng.randint(1, c.num_tokens) for c in plan.decodes} if spec else None
            assert chk.complete(plan, stopped, acc) == twin.complete(other, stopped, acc)
        assert s.kv_free == s.stats().kv_total and len(s.free_block_ids()) == s.stats().kv_total // 4
