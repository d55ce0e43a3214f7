"""Every server-side check, run against the real engine (the bundled SmolLM2-135M on CPU) and against
the test fake: both implement the engine's typed view (EngineClient), which is all the server reads.

The real half is skipped when stallfree.engine (torch) or the bundled model is not installed; the fake
half runs without them.
"""

from __future__ import annotations

import pytest

import stallfree.engine as engine_mod  # torch-free until an engine class is read
from server.fake_engine import FakeEngine, FakeSamplingParams
from server.helpers import asgi_client, run
from stallfree.engine.outputs import EngineClient

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def base():
    """One loaded model for the module; engines below share its weights."""
    pytest.importorskip("torch", reason="the engine (torch) is not installed")
    try:
        return engine_mod.LLMEngine.from_pretrained(None, token_budget=64, max_seqs=4, kv_tokens=2048, device="cpu")
    except engine_mod.EngineError as exc:
        pytest.skip(f"the bundled model is not available: {exc}")


def _real(base, **kw):
    """A real engine over the shared weights: budget 64, 4 seqs, 2048 KV tokens unless given."""
    args = dict(token_budget=64, max_seqs=4, kv_tokens=2048)
    args.update(kw)
    return engine_mod.LLMEngine(base.model, base.tokenizer, base.model_name, scheduler=engine_mod.engine_config(**args))


@pytest.fixture(params=["real", "fake"])
def make(request):
    """Build an engine of either kind, plus the SamplingParams class its server uses (None: the engine's).

    Only the real kind needs the model (`base`), so the fake kind runs without torch."""
    base = request.getfixturevalue("base") if request.param == "real" else None

    def build(**kw):
        if request.param == "real":
            return _real(base, **kw), None
        for key, value in (("max_model_len", 8192), ("kv_tokens", 2048), ("token_budget", 64), ("max_seqs", 4)):
            kw.setdefault(key, value)
        return FakeEngine(**kw), FakeSamplingParams

    build.kind = request.param
    return build


def test_both_implement_the_typed_view(make):
    """The engine and the fake are EngineClients; the view's facts are what the engine was built with."""
    eng, _ = make(kv_policy="paged", block_size=16)
    assert isinstance(eng, EngineClient)
    info = eng.info
    assert (info.token_budget, info.max_seqs, info.kv_total_tokens, info.num_blocks, info.block_size) == (
        64, 4, 2048, 128, 16)
    assert (info.kv_policy, info.scheduling_policy, info.max_model_len) == ("paged", "fcfs", 8192)
    s = eng.stats()
    assert (s.num_running, s.num_waiting, s.num_will_wait, s.kv_free_tokens, s.num_preemptions) == (0, 0, 0, 2048, 0)


def test_token_id_outside_the_vocabulary_is_400(make):
    """Item 9: a token id >= the vocabulary size is a 400 naming prompt, before the queue limit is read."""
    eng, params = make()
    vocab = eng.info.vocab_size

    async def go():
        async with asgi_client(eng, sampling_params_cls=params, max_waiting=1) as c:
            for bad in (vocab, -1):
                r = await c.post("/v1/completions", json={"prompt": [1, bad], "max_tokens": 1})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "prompt" and str(bad) in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": [1, vocab - 1], "max_tokens": 1})
            assert r.status_code == 200

    run(go())


def test_context_length_and_kv_capacity_are_checked(make):
    """prompt + max_tokens over the context (8192) is context_length_exceeded; over the KV (2048) a 400
    naming max_tokens; a text longer than max_model_len * max_token_chars is refused without tokenizing."""
    eng, params = make()

    async def go():
        async with asgi_client(eng, sampling_params_cls=params) as c:
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 8191})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2047})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "max_tokens")
            assert "KV capacity 2048" in r.json()["error"]["message"]
            huge = "a" * (eng.info.max_model_len * eng.info.max_token_chars + 1)
            r = await c.post("/v1/completions", json={"prompt": huge, "max_tokens": 1})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
            assert "characters" in r.json()["error"]["message"]

    run(go())


def test_default_max_tokens_is_bounded_by_kv(make):
    """A request without max_tokens gets min(default 256, KV 24 - prompt 2) = 22 tokens of room."""
    eng, params = make(kv_tokens=24, block_size=1)  # 1-token blocks: the real engine reserves exact tokens

    async def go():
        async with asgi_client(eng, sampling_params_cls=params) as c:
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 22

    run(go())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_takes_effect_or_is_refused(make, policy):
    """Item 2: priority 3 is a 400 naming priority under fcfs and accepted under priority; 0 always passes."""
    eng, params = make(scheduling_policy=policy)

    async def go():
        async with asgi_client(eng, sampling_params_cls=params) as c:
            ok = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "priority": 0})
            assert ok.status_code == 200
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "priority": 3})
            if policy == "fcfs":
                assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")
            else:
                assert r.status_code == 200

    run(go())


def test_paged_with_priority_runs_priorities_and_bad_policy_is_refused(base):
    """Paged KV and the priority policy combine (one Scheduler, KV as a collaborator): with one slot and
    two requests waiting, the more urgent one (priority -1, added second) is admitted first. An unknown
    KV policy is refused naming kv_policy."""
    from stallfree.core import InvalidConfig

    eng = _real(base, kv_policy="paged", scheduling_policy="priority", max_seqs=1)
    info = eng.info
    assert (info.kv_policy, info.scheduling_policy, info.kv_total_tokens) == ("paged", "priority", 2048)
    params = engine_mod.SamplingParams(max_tokens=1, temperature=0)
    eng.add_request("late", [1, 2, 3], params, priority=0)
    eng.add_request("urgent", [1, 2, 3], params, priority=-1)
    first = [o.rid for o in eng.step() if o.finished]
    assert first == ["urgent"]
    with pytest.raises(InvalidConfig, match="kv_policy"):
        _real(base, kv_policy="pages")


# ------------------------------------------------------------------ item 3: who will wait, each cause


def _add(eng, params_cls, rid, n_prompt, max_tokens):
    params = (params_cls or engine_mod.SamplingParams)(max_tokens=max_tokens)
    eng.add_request(rid, list(range(1, n_prompt + 1)), params)


def test_will_wait_for_want_of_slots(make):
    """max_seqs 1: of a and b (both waiting), the next step admits a; b will wait."""
    eng, params = make(max_seqs=1)
    _add(eng, params, "a", 4, 2)
    _add(eng, params, "b", 4, 2)
    h = eng.headroom()
    assert (h.will_wait, h.slots) == (1, 0)
    assert eng.stats().num_will_wait == 1
    _drain(eng)


def test_will_wait_for_want_of_kv(make):
    """KV 24 under reserve: a reserves 10 + 6; b (10 + 6) does not fit the 8 left and will wait, with
    slots and budget to spare."""
    eng, params = make(kv_tokens=24, block_size=1)  # 1-token blocks: the real engine reserves exact tokens
    _add(eng, params, "a", 10, 6)
    _add(eng, params, "b", 10, 6)
    h = eng.headroom()
    assert (h.will_wait, h.slots, h.kv_tokens) == (1, 3, 8)
    _drain(eng)


def test_will_wait_for_want_of_blocks_under_paged_kv(make):
    """Paged KV of 2 blocks of 16: a's 20-token prompt takes both for its first chunk, so b (4 tokens, one
    block) will wait; under paged KV only the first chunk's blocks count, not prompt + max_tokens."""
    eng, params = make(kv_policy="paged", block_size=16, kv_tokens=32)
    _add(eng, params, "a", 20, 8)
    _add(eng, params, "b", 4, 2)
    h = eng.headroom()
    assert (h.will_wait, h.kv_tokens, h.reserve) == (1, 0, False)
    assert h.kv_needed(4, 100, 4) == 16  # one block, whatever max_tokens
    _drain(eng)


def test_will_wait_for_want_of_budget(make):
    """Budget 8: a 30-token prompt is mid-prefill after one step (8 done); the next step's budget goes to
    its rest, so b will wait although a slot and KV are free."""
    eng, params = make(token_budget=8)
    _add(eng, params, "a", 30, 2)
    eng.step()
    _add(eng, params, "b", 4, 2)
    h = eng.headroom()
    assert (h.will_wait, h.budget_tokens, h.slots) == (1, 0, 3)
    _drain(eng)


def _drain(eng):
    for _ in range(500):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("engine still busy")


def test_queue_limit_counts_requests_held_by_kv(make):
    """Item 3 through the server: KV 32, max_waiting 1. Three requests of 4 + 20 tokens sent together:
    the first runs, the second will wait (KV), the third would wait too: 429 although slots are free."""
    import asyncio

    eng, params = make(kv_tokens=32)

    async def go():
        async with asgi_client(eng, sampling_params_cls=params, max_waiting=1) as c:
            body = {"prompt": [1, 2, 3, 4], "max_tokens": 20, "ignore_eos": True, "temperature": 0}
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3)))
            codes = sorted(r.status_code for r in rs)
            assert codes == [200, 200, 429], [r.text[:200] for r in rs]

    run(go())
