"""AsyncEngine: requests join and leave between steps, early exit aborts, failures fail only their step."""

from __future__ import annotations

import asyncio

import pytest

from server.fake_engine import FakeEngine, FakeSamplingParams
from server.helpers import assert_all_free, run
from stallfree.server import AsyncEngine, EngineDead, QueueFull, StepFailed


async def _drain(aeng: AsyncEngine, rid: str, prompt: str, n: int) -> list:
    return [out async for out in aeng.generate(rid, prompt, FakeSamplingParams(max_tokens=n))]


def test_generate_yields_every_token_then_finishes():
    """Four outputs of one token each; only the last is finished, with reason "length"."""

    async def go():
        eng = FakeEngine()
        aeng = AsyncEngine(eng)
        outs = await _drain(aeng, "a", "hi", 4)
        await aeng.stop()
        assert [o.text for o in outs] == ["r", " ", "t", "h"]
        assert [o.finished for o in outs] == [False, False, False, True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_generated == 4
        assert_all_free(eng)

    run(go())


def test_requests_join_between_steps():
    """A request added while another runs is batched with it: both finish and the steps overlap."""

    async def go():
        eng = FakeEngine(step_time_s=0.002)
        aeng = AsyncEngine(eng)
        a = asyncio.create_task(_drain(aeng, "a", "hi", 20))
        await asyncio.sleep(0.01)
        b = asyncio.create_task(_drain(aeng, "b", "hi", 5))
        outs_a, outs_b = await asyncio.gather(a, b)
        await aeng.stop()
        assert len(outs_a) == 20 and len(outs_b) == 5
        assert eng.num_steps < 25  # shared steps, not 20 + 5 in sequence
        assert_all_free(eng)

    run(go())


def test_leaving_the_iteration_aborts_at_the_next_step():
    """Breaking out after 2 tokens aborts the request; its KV is free once the loop applied the abort."""

    async def go():
        eng = FakeEngine(step_time_s=0.001)
        aeng = AsyncEngine(eng)
        stream = await aeng.add_request("a", "hi", FakeSamplingParams(max_tokens=400))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        for _ in range(1000):
            if not eng.has_unfinished():
                break
            await asyncio.sleep(0.001)
        await aeng.stop()
        assert eng.aborted == ["a"]
        assert eng.num_steps < 400
        assert_all_free(eng)

    run(go())


def test_add_error_raises_to_the_caller():
    """An add_request error from the engine (context length) reaches the awaiting caller; nothing is live."""

    async def go():
        eng = FakeEngine(max_model_len=8)
        aeng = AsyncEngine(eng)
        with pytest.raises(ValueError, match="maximum context length is 8 tokens"):
            await aeng.add_request("a", "hello", FakeSamplingParams(max_tokens=4))
        assert aeng.num_live == 0
        await aeng.stop()
        assert_all_free(eng)

    run(go())


def test_queue_full_when_max_waiting_reached():
    """max_seqs 1, max_waiting 1: of three requests arriving before any step, the first takes the free slot,
    the second will wait (no slot), and the third, which would wait behind it, is refused with QueueFull
    before it is queued."""

    async def go():
        eng = FakeEngine(max_seqs=1)
        aeng = AsyncEngine(eng, max_waiting=1)
        first = asyncio.create_task(_drain(aeng, "a", "hi", 2))
        second = asyncio.create_task(_drain(aeng, "b", "hi", 2))
        await asyncio.sleep(0)  # "a" and "b" are pending now
        with pytest.raises(QueueFull, match=r"1 request\(s\) will wait"):
            await aeng.add_request("c", "hi", FakeSamplingParams(max_tokens=2))
        assert len(await first) == 2 and len(await second) == 2
        await aeng.stop()
        assert eng.added == ["a", "b"]
        assert_all_free(eng)

    run(go())


def test_step_failure_fails_only_its_requests():
    """max_seqs 1: a failed first step fails the running request; the waiting one is served in full."""

    async def go():
        eng = FakeEngine(max_seqs=1)
        eng.fail_next_steps = 1
        aeng = AsyncEngine(eng)
        a = asyncio.create_task(_drain(aeng, "a", "hi", 3))
        b = asyncio.create_task(_drain(aeng, "b", "hi", 3))
        res_a, res_b = await asyncio.gather(a, b, return_exceptions=True)
        await aeng.stop()
        assert isinstance(res_a, StepFailed) and "injected step failure" in str(res_a)
        assert [o.text for o in res_b] == ["r", " ", "t"]
        assert_all_free(eng)

    run(go())


def test_stop_fails_live_requests_and_frees_kv():
    """stop() ends a running request with EngineDead and returns its KV; later adds are refused."""

    async def go():
        eng = FakeEngine(step_time_s=0.001)
        aeng = AsyncEngine(eng)
        stream = await aeng.add_request("a", "hi", FakeSamplingParams(max_tokens=400))
        await aeng.stop()
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        assert_all_free(eng)
        with pytest.raises(EngineDead):
            await aeng.add_request("b", "hi", FakeSamplingParams(max_tokens=1))

    run(go())
