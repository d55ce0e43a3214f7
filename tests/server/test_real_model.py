"""The server over the real engine and the bundled SmolLM2-135M-Instruct on CPU (a few short requests).

Skipped when stallfree.engine (torch) or the bundled model is not installed.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from server.helpers import WAIT_S, LiveServer, asgi_client, run, sse_events

pytestmark = pytest.mark.slow

engine_mod = pytest.importorskip("stallfree.engine", reason="the engine (torch) is not installed")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (loading takes seconds); each test leaves it empty."""
    try:
        return engine_mod.LLMEngine.from_pretrained(None, token_budget=64, max_seqs=4, kv_tokens=2048,
                                                    device="cpu")
    except engine_mod.EngineError as exc:
        pytest.skip(f"the bundled model is not available: {exc}")


def test_greedy_stream_equals_whole_and_says_paris(engine):
    """Greedy: the streamed deltas equal the whole text, which starts " Paris"; usage counts real tokens."""

    async def go():
        async with asgi_client(engine, sampling_params_cls=None) as c:
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            whole = (await c.post("/v1/completions", json=body)).json()
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            events = sse_events(streamed.text)
            assert events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
            assert text == whole["choices"][0]["text"]
            assert text.startswith(" Paris")
            n_prompt = len(engine.tokenizer.encode(PROMPT))
            assert whole["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 4,
                                      "total_tokens": n_prompt + 4}

    run(go())


def test_real_chat_and_bad_prompts(engine):
    """Chat is rendered by the model's template; out-of-vocabulary ids, context and KV overflows are 400s."""

    async def go():
        async with asgi_client(engine, sampling_params_cls=None) as c:
            msgs = [{"role": "user", "content": "hi"}]
            body = {"messages": msgs, "max_tokens": 3, "temperature": 0}
            r = await c.post("/v1/chat/completions", json=body)
            body = r.json()
            assert r.status_code == 200 and body["model"] == engine.model_name
            n_prompt = len(engine.tokenizer.encode(engine.apply_chat_template(msgs)))
            assert body["usage"]["prompt_tokens"] == n_prompt
            assert 1 <= body["usage"]["completion_tokens"] <= 3
            r = await c.post("/v1/completions", json={"prompt": [1, 10**7], "max_tokens": 2})
            assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": [1] * engine.max_model_len, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            r = await c.post("/v1/completions", json={"prompt": [1] * 2000, "max_tokens": 100})
            assert r.status_code == 400 and "KV capacity 2048" in r.json()["error"]["message"]

    run(go())


def test_real_openai_client_stream(engine):
    """Against live uvicorn, the openai client streams greedy chat text equal to the whole answer."""
    with LiveServer(engine, sampling_params_cls=None) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S * 6)
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        whole = client.chat.completions.create(model=engine.model_name, messages=msgs, max_tokens=4,
                                               temperature=0)
        text = ""
        for chunk in client.chat.completions.create(model=engine.model_name, messages=msgs, max_tokens=4,
                                                    temperature=0, stream=True):
            for choice in chunk.choices:
                text += choice.delta.content or ""
        assert text == whole.choices[0].message.content and text
        assert httpx.get(srv.url + "/metrics", timeout=WAIT_S).status_code == 200


def test_underflowing_temperature_is_greedy_beside_a_stream(engine):
    """Issue 37: temperature 1e-40 (it overflowed the logits and failed the whole step with a 500 for every
    request in it) is greedy on both routes, while a stream in the same steps gets all its tokens."""
    import asyncio

    async def go():
        async with asgi_client(engine, sampling_params_cls=None) as c:
            greedy = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            want = (await c.post("/v1/completions", json=greedy)).json()["choices"][0]["text"]
            live = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                   "ignore_eos": True, "stream": True})
            tiny = c.post("/v1/completions", json={**greedy, "temperature": 1e-40})
            chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 2, "temperature": 1e-40})
            live_r, tiny_r, chat_r = await asyncio.gather(live, tiny, chat)
            assert (tiny_r.status_code, chat_r.status_code) == (200, 200)
            assert tiny_r.json()["choices"][0]["text"] == want
            events = sse_events(live_r.text)
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert not any("error" in e for e in events[:-1])

    run(go())
