"""Speculative steps under the reservation policy ask the KV manager nothing per decode.

ReservationKV holds every token a request computes from admission on (`holds_every_token`), so a
speculative step neither grows nor trims each decode: with 1,024 decodes such a step cost about 160 us
where the same step without speculation costs 6. The plans must not change: a manager that does not
make the promise is asked every time and must plan the same steps.
"""

from __future__ import annotations

import random

import pytest

from stallfree import Request, Scheduler
from stallfree.core.kv.reservation import ReservationKV


class CountingReservation(ReservationKV):
    """ReservationKV counting the per-decode questions; `promise` sets holds_every_token."""

    def __init__(self, kv_tokens: int, promise: bool) -> None:
        super().__init__(kv_tokens, None)
        self.holds_every_token = promise
        self.grows = self.trims = 0

    def grow(self, rec, tokens, step):  # type: ignore[no-untyped-def]
        self.grows += 1
        return super().grow(rec, tokens, step)

    def trim(self, rec, tokens):  # type: ignore[no-untyped-def]
        self.trims += 1
        super().trim(rec, tokens)


def _run(promise: bool, budget: int, seed: int) -> tuple[list[list[tuple[object, int, bool]]], CountingReservation]:
    """A seeded workload with two speculative tokens per decode and a verdict (tokens accepted) for some
    decodes each step; returns every plan's entries and the manager."""
    rng = random.Random(seed)
    kv = CountingReservation(50_000, promise)
    s = Scheduler(budget, 24, 50_000, num_spec_tokens=2, kv_manager=kv)
    reqs = [Request(i, rng.randint(1, 60), rng.randint(1, 30)) for i in range(40)]
    arrive = sorted(rng.randint(0, 60) for _ in reqs)
    plans = []
    i = 0
    while i < len(reqs) or s.has_unfinished():
        while i < len(reqs) and arrive[i] <= s.step:
            s.add(reqs[i])
            i += 1
        plan = s.schedule()
        plans.append([(e.rid, e.num_tokens, e.is_prefill) for e in plan])
        accepted = {e.rid: rng.randint(1, e.num_tokens) for e in plan if not e.is_prefill and rng.random() < 0.5}
        s.complete(plan, num_accepted=accepted)
    return plans, kv


@pytest.mark.parametrize("budget", [256, 20])  # 20: decodes at 3 tokens each pass it (the overflow rule)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_steps_under_reservation_skip_per_decode_questions_and_plan_the_same(budget, seed):
    asked, asked_kv = _run(False, budget, seed)
    skipped, skipped_kv = _run(True, budget, seed)
    assert skipped == asked
    # The manager without the promise is asked to grow every decode of each step and to trim every one
    # with speculative tokens; with it, neither (the prefill phase still grows its chunks).
    decodes = sum(1 for plan in asked for _, _, prefill in plan if not prefill)
    spec_entries = sum(1 for plan in asked for _, n, prefill in plan if not prefill and n > 1)
    assert asked_kv.trims == spec_entries > 0
    assert skipped_kv.trims == 0
    assert asked_kv.grows - skipped_kv.grows == decodes > 0


def test_reservation_kv_makes_the_promise():
    assert ReservationKV(100, None).holds_every_token is True
