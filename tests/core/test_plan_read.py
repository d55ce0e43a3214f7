"""Reading a plan: the compact sequences (the engine's fast path) agree with the ScheduledChunk objects."""

from __future__ import annotations

import pytest

from stallfree import Request, ScheduledChunk, Scheduler


def test_compact_decode_sequences_match_the_entries():
    """decode_rids, decode_starts and decode_tokens are aligned with plan.decodes; iteration is decodes then
    prefills; entries are immutable."""
    s = Scheduler(16, 4, 1000, num_spec_tokens=2)
    s.add(Request("a", 3, 6))
    s.add(Request("b", 5, 6))
    s.complete(s.schedule())
    s.add(Request("c", 20, 2))
    plan = s.schedule()
    assert plan.decode_rids == ("a", "b")
    assert plan.decode_starts == (3, 5) == tuple(c.start for c in plan.decodes)
    assert plan.decode_tokens == (3, 3) == tuple(c.num_tokens for c in plan.decodes)
    assert list(plan) == [*plan.decodes, *plan.prefills]
    assert plan[0] == ScheduledChunk("a", 3, False, 3, True) and plan[-1] == plan.prefills[-1]
    with pytest.raises(AttributeError):
        plan[0].start = 7  # type: ignore[misc]
    s.complete(plan)
    plain = Scheduler(16, 4, 1000)
    plain.add(Request("a", 3, 6))
    plain.complete(plain.schedule())
    assert plain.schedule().decode_tokens is None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("spec", [0, 2])
def test_sorted_decode_offsets_follow_joins_leaves_and_moves(seed, spec):
    """decode_offsets_sorted, kept through joins and leaves, is decode_offsets sorted on every plan that
    carries it (preemptions, aborts, early stops, speculative tokens accepted in part, a snapshot stepped
    on its own), and the scheduler's plans carry it on most steps with decodes."""
    import random

    rng = random.Random(seed)
    s = Scheduler(24, 6, 160, kv_policy="paged", block_size=4, num_spec_tokens=spec)
    rid, carried, with_decodes = 0, 0, 0
    copy = None
    for step in range(400):
        if rng.random() < 0.3:
            s.add(Request(rid, rng.randint(1, 30), rng.randint(1, 40)))
            rid += 1
        plan = s.schedule()
        if plan.num_decodes:
            with_decodes += 1
            if plan.decode_offsets_sorted is not None:
                carried += 1
                assert plan.decode_offsets_sorted == tuple(sorted(plan.decode_offsets))
        accepted = None
        if spec and plan.decode_tokens is not None:
            accepted = {r: rng.randint(1, n) for r, n in zip(plan.decode_rids, plan.decode_tokens, strict=True)}
        stopped = [r for r in plan.sampled_rids if rng.random() < 0.02]
        s.complete(plan, stopped, accepted)
        live = [r for r in plan.decode_rids if r not in s.last_finished]
        if live and rng.random() < 0.05:
            s.abort(rng.choice(live))
        if step == 200:
            copy = s.snapshot()
    assert with_decodes > 200 and carried > 0.8 * with_decodes
    assert copy is not None
    for _ in range(100):
        plan = copy.schedule()
        if plan.decode_offsets_sorted is not None:
            assert plan.decode_offsets_sorted == tuple(sorted(plan.decode_offsets))
        copy.complete(plan)
