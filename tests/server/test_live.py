"""Streaming against a live uvicorn on 127.0.0.1 (port 0): the official openai client, raw HTTP,
a client that disconnects mid-stream, a burst past --max-waiting, and a step failure mid-stream."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import openai

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, LiveServer, sse_events


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def test_openai_client_stream_matches_whole():
    """The openai client's streamed completion and chat text equal the non-streamed ones, with usage."""
    with LiveServer(FakeEngine()) as srv:
        client = _client(srv)
        whole = client.completions.create(model="fake-model", prompt="hi", max_tokens=7)
        assert whole.choices[0].text == "r the l"
        parts, reasons = [], []
        for chunk in client.completions.create(model="fake-model", prompt="hi", max_tokens=7, stream=True):
            parts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        assert "".join(parts) == "r the l"
        assert reasons[-1] == "length" and reasons.count("length") == 1

        msgs = [{"role": "user", "content": "hi"}]
        whole = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=6)
        stream = client.chat.completions.create(
            model="fake-model", messages=msgs, max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
        assert text == whole.choices[0].message.content and len(text) == 6
        assert (usage.prompt_tokens, usage.completion_tokens) == (20, 6)
        models = client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]


def test_openai_client_sees_400_for_bad_request():
    """The openai client raises BadRequestError carrying our error object (param max_tokens)."""
    with LiveServer(FakeEngine()) as srv:
        try:
            _client(srv).completions.create(model="fake-model", prompt="hi", max_tokens=0)
        except openai.BadRequestError as exc:
            assert exc.status_code == 400
            assert exc.body["param"] == "max_tokens"
        else:
            raise AssertionError("no error")


def test_raw_http_stream_frames():
    """Raw HTTP: a text/event-stream of `data:` frames, one per token, ending in data: [DONE]."""
    with LiveServer(FakeEngine()) as srv:
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = "".join(r.iter_text())
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["r", " ", "t", "h"]


def test_disconnect_mid_stream_aborts_and_frees_kv():
    """A client that closes the connection after a few chunks has its request aborted and its KV freed."""
    eng = FakeEngine(step_time_s=0.005, kv_tokens=4096, max_model_len=4096)
    with LiveServer(eng) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        payload = b'{"prompt": "hi", "max_tokens": 3000, "stream": true}'
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(head + payload)
            got = b""
            while got.count(b"data: ") < 3:
                chunk = sock.recv(4096)
                assert chunk, "server closed early"
                got += chunk
            assert b"200 OK" in got
            assert eng.scheduler.kv_free < eng.scheduler.stats().kv_total  # still running: 3002 tokens reserved
        rid = eng.added[-1]
        deadline = time.monotonic() + WAIT_S
        while rid not in eng.aborted or eng.has_unfinished():
            assert time.monotonic() < deadline, "request not aborted after the disconnect"
            time.sleep(0.01)
        assert eng.scheduler.kv_free == eng.scheduler.stats().kv_total
        assert eng.num_steps < 3000  # it did not run to max_tokens


def test_disconnect_before_whole_response_aborts():
    """A non-streaming client that gives up (timeout) has its request aborted and its KV freed."""
    eng = FakeEngine(step_time_s=0.005, kv_tokens=4096, max_model_len=4096)
    with LiveServer(eng) as srv:
        body = {"prompt": "hi", "max_tokens": 3000}
        try:
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("a 3000-step request answered within 0.3 s")
        deadline = time.monotonic() + WAIT_S
        while not eng.aborted or eng.has_unfinished():
            assert time.monotonic() < deadline, "request not aborted after the client left"
            time.sleep(0.01)
        assert eng.aborted == eng.added


def test_burst_past_max_waiting_gets_429():
    """A burst of 8 with max_seqs 1 and max_waiting 2: some are 429 (rate_limit_error), the rest finish.

    Each request takes 50 steps of 5 ms, so the 8, released together, arrive while the first 3 hold
    the one running slot and the 2 waiting places.
    """
    eng = FakeEngine(max_seqs=1, step_time_s=0.005)
    barrier = threading.Barrier(8, timeout=WAIT_S)
    with LiveServer(eng, max_waiting=2) as srv:

        def one(i: int) -> tuple[int, dict]:
            body = {"prompt": "hi", "max_tokens": 50}
            barrier.wait()
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT_S)
            return r.status_code, r.json()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        codes = [c for c, _ in results]
        assert set(codes) <= {200, 429}
        assert codes.count(429) >= 1 and codes.count(200) >= 2
        for code, body in results:
            if code == 429:
                assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
            else:
                assert body["usage"]["completion_tokens"] == 50
        assert len(eng.added) == codes.count(200)  # a 429 never reached the engine


def test_step_failure_mid_stream_sends_error_then_done():
    """A step that raises after the stream started ends it with an error event and [DONE]; the next works."""
    eng = FakeEngine(step_time_s=0.005, max_model_len=4096, kv_tokens=4096)
    with LiveServer(eng) as srv:
        body = {"prompt": "hi", "max_tokens": 2000, "stream": True}
        frames = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
            for line in r.iter_lines():
                if line:
                    frames.append(line)
                if len(frames) == 2:
                    eng.fail_next_steps = 1
        events = sse_events("\n\n".join(frames) + "\n\n")
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error"
        assert all("choices" in e for e in events[:-2])
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "r "
