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
