"""Randomized simulations: every contract invariant after every step, and a checker that can fail."""

from __future__ import annotations

import pytest

from factories import RandomWorkload
from stallfree import Request, Scheduler
from stallfree.core.invariants import InvariantChecker, InvariantViolation

NUM_SIMULATIONS = 400


def _randomized(num: int, capsys) -> None:
    steps = requests = 0
    for seed in range(num):
        chk = RandomWorkload(seed).run()
        steps += chk.num_steps
        requests += chk.num_requests
    with capsys.disabled():
        print(f"\n[invariants] {num} simulations, {requests} requests, {steps} steps checked")
    assert requests == num * 40
    assert steps > requests  # every request needs at least one step; decodes need many more


@pytest.mark.slow
def test_randomized_simulations_hold_every_invariant(capsys):
    """400 seeded simulations (budgets 1-256, 1-11 slots, prompts 1-299, max_new 1-64, tight to generous KV,
    random aborts and early stops) keep every invariant after every step and return all KV at the end."""
    _randomized(NUM_SIMULATIONS, capsys)


def test_randomized_simulations_hold_every_invariant_quick(capsys):
    """The first 12 of those seeded simulations (the quick set's share) keep every invariant."""
    _randomized(12, capsys)


class _SkipsAdmission(Scheduler):
    """A deliberately broken scheduler: it lets a small request jump a blocked head."""

    def schedule(self, token_budget=None):
        q = self._waiting._q  # before admission (the partial prefill does not read the queue)
        if len(q) > 1 and q[0].kv > self.kv_free:
            q.rotate(-1)
        return super().schedule(token_budget)


class _LeaksKV(Scheduler):
    """A deliberately broken scheduler: it returns KV when the prompt finishes, not at the end."""

    def _first_token(self, obj, step):
        super()._first_token(obj, step)
        if obj.status.name == "DECODING":
            self._kv.pool.release([], obj.kv)  # token units: no block_size
            obj.kv = 0


@pytest.mark.parametrize("broken", [_SkipsAdmission, _LeaksKV], ids=["skips-head", "early-release"])
def test_checker_catches_broken_schedulers(broken):
    """The checker raises on a scheduler that skips a blocked head or frees KV at the end of the prompt."""
    chk = InvariantChecker(broken(token_budget=16, max_seqs=4, kv_tokens=30))
    with pytest.raises(InvariantViolation):
        chk.add(Request("big", 4, 20))
        chk.complete(chk.schedule())
        chk.add(Request("blocked", 4, 10))
        chk.add(Request("small", 2, 2))
        for _ in range(30):
            chk.complete(chk.schedule())
