"""The server over a real engine with prefix caching: usage.prompt_tokens_details.cached_tokens on both
routes (streamed usage included) and the Prometheus prefix cache counters, in tokens."""

from __future__ import annotations

import re

import pytest

from server.helpers import asgi_client, run, sse_events

pytestmark = pytest.mark.slow

engine_mod = pytest.importorskip("stallfree.engine", reason="the engine (torch) is not installed")

PROMPT = ("You are a careful assistant who answers in one short sentence. Here is the question, "
          "please read it well before answering: what is the capital of France?")


@pytest.fixture(scope="module")
def engine():
    """A paged engine with prefix caching on, blocks of 16."""
    try:
        return engine_mod.LLMEngine.from_pretrained(None, token_budget=256, max_seqs=4, kv_tokens=2048,
                                                    device="cpu", kv_policy="paged",
                                                    enable_prefix_caching=True)
    except engine_mod.EngineError as exc:
        pytest.skip(f"the bundled model is not available: {exc}")


def test_cached_tokens_in_usage_and_counters(engine):
    """First request: 0 cached. The same prompt again: cached = its full blocks, capped at prompt - 1
    tokens. The same on the chat route (its template makes another prompt, so it is sent twice too),
    through the streamed usage chunk. The counters are the scheduler's queries (every prompt token of the
    4 admissions) and hits, in tokens."""
    n = len(engine.tokenizer.encode(PROMPT))
    want = (n - 1) // 16 * 16

    async def go():
        async with asgi_client(engine, sampling_params_cls=None) as c:
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            first = (await c.post("/v1/completions", json=body)).json()
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            second = (await c.post("/v1/completions", json=body)).json()
            assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
            chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0}
            await c.post("/v1/chat/completions", json=chat)
            streamed = await c.post("/v1/chat/completions", json={
                **chat, "stream": True, "stream_options": {"include_usage": True}})
            usage = sse_events(streamed.text)[-2]["usage"]
            m = usage["prompt_tokens"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": (m - 1) // 16 * 16}
            metrics = (await c.get("/metrics")).text
            q = float(re.search(r"^stallfree_prefix_cache_queries_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))
            h = float(re.search(r"^stallfree_prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))
            assert q == 2 * n + 2 * m
            assert h == engine.scheduler.stats().prefix_cache_hits >= want + (m - 1) // 16 * 16

    run(go())


def test_serve_flag_defaults_on_under_paged_and_refuses_reserve(monkeypatch, capsys):
    """--enable-prefix-caching/--no-enable-prefix-caching: on by default under paged, off under reserve;
    asking for it under reserve is exit 2 before anything loads."""
    from stallfree import cli
    from stallfree.server import cli as serve_cli

    def parse(argv):
        return cli.build_parser().parse_args(["serve", *argv])

    assert serve_cli.prefix_caching(parse([])) is True
    assert serve_cli.prefix_caching(parse(["--no-enable-prefix-caching"])) is False
    assert serve_cli.prefix_caching(parse(["--kv-policy", "reserve"])) is False
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--kv-policy", "reserve", "--enable-prefix-caching"]) == 2
    assert "--enable-prefix-caching needs --kv-policy paged" in capsys.readouterr().err
