"""Issue 37: one request cannot hurt the others. A fault in one request's sampling fails that request
alone; large inputs are refused before they cost much; bodies are strict (UTF-8 JSON, one framing);
prefix caches can be kept apart (cache_salt); every accepted field is honoured or refused."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, LiveServer, asgi_client, run, sse_events


def _outcomes(text: str) -> dict[str, float]:
    """finished_reason -> count of stallfree_request_success_total in a /metrics body."""
    return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "stallfree_request_success_total"}


# ---------------------------------------------------------------- 1. a sampling fault fails its request alone


def test_sampling_fault_fails_one_request_beside_a_live_stream():
    """A request whose sampling fails (the engine's "error" output) is answered 500 (whole) or an error
    event (streamed), counted as one "error"; a stream running beside it gets all 40 of its tokens and
    finishes with "length"; KV is all free afterwards."""
    eng = FakeEngine(step_time_s=0.002)
    eng.fail_sampling = lambda p: p.temperature == 1.3
    with LiveServer(eng) as srv:
        got: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=WAIT_S,
                              json={"prompt": "hi", "max_tokens": 40, "stream": True}) as r:
                got["events"] = sse_events(r.read().decode())

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.02)
        whole = httpx.post(srv.url + "/v1/completions", timeout=WAIT_S,
                           json={"prompt": "x", "max_tokens": 4, "temperature": 1.3})
        streamed = httpx.post(srv.url + "/v1/chat/completions", timeout=WAIT_S,
                              json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                    "temperature": 1.3, "stream": True})
        t.join(WAIT_S)
        assert whole.status_code == 500
        assert whole.json()["error"]["message"] == "injected sampling failure"
        events = sse_events(streamed.text)
        assert events[-2]["error"]["message"] == "injected sampling failure" and events[-1] == "[DONE]"
        live = got["events"]
        assert live[-1] == "[DONE]" and live[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) for e in live[:-1]) == 40
        srv.wait_idle()
        assert _outcomes(httpx.get(srv.url + "/metrics", timeout=WAIT_S).text) == {"length": 1.0, "error": 2.0}


# ---------------------------------------------------------------- 2. cost before validation


def _post(path: str, body: object, **config: object) -> httpx.Response:
    """POST a JSON body to the app over the fake engine (max_model_len 512), in process."""

    async def go() -> httpx.Response:
        async with asgi_client(FakeEngine(), **config) as c:
            return await c.post(path, content=json.dumps(body).encode(),
                                headers={"content-type": "application/json"})

    return run(go())


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [("/v1/completions", {"prompt": [*range(1, 250_000), "a"]}, None, "at least 249999 JSON values, more than 16896"),
     ("/v1/completions", {"prompt": [1] * 600}, "prompt", "the prompt holds 600 token ids"),
     ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "prompt[1]: a string ('a') in a list of token ids"),
     ("/v1/completions", {"prompt": [1, None]}, "prompt", "prompt[1]: a null"),
     ("/v1/completions", {"prompt": [[1], [2]]}, "prompt", "a batch of 2 prompts"),
     ("/v1/completions", {"prompt": ["a"] * 100_000}, None, "at least 50000 JSON values"),
     ("/v1/completions", {"prompt": ["a"] * 1000}, "prompt", "a batch of 1000 prompts"),
     ("/v1/chat/completions", {"messages": MSG * 1025}, "messages", "1025 items, more than the limit of 1024"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 65}]},
      "messages", "messages[0].content: 65 items"),
     ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 190_000}, None, "at least 95001 JSON values"),
     ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}, "stop", "17 items, more than the limit of 16"),
     ("/v1/completions", {"prompt": "a,b" * 20_000}, "prompt", "at least 15000 tokens"),
     ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, "stop", "257 characters, more than 256"),
     ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 257}, "stop_token_ids", "257 items"),
     ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(300)}}, "logit_bias",
      "300 items"),
     ("/v1/completions", {"prompt": "hi", **{f"f{i}": 0 for i in range(300)}}, None, "301 fields"),
     ("/v1/completions", {"prompt": "hi", "tools": [[[]] * 200] * 30}, None, "more than 4096 lists"),
     ("/v1/completions", {"prompt": "x" * 2100}, "prompt", "at least 525 tokens")],
    ids=["token-list-250k", "token-list-over-context", "mixed-prompt", "null-in-prompt", "batch-of-2",
         "batch-of-100k", "batch-of-1000", "messages", "content-parts", "stop-190k", "stop-17",
         "commas-in-a-string", "stop-long", "stop-token-ids", "logit-bias", "fields", "containers",
         "chars-per-token"],
)
def test_oversized_lists_are_refused_before_validation(path, body, param, words):
    """Each list or object over its limit (docs/server.md) is a short 400 naming the field and the count,
    before pydantic builds an error per item; the value is never echoed (the message stays under 400
    characters whatever the body's size)."""
    r = _post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and len(err["message"]) < 400, err


def test_long_strings_are_not_taken_for_long_lists():
    """The list limits bound lists only: a 200-character stop string and a 300-character message content
    are served (the schema's maxItems of `stop` and `content` apply to their list forms)."""
    r = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": "s" * 200})
    assert r.status_code == 200, r.text
    r = _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "c" * 300}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [({"prompt": 5}, "prompt", "should be one of: a string, a list of integers, a list of strings"),
     ({"prompt": "hi", "stop": [1]}, "stop[0]", "Input should be a valid string (got 1)"),
     ({"prompt": "hi", "max_tokens": "9" * 100_000}, "max_tokens", "... (100002 characters)"),
     ({"prompt": "hi", "max_tokens": "x", "temperature": "y", "top_p": "z"}, "max_tokens", "and 2 more errors")],
    ids=["union", "list-item", "long-value", "count"],
)
def test_validation_errors_name_the_type_and_never_echo(body, param, words):
    """A wrong type names what the field may be (each branch of a union) or the list item at fault, quotes
    at most 60 characters of the value, and counts the other errors instead of listing them."""
    r = _post("/v1/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and len(err["message"]) < 400, err


def test_min_tokens_bounds():
    """body.min_tokens: ceil(chars / max_token_chars), or ceil(ASCII letters and digits / max_token_alnum)
    when larger: 663,000 letters are at least 26,520 tokens of SmolLM2 (25 per token), spaces count only in
    the first bound, and multi-byte text is counted in characters."""
    from stallfree.server.body import min_tokens

    assert min_tokens("x" * 663_000, 81, 25) == 26_520
    assert min_tokens("x" * 663_000, 81) == 8186
    assert min_tokens(" " * 810, 81, 25) == 10
    assert min_tokens("é" * 100, 4, 1) == 25


# ---------------------------------------------------------------- 3. strict bodies


@pytest.mark.parametrize(
    ("raw", "words"),
    [('{"prompt": "hi"}'.encode("utf-16"), "not UTF-8 text (byte 0xff at offset 0)"),
     ('{"prompt": "hi"}'.encode("utf-16-le"), "malformed JSON"),
     ('{"prompt": "hi"}'.encode("utf-32"), "not UTF-8"),
     ('{"prompt": "caf\u00e9"}'.encode("latin-1"), "byte 0xe9 at offset 15"),
     (b"\xef\xbb\xbf" + b'{"prompt": "hi"}', "byte order mark"),
     (b'{"prompt": "\xed\xa0\x80"}', "not UTF-8")],
    ids=["utf-16-bom", "utf-16-le", "utf-32", "latin-1", "utf-8-bom", "encoded-surrogate"],
)
def test_json_only_as_utf8(raw, words):
    """RFC 8259 section 8.1: a body that is not UTF-8 (UTF-16, UTF-32, Latin-1, an encoded surrogate) or that
    starts with a byte order mark is a 400 JSON error object, never parsed by guessing its encoding."""

    async def go() -> httpx.Response:
        async with asgi_client(FakeEngine()) as c:
            return await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_charset_other_than_utf8_is_400():
    """Content-Type: application/json; charset=utf-16 is a 400 naming the charset; charset=utf-8 is served."""

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with asgi_client(FakeEngine()) as c:
            body = b'{"prompt": "hi", "max_tokens": 2}'
            bad = await c.post("/v1/completions", content=body,
                               headers={"content-type": "application/json; charset=utf-16"})
            ok = await c.post("/v1/completions", content=body,
                              headers={"content-type": "application/json; charset=UTF-8"})
            return bad, ok

    bad, ok = run(go())
    assert bad.status_code == 400 and "'utf-16'" in bad.json()["error"]["message"]
    assert ok.status_code == 200


def test_error_messages_with_any_text_are_json():
    """A model name that is not served, holding non-ASCII text, is a 404 JSON object with the name escaped;
    an unexpected exception in a route is a 500 JSON object, not plain text."""
    r = _post("/v1/completions", {"prompt": "hi", "model": "caf\u00e9 \u4e2d"})
    assert r.status_code == 404 and "caf\u00e9 \u4e2d" in r.json()["error"]["message"]
    assert b"\\u00e9" in r.content
    eng = FakeEngine()

    def broken(messages):
        raise RuntimeError("a bug \u00e9 \U0001f600")

    eng.apply_chat_template = broken  # type: ignore[method-assign]
    with LiveServer(eng) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG}, timeout=WAIT_S)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["message"] == "internal server error (RuntimeError); the server log has the details"


def _raw_exchange(url: str, head: str, body: bytes = b"", wait_s: float = 1.0) -> bytes:
    """Send raw HTTP/1.1 bytes and read what comes back until the server closes or `wait_s` passes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except TimeoutError:
            pass
    return got


def test_transfer_encoding_with_content_length_is_400():
    """RFC 9112 section 6.1: a request with both Transfer-Encoding: chunked and Content-Length is a 400
    that closes the connection; the engine never sees it."""
    eng = FakeEngine()
    with LiveServer(eng) as srv:
        port = srv.url.rsplit(":", 1)[1]
        body = b'{"prompt": "hi", "max_tokens": 2}'
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        got = _raw_exchange(srv.url, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n", chunked)
        assert got.startswith(b"HTTP/1.1 400"), got[:200]
        assert b"Transfer-Encoding and Content-Length" in got and b"connection: close" in got.lower()
        assert eng.added == []


def test_expect_100_continue_over_the_limit_gets_413_first():
    """A request declaring a body over max_request_bytes with Expect: 100-continue gets its 413 at once and
    never a 100 Continue (so the client never sends the body); the connection closes."""
    eng = FakeEngine()
    with LiveServer(eng, max_request_bytes=1000) as srv:
        port = srv.url.rsplit(":", 1)[1]
        got = _raw_exchange(srv.url, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                            "Content-Type: application/json\r\nContent-Length: 5000\r\n"
                            "Expect: 100-continue\r\n\r\n", wait_s=2.0)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert b"100 Continue" not in got and b"request_too_large" in got
        ok = _raw_exchange(srv.url, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                           "Content-Type: application/json\r\nContent-Length: 33\r\nConnection: close\r\n"
                           "Expect: 100-continue\r\n\r\n", b'{"prompt": "hi", "max_tokens": 2}')
        assert ok.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200" in ok


# ---------------------------------------------------------------- 4. cache_salt, 5. every field honoured or refused


def test_cache_salt_is_passed_and_isolation_requires_it():
    """cache_salt reaches the engine on both routes; an empty one is a 400; under prefix_cache_isolation
    "salt" a request without one is a 400 naming cache_salt, and with one it is served."""

    async def go() -> None:
        eng = FakeEngine()
        async with asgi_client(eng) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "cache_salt": "t1"})
            assert r.status_code == 200
            r = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "cache_salt": "t2"})
            assert r.status_code == 200
            assert sorted(eng.salts.values()) == ["t1", "t2"]
            r = await c.post("/v1/completions", json={"prompt": "hi", "cache_salt": ""})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "cache_salt")
        async with asgi_client(FakeEngine(), prefix_cache_isolation="salt") as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "cache_salt")
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "cache_salt": "t"})
            assert r.status_code == 200

    run(go())


def test_message_name_is_refused_and_null_accepted():
    """messages[].name is refused (the template has no place for it), naming the message; null is accepted."""
    r = _post("/v1/chat/completions", {"messages": [MSG[0], {"role": "user", "content": "x", "name": "bob"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[1].name: not supported")
    r = _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": None}],
                                       "max_tokens": 2})
    assert r.status_code == 200


def test_prefix_cache_isolation_option():
    """serve --prefix-cache-isolation: none by default, salt accepted, anything else a usage error (exit 2);
    ServerConfig refuses an unknown value naming it."""
    from stallfree import cli
    from stallfree.server.app import ServerConfig, create_app

    parse = cli.build_parser().parse_args
    assert parse(["serve"]).prefix_cache_isolation == "none"
    assert parse(["serve", "--prefix-cache-isolation", "salt"]).prefix_cache_isolation == "salt"
    with pytest.raises(SystemExit) as info:
        parse(["serve", "--prefix-cache-isolation", "user"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="prefix_cache_isolation must be one of"):
        create_app(FakeEngine(), ServerConfig(prefix_cache_isolation="user"))


@pytest.mark.slow
def test_four_large_refused_bodies_barely_delay_a_live_stream():
    """Four 1.9 MB token lists and four 2 MB stop lists sent at once are each a 400 within a second, and a
    live stream beside them (fake steps of 5 ms) never waits more than 0.5 s for a token (before the
    checks ran ahead of parsing: 7.8 s; benchmarks/faults.py --server fake measures it)."""
    eng = FakeEngine(step_time_s=0.005, max_model_len=8192, kv_tokens=100_000)
    bodies = [json.dumps({"prompt": [*range(1, 250_000), "a"]}).encode()] * 4 + [
        json.dumps({"prompt": "hi", "stop": [f"{i:05d}q" for i in range(190_000)]}).encode()] * 4
    with LiveServer(eng, max_request_bytes=2 * 1024 * 1024) as srv:
        times: list[float] = []

        def stream() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=WAIT_S,
                              json={"prompt": "hi", "max_tokens": 300, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        times.append(time.perf_counter())

        statuses: list[int] = []

        def send(raw: bytes) -> None:
            statuses.append(httpx.post(srv.url + "/v1/completions", content=raw, timeout=WAIT_S,
                                       headers={"content-type": "application/json"}).status_code)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.2)
        senders = [threading.Thread(target=send, args=(b,)) for b in bodies]
        start = time.perf_counter()
        for t in senders:
            t.start()
        for t in senders:
            t.join(WAIT_S)
        end = time.perf_counter()
        reader.join(WAIT_S)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= start and a <= end]
        assert statuses == [400] * 8
        assert gaps and max(gaps) < 0.5, max(gaps)
