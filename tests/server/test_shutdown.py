"""Graceful shutdown: once it begins, new requests and /health get 503 with Retry-After while /metrics
still answers; the requests in flight finish within --shutdown-timeout, the rest are aborted (an error
event, then [DONE]); every accepted request ends in exactly one outcome, all KV comes back, and a
SIGTERM'd server process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, sse_events
from server.ops_helpers import OpsLiveServer, outcomes
from stallfree.server.options import OpsConfig
from stallfree.server.shutdown import Drain

FAKE_SERVE = Path(__file__).resolve().parent / "fake_serve.py"


def _stream(url: str, max_tokens: int, out: list, started: threading.Event | None = None) -> None:
    """Stream one completion; append (status, events) to `out`; set `started` at the first token."""
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    frames = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30.0) as r:
        for line in r.iter_lines():
            if line:
                frames.append(line)
                if started is not None:
                    started.set()
        out.append((r.status_code, sse_events("\n\n".join(frames) + "\n\n")))


def test_drain_refuses_new_work_finishes_short_aborts_long():
    """During a drain a 20-token stream finishes (length) and a 5000-token one is aborted with an error
    event when a second signal cuts the wait; meanwhile a new request and /health are 503 with
    Retry-After, /metrics is 200; outcomes add up to the accepted requests; all KV is free; the
    server thread exits."""
    eng = FakeEngine(step_time_s=0.01, max_model_len=8192, kv_tokens=16384)
    with OpsLiveServer(eng, OpsConfig(shutdown_timeout_s=60.0, log_access=False)) as srv:
        results: list = []
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream, args=(srv.url, n, results, ev))
                   for n, ev in zip((20, 5000), started, strict=True)]
        for t in threads:
            t.start()
        assert all(ev.wait(WAIT_S) for ev in started)
        t0 = time.monotonic()
        srv.shutdown()
        while not srv.app.state.drain.draining:
            time.sleep(0.005)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)
        assert (r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) == (503, "1", "shutting_down")
        h = httpx.get(srv.url + "/health", timeout=WAIT_S)
        assert h.status_code == 503 and h.headers["retry-after"] == "1"
        m = httpx.get(srv.url + "/metrics", timeout=WAIT_S)
        assert m.status_code == 200
        assert 'stallfree_requests_refused_total{model_name="fake-model",reason="shutting_down"} 1.0' in m.text
        threads[0].join(WAIT_S)  # the short one finishes while draining
        assert not threads[0].is_alive() and threads[1].is_alive()
        srv.shutdown()  # a second signal: abort the rest now
        threads[1].join(WAIT_S)
        srv.join()
        took = time.monotonic() - t0
    # Told apart by how they ended, not by their number of events: under load the server may send a
    # stream's tokens in fewer, larger events, so the aborted long stream can hold fewer events.
    by_end = sorted(results, key=lambda r: "error" in r[1][-2])
    (s1, short), (s2, long_) = by_end
    assert (s1, s2) == (200, 200)
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long_[-1] == "[DONE]" and "shut down before this request finished" in long_[-2]["error"]["message"]
    assert took < 10.0  # not the 60 s timeout
    assert outcomes(srv.app) == {"stop": 0.0, "length": 1.0, "abort": 1.0, "error": 0.0}
    assert len(eng.added) == 2  # the refused request never reached the engine
    s = srv.app.state.drain.summary
    assert (s["finished"], s["aborted"], s["refused"], s["in_flight_left"]) == (1.0, 1.0, 1.0, 0.0)


def test_drain_with_nothing_in_flight_ends_at_once(caplog):
    """With no request in flight the drain takes well under its timeout; the requests served before
    the signal (2 here) are counted as such, not lost in a bare "0 finished"."""
    with OpsLiveServer(FakeEngine(), OpsConfig(shutdown_timeout_s=30.0, log_access=False)) as srv:
        for _ in range(2):
            assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              timeout=WAIT_S).status_code == 200
        t0 = time.monotonic()
        with caplog.at_level("INFO", logger="stallfree.server"):
            srv.shutdown()
            srv.join()
        assert time.monotonic() - t0 < 5.0
        s = srv.app.state.drain.summary
        assert (s["served_before"], s["finished"], s["aborted"]) == (2.0, 0.0, 0.0)
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("shutdown: drained"))
        assert ": 2 served before the signal; during the drain 0 finished, 0 aborted" in line


def test_drain_options_are_checked():
    """A negative timeout or a non-integer Retry-After is refused naming the value."""
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0, got -1"):
        Drain(-1)
    with pytest.raises(ValueError, match="retry_after_s must be an integer >= 0, got 1.5"):
        Drain(1.0, retry_after_s=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shutdown_timeout_s must be a number of seconds >= 0, got -2"):
        OpsConfig(shutdown_timeout_s=-2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVE), "--port", str(port), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_under_load_drains_and_exits_0():
    """A server process under load (8 streams, 4 short, 4 too long for --shutdown-timeout 1.5) gets
    SIGTERM: the 4 short ones finish, the 4 long ones are aborted, requests sent meanwhile are refused
    503; the process exits 0 with every accepted request counted once and all KV returned."""
    proc, url = _start("--shutdown-timeout", "1.5", "--step-time", "0.01")
    try:
        results: list = []
        started = [threading.Event() for _ in range(8)]
        threads = [threading.Thread(target=_stream, args=(url, 40 if i % 2 else 20_000 // 8, results, started[i]))
                   for i in range(8)]
        for t in threads:
            t.start()
        assert all(ev.wait(WAIT_S) for ev in started)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while httpx.get(url + "/health", timeout=WAIT_S).status_code != 503:  # the signal has arrived
            assert time.monotonic() < deadline
            time.sleep(0.01)
        codes = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)
            codes.append((r.status_code, r.headers.get("retry-after")))
            time.sleep(0.1)
        for t in threads:
            t.join(30)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    final = json.loads(out.strip().splitlines()[-1])
    assert final["kv_free"] == final["kv_total"] and final["unfinished"] is False
    assert sum(final["outcomes"].values()) == final["added"]
    finished = [ev for code, ev in results if ev[-2].get("choices")]
    aborted = [ev for code, ev in results if "error" in ev[-2]]
    assert (len(finished), len(aborted), len(results)) == (4, 4, 8)
    refused = len(codes)
    assert refused >= 1 and set(codes) == {(503, "1")}  # the socket still listens; every new request is refused
    s = final["summary"]
    assert (s["finished"], s["aborted"], s["refused"]) == (4.0, 4.0, float(refused))
    assert "shutdown: drained in" in err and "during the drain 4 finished, 4 aborted at the deadline" in err


@pytest.mark.slow
def test_sigint_when_idle_exits_0_quickly():
    """SIGINT (Ctrl-C) on an idle server: it exits 0 within a few seconds, not after the timeout."""
    proc, url = _start("--shutdown-timeout", "30")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert time.monotonic() - t0 < 10.0
    assert json.loads(out.strip().splitlines()[-1])["summary"]["finished"] == 0.0
