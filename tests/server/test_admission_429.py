"""The server's 429 (QueueFull) is the scheduler's own admission: under paged KV, the priority policy and
several partial prefills, a request is refused exactly when, added with the ones queued before it, the
engine's next step would leave one more request waiting and max_waiting were waiting already."""

from __future__ import annotations

import asyncio

import pytest

from server.fake_engine import FakeEngine, FakeSamplingParams
from server.helpers import run
from stallfree.server import AsyncEngine, QueueFull

MAX_WAITING = 3
# (rid, prompt, max_tokens, priority): in the engine before the server starts, then queued at the server.
RUNNING = [("r0", "x" * 30, 6, 1), ("r1", "y" * 9, 4, 0), ("r2", "z" * 20, 5, 2)]
QUEUED = [("q0", "a" * 12, 3, 1), ("q1", "b" * 5, 8, 2)]
CANDIDATES = [("n-urgent-short", "c" * 3, 2, 0), ("n-urgent-long", "d" * 40, 2, 0),
              ("n-lazy-short", "e" * 2, 2, 3), ("n-lazy-long", "f" * 33, 6, 3), ("n-mid", "g" * 7, 4, 1)]


def _engine() -> FakeEngine:
    """Budget 32, 4 slots, 12 blocks of 4 tokens (paged), priority, K = 3 partial prefills (L = 2, T = 6),
    with RUNNING added and two steps run: a long prompt is still in prefill and blocks are short."""
    eng = FakeEngine(token_budget=32, max_seqs=4, kv_tokens=48, block_size=4, kv_policy="paged",
                     scheduling_policy="priority", max_model_len=64, max_num_partial_prefills=3,
                     max_long_partial_prefills=2, long_prefill_token_threshold=6)
    for rid, prompt, n, prio in RUNNING:
        eng.add_request(rid, prompt, FakeSamplingParams(max_tokens=n), priority=prio)
    eng.step()
    eng.step()
    return eng


def _waiting_after_next_step(extra: list[tuple[str, str, int, int]]) -> int:
    """The scheduler's own answer: add `extra` to the engine for real, run its next step, count the waiting."""
    eng = _engine()
    for rid, prompt, n, prio in extra:
        eng.add_request(rid, prompt, FakeSamplingParams(max_tokens=n), priority=prio)
    eng.step()
    return eng.scheduler.num_waiting


def _server_refuses(candidate: tuple[str, str, int, int]) -> bool:
    """The server's answer: QUEUED arrive at the server before any step, then `candidate`."""

    async def go() -> bool:
        eng = _engine()
        aeng = AsyncEngine(eng, max_waiting=MAX_WAITING)
        tasks = [asyncio.create_task(aeng.add_request(rid, p, FakeSamplingParams(max_tokens=n), priority=prio))
                 for rid, p, n, prio in QUEUED]
        await asyncio.sleep(0)  # QUEUED are pending at the server now, not yet in the engine
        rid, p, n, prio = candidate
        try:
            await aeng.add_request(rid, p, FakeSamplingParams(max_tokens=n), priority=prio)
            refused = False
        except QueueFull:
            refused = True
        await asyncio.gather(*tasks)
        await aeng.stop("abort")
        return refused

    return run(go())


@pytest.mark.parametrize("candidate", CANDIDATES, ids=[c[0] for c in CANDIDATES])
def test_the_429_is_the_schedulers_admission(candidate):
    """Refused exactly when the candidate adds one more waiting request and MAX_WAITING wait without it."""
    without = _waiting_after_next_step(QUEUED)
    with_it = _waiting_after_next_step([*QUEUED, candidate])
    assert _server_refuses(candidate) == (with_it > without >= MAX_WAITING)


def test_the_scenario_exercises_the_rules():
    """The setup has a partial prefill, MAX_WAITING or more would wait without a candidate, and the
    candidates get both answers (the urgent short one is admitted ahead of the queued ones)."""
    eng = _engine()
    assert eng.scheduler.partial_prefills == ("r0",)
    without = _waiting_after_next_step(QUEUED)
    answers = {_waiting_after_next_step([*QUEUED, c]) > without for c in CANDIDATES}
    assert answers == {True, False} and without >= MAX_WAITING
