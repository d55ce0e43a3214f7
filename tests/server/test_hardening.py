"""Faults found by trying public bug reports on the server (issue 19), each with the tests of its kind:
falsy values taken as "not set" (B31), aborted requests missing from the outcome counters (B36), input
that reaches a library call that raises (a lone surrogate), and oversized bodies."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, LiveServer, asgi_client, run

LAB = (("model_name", "fake-model"),)


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _outcomes(samples: dict) -> dict[str, float]:
    """finished_reason -> count of stallfree_request_success_total."""
    return {dict(k[1])["finished_reason"]: v for k, v in samples.items()
            if k[0] == "stallfree_request_success_total"}


# ---------------------------------------------------------------- B31: falsy values are values


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 0), ("logprobs", 1), ("stop", ""), ("stop", [""]), ("stop", ["x", ""]), ("n", 0),
     ("best_of", 0), ("echo", True), ("suffix", ""), ("min_tokens", 1), ("skip_special_tokens", False)],
    ids=["logprobs-0", "logprobs-1", "stop-empty", "stop-list-empty", "stop-list-mixed", "n-0", "best_of-0",
         "echo-true", "suffix-empty", "min_tokens-1", "skip_special_tokens-false"],
)
def test_b31_falsy_value_is_refused_naming_the_field(field, value):
    """Case B31 and its kind: 0, "" or false where they mean something (logprobs 0 asks for the chosen
    tokens' log-probabilities; an empty stop string) are a 400 naming the field, not taken as unset."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, field: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field

    run(go())


def test_b31_with_the_engine_sampling_params():
    """B31's setup: the app given the engine's real SamplingParams refuses logprobs 0 and stop "" alike."""
    pytest.importorskip("stallfree.engine.sampling")

    async def go():
        async with asgi_client(FakeEngine(), sampling_params_cls=None) as c:
            for extra, param in (({"logprobs": 0}, "logprobs"), ({"stop": ""}, "stop"), ({"stop": [""]}, "stop")):
                r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, **extra})
                assert (r.status_code, r.json()["error"]["param"]) == (400, param)

    run(go())


def test_neutral_values_are_accepted_and_take_effect():
    """The neutral values (logprobs null, stop [], top_logprobs 0, seed 0, temperature 0) are accepted."""

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng) as c:
            body = {"prompt": "hi", "max_tokens": 2, "logprobs": None, "stop": [], "seed": 0, "temperature": 0}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            params = eng.params[eng.added[-1]]
            assert (params.seed, params.temperature, tuple(params.stop)) == (0, 0, ())

    run(go())


# ---------------------------------------------------------------- B36: every request has one outcome


def test_b36_client_abort_is_counted_once():
    """Case B36: one completion to the end, then a stream the client closes after 3 events: /metrics
    counts length 1 and abort 1 (two requests, two outcomes) and the running gauge is back to 0."""
    eng = FakeEngine(step_time_s=0.02)
    with LiveServer(eng) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=WAIT_S)
        assert r.status_code == 200
        port = int(srv.url.rsplit(":", 1)[1])
        payload = b'{"prompt": "hi", "max_tokens": 60, "stream": true}'
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(head + payload)
            got = b""
            while got.count(b"data: ") < 3:
                chunk = sock.recv(4096)
                assert chunk, "server closed early"
                got += chunk
        deadline = time.monotonic() + WAIT_S
        while eng.has_unfinished() or not eng.aborted:
            assert time.monotonic() < deadline, "request not aborted"
            time.sleep(0.01)
        samples = _samples(httpx.get(srv.url + "/metrics", timeout=WAIT_S).text)
        assert _outcomes(samples) == {"length": 1.0, "abort": 1.0}
        assert samples[("stallfree_num_requests_running", LAB)] == 0


def test_step_failure_and_dead_engine_count_as_error():
    """A failed step ends its request as "error"; the requests failed by the dead engine too: the outcome
    counters add up to the requests the engine accepted."""

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng, check_free=False) as c:
            assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
            eng.fail_next_steps = 1
            assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})).status_code == 500
            samples = _samples((await c.get("/metrics")).text)
            assert _outcomes(samples) == {"length": 1.0, "error": 1.0}
            # The failed plan is retried (empty) by the next steps: 3 failures in a row kill the engine,
            # whether or not the next request reached it first; each accepted request ends as "error".
            eng.fail_next_steps = 3
            codes = [(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})).status_code
                     for _ in range(2)]
            assert set(codes) <= {500, 503} and codes[-1] == 503
            samples = _samples((await c.get("/metrics")).text)
        outcomes = _outcomes(samples)
        assert outcomes["length"] == 1.0 and set(outcomes) <= {"length", "error"}
        # A 503 is either refused at the door (not counted) or failed while queued for the engine ("error").
        assert len(eng.added) <= sum(outcomes.values()) <= len(eng.added) + codes.count(503)

    run(go())


def test_whole_response_client_gone_counts_abort():
    """A non-streaming client that times out is counted as one abort, nothing else."""
    eng = FakeEngine(step_time_s=0.005, kv_tokens=4096, max_model_len=4096)
    with LiveServer(eng) as srv:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3000}, timeout=0.3)
        deadline = time.monotonic() + WAIT_S
        while not eng.aborted or eng.has_unfinished():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        samples = _samples(httpx.get(srv.url + "/metrics", timeout=WAIT_S).text)
        assert _outcomes(samples) == {"abort": 1.0}
        assert ("stallfree_e2e_request_latency_seconds_count", LAB) in samples
        assert samples[("stallfree_e2e_request_latency_seconds_count", LAB)] == 0  # latency: finished only


# ---------------------------------------------------------------- item 7: no input reaches a raising call


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/completions", {"prompt": "abc \ud800"}, "prompt"),
     ("/v1/completions", {"prompt": ["abc \udfff"]}, "prompt"),
     ("/v1/completions", {"prompt": "ok", "stop": ["\ud800"]}, "stop"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc \ud800"}]}, "messages"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
      "messages")],
    ids=["completion", "batch-of-one", "stop", "chat", "chat-part"],
)
def test_lone_surrogate_is_400(path, body, param):
    """A lone UTF-16 surrogate (JSON "\\ud800") anywhere in a request is a 400 naming the field, not a 500."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param

    run(go())


def test_deeply_nested_json_is_400():
    """A body nested 100,000 deep is a 400 (malformed), not a RecursionError 500."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await c.post("/v1/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
            assert r.status_code == 400

    run(go())


# ---------------------------------------------------------------- item 8: one huge request stalls no one


def test_body_over_the_limit_is_413_before_parsing():
    """A body over max_request_bytes is a 413 naming the limit, whether declared by Content-Length or sent
    in chunks without one; the engine never sees it and the next request is served."""

    async def go():
        eng = FakeEngine()
        async with asgi_client(eng, max_request_bytes=1000) as c:
            big = json.dumps({"prompt": "a" * 2000, "max_tokens": 2}).encode()
            r = await c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]

            async def chunks():
                for i in range(0, len(big), 100):
                    yield big[i:i + 100]

            r = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert eng.added == []
            ok = json.dumps({"prompt": "a" * 400, "max_tokens": 2, "user": "u" * 500}).encode()
            assert len(ok) <= 1000
            r = await c.post("/v1/completions", content=ok, headers={"content-type": "application/json"})
            assert r.status_code == 200

    run(go())


def test_huge_body_on_a_live_server_is_refused_quickly():
    """A 5 MB body against the default 2 MiB limit is answered 413 (the client is not cut off mid-send)."""
    eng = FakeEngine()
    with LiveServer(eng, max_request_bytes=2 * 1024 * 1024) as srv:
        raw = b'{"prompt": "' + b"a " * 2_500_000 + b'", "max_tokens": 4}'
        r = httpx.post(srv.url + "/v1/completions", content=raw, timeout=WAIT_S,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert eng.added == []


def test_tokenizing_runs_off_the_event_loop():
    """The prompt is tokenized in a worker thread, not on the event loop's thread."""
    import threading

    seen = []

    class SpyTokenizer(type(FakeEngine().tokenizer)):
        def encode(self, text):
            seen.append(threading.current_thread() is threading.main_thread())
            return super().encode(text)

    async def go():
        eng = FakeEngine()
        eng.tokenizer = SpyTokenizer()
        async with asgi_client(eng) as c:
            assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})).status_code == 200
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
        assert seen == [False, False]

    run(go())


def test_tokenizer_error_is_400():
    """Whatever the tokenizer library raises on client text is a 400 naming the field, never a 500."""

    class BrokenTokenizer(type(FakeEngine().tokenizer)):
        def encode(self, text):
            raise RuntimeError("the library refused this text")

    async def go():
        eng = FakeEngine()
        eng.tokenizer = BrokenTokenizer()
        async with asgi_client(eng) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")

    run(go())


def test_unknown_route_gets_an_openai_error_body():
    """An unknown route is a 404 and a wrong method a 405, each with OpenAI's error object."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            r = await c.post("/v1/nothing", json={})
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["type"] == "not_found_error" and "/v1/nothing" in err["message"]
            r = await c.get("/v1/completions")
            assert r.status_code == 405 and "error" in r.json()

    run(go())


def test_stop_on_the_last_allowed_token_is_stop_through_the_api():
    """Item 10 through the API: "hi" writes "r" first; stop_token_ids [114] ("r") with max_tokens 1 (the
    token of the prefill step) and stop " " with max_tokens 2 (a decode) both finish with "stop"."""

    async def go():
        async with asgi_client(FakeEngine()) as c:
            for extra in ({"max_tokens": 1, "stop_token_ids": [114]}, {"max_tokens": 2, "stop": " "}):
                r = await c.post("/v1/completions", json={"prompt": "hi", **extra})
                assert r.json()["choices"][0]["finish_reason"] == "stop", extra

    run(go())


def test_preemptions_reach_metrics_under_paged_kv():
    """Paged KV of 8 blocks of 4 tokens: two requests of 4 + 24 tokens outgrow it, the newer is preempted
    (recompute) and both still finish with 24 tokens; /metrics counts the preemptions."""

    async def go():
        import asyncio

        eng = FakeEngine(kv_policy="paged", block_size=4, kv_tokens=32, token_budget=16, max_seqs=2)
        async with asgi_client(eng) as c:
            body = {"prompt": "abcd", "max_tokens": 24, "ignore_eos": True}
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(2)))
            assert [r.json()["usage"]["completion_tokens"] for r in rs] == [24, 24]
            samples = _samples((await c.get("/metrics")).text)
        assert samples[("stallfree_preemptions_total", LAB)] == eng.scheduler.stats().num_preemptions >= 1

    run(go())


def test_every_server_and_engine_error_is_a_stallfree_error():
    """One base class: the server's, the engine's and the core's errors all derive from StallfreeError,
    and the server hands out the engine's own StepFailed."""
    from stallfree.core.errors import SchedulerError, StallfreeError
    from stallfree.engine.errors import EngineError, StepFailed
    from stallfree.server import EngineDead, QueueFull
    from stallfree.server import StepFailed as ServerStepFailed
    from stallfree.server.protocol import ApiError

    assert ServerStepFailed is StepFailed
    for cls in (SchedulerError, EngineError, StepFailed, EngineDead, QueueFull, ApiError):
        assert issubclass(cls, StallfreeError), cls
