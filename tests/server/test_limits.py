"""Connection limits: a client that sends its headers or its body a byte at a time gets 408 and is
dropped within --request-read-timeout while a concurrent stream keeps its pace; an idle keep-alive
connection is closed after --timeout-keep-alive; past --limit-concurrency connections requests get 503."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S
from server.ops_helpers import OpsLiveServer, read_until_closed
from stallfree.server.limits import BodyReadTimeout, header_timeout_protocol
from stallfree.server.options import OpsConfig

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n"


def _token_times(url: str, times: list[float], started: threading.Event, done: threading.Event) -> None:
    """Stream a long completion, appending each token's arrival time (time.monotonic) to `times`,
    until `done` is set (leaving aborts the request)."""
    body = {"prompt": "hi", "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30.0) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                started.set()
            if done.is_set():
                return


def _trickle(sock, data: bytes, every_s: float, stop: threading.Event) -> None:
    """Send `data` one byte at a time, one every `every_s` seconds, until done, stopped or refused."""
    for i in range(len(data)):
        if stop.is_set():
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:
            return
        time.sleep(every_s)


def _slow_client(srv: OpsLiveServer, data: bytes, prefix: bytes = b"") -> tuple[float, bytes]:
    """Send `prefix` at once, then `data` a byte every 20 ms; return (seconds until the server closed
    the connection, counted from the first trickled byte, and what it answered)."""
    with srv.connect() as sock:
        if prefix:
            sock.sendall(prefix)
        stop = threading.Event()
        t0 = time.monotonic()
        sender = threading.Thread(target=_trickle, args=(sock, data, 0.02, stop), daemon=True)
        sender.start()
        answer = read_until_closed(sock)
        held = time.monotonic() - t0
        stop.set()
        sender.join(WAIT_S)
    return held, answer


@pytest.mark.parametrize("part", ["headers", "body"])
def test_byte_at_a_time_client_is_dropped_and_streams_keep_pace(part, capsys):
    """With --request-read-timeout 1: a client trickling its headers (or, after whole headers, its
    body) gets 408 and is dropped after about 1 s, and a concurrent stream's worst token gap stays a
    small fraction of that."""
    eng = FakeEngine(step_time_s=0.005, max_model_len=8192, kv_tokens=16384)
    with OpsLiveServer(eng, OpsConfig(request_read_timeout_s=1.0, log_access=False)) as srv:
        times: list[float] = []
        started, done = threading.Event(), threading.Event()
        stream = threading.Thread(target=_token_times, args=(srv.url, times, started, done))
        stream.start()
        assert started.wait(WAIT_S)
        t0 = time.monotonic()
        if part == "headers":
            held, answer = _slow_client(srv, HEAD)
        else:
            held, answer = _slow_client(srv, b'{"prompt": "hi", "max_tokens": 2}' + b" " * 26, prefix=HEAD)
        t1 = time.monotonic()
        done.set()
        stream.join(30)
        during = [t for t in times if t0 <= t <= t1]
        window = [b - a for a, b in zip(during, during[1:], strict=False)]
        worst = max(window)
        print(f"\nslow {part}: held {held:.2f} s, answer {answer[:12]!r}; concurrent stream meanwhile: "
              f"{len(during)} tokens, worst gap {1e3 * worst:.1f} ms, median "
              f"{1e3 * sorted(window)[len(window) // 2]:.1f} ms")
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"connection: close" in answer.lower()
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout" and part in body["error"]["message"]
        assert 0.9 < held < 3.0
        assert len(during) >= 20 and worst < 0.5


def test_silent_connection_is_closed_after_the_read_timeout():
    """A connection that sends nothing is answered 408 and closed after --request-read-timeout."""
    with OpsLiveServer(FakeEngine(), OpsConfig(request_read_timeout_s=0.5, log_access=False)) as srv:
        with srv.connect() as sock:
            t0 = time.monotonic()
            answer = read_until_closed(sock)
            held = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 ") and 0.4 < held < 3.0


def test_idle_keep_alive_connection_closes_after_timeout():
    """After a response, a kept-alive connection that stays idle is closed after --timeout-keep-alive
    (0.5 s here), not after the 30 s read timeout."""
    with OpsLiveServer(FakeEngine(), OpsConfig(timeout_keep_alive_s=0.5, log_access=False)) as srv:
        with srv.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            t0 = time.monotonic()
            answer = read_until_closed(sock)
            held = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 200 ") and b'{"status":"ok"}' in answer
    assert 0.4 < held < 3.0


def test_limit_concurrency_answers_503_past_the_limit():
    """With --limit-concurrency 3 and three idle connections open, a request gets uvicorn's 503; once
    they close, requests are served again."""
    with OpsLiveServer(FakeEngine(), OpsConfig(limit_concurrency=3, log_access=False)) as srv:
        socks = [srv.connect() for _ in range(3)]
        try:
            time.sleep(0.2)  # the server has accepted them
            r = httpx.get(srv.url + "/health", timeout=WAIT_S)
            assert r.status_code == 503
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + WAIT_S
        while httpx.get(srv.url + "/health", timeout=WAIT_S).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_timeouts_are_checked():
    """A read timeout of 0 or below is refused naming the value."""
    with pytest.raises(ValueError, match="got 0"):
        header_timeout_protocol(0)
    with pytest.raises(ValueError, match="got -1"):
        BodyReadTimeout(lambda *a: None, -1)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="request_read_timeout_s must be a number of seconds > 0, got 0"):
        OpsConfig(request_read_timeout_s=0)
    with pytest.raises(ValueError, match="limit_concurrency must be an integer >= 1 or None, got 0"):
        OpsConfig(limit_concurrency=0)
