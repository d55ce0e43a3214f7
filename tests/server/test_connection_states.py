"""Every state a connection can idle in has a deadline: a response sent before its request's body
arrived closes the connection (otherwise one more body byte leaves it open for good, past the read and
keep-alive timeouts, and such sockets hold --limit-concurrency against every client); a client that
stops reading a response is dropped after the read timeout."""

from __future__ import annotations

import asyncio
import socket

import httpx
import uvicorn
from uvicorn.server import ServerState

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S
from server.ops_helpers import OpsLiveServer, read_until_closed
from stallfree.server.limits import header_timeout_protocol
from stallfree.server.options import OpsConfig

KEY = "sk-test-7f3a"
# Answers that never read the body: an open probe, the metrics, a keyed route, a 401, a 404, a 405.
UNREAD = [b"GET /health", b"GET /metrics", b"GET /v1/models", b"POST /v1/completions", b"GET /nope",
          b"DELETE /health"]


def _hold(srv: OpsLiveServer, request_line: bytes, key: bool) -> tuple[socket.socket, bytes]:
    """Send `request_line` declaring a 1 GB body, read the answer's head, then send one body byte."""
    sock = srv.connect()
    auth = f"Authorization: Bearer {KEY}\r\n".encode() if key else b""
    sock.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 1000000000\r\n\r\n")
    sock.settimeout(WAIT_S)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            break
        head += chunk
    try:
        sock.sendall(b"x")
    except OSError:
        pass  # already closed: fine
    return sock, head


def test_unread_body_closes_the_connection_and_limit_concurrency_is_not_held():
    """Under --limit-concurrency 6 with a key, 5 sockets each answered without its body being read
    (one of each kind) and then sent one more byte are closed by the server, each answer saying
    `Connection: close`; a keyed client is then served (it got 503 for as long as they were open)."""
    n = len(UNREAD)
    ops = OpsConfig(api_key=KEY, limit_concurrency=n, request_read_timeout_s=30.0, timeout_keep_alive_s=30.0,
                    log_access=False)
    with OpsLiveServer(FakeEngine(), ops) as srv:
        held = [_hold(srv, line, key=line != b"POST /v1/completions") for line in UNREAD[: n - 1]]
        try:
            statuses = [head.split(b" ", 2)[1] for _, head in held]
            assert statuses == [b"200", b"200", b"200", b"401", b"404"]
            for _, head in held:
                assert b"\r\nconnection: close\r\n" in head.lower()
            # Each connection ends now, long before the 30 s timeouts (read_until_closed gives up at WAIT_S).
            for sock, _ in held:
                read_until_closed(sock, limit_s=WAIT_S)
                sock.settimeout(0.5)
                assert sock.recv(1) == b""
            r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
        finally:
            for sock, _ in held:
                sock.close()


def test_method_not_allowed_with_a_body_closes_the_connection():
    """The sixth kind on its own: a 405 answered without reading the declared body closes too."""
    with OpsLiveServer(FakeEngine(), OpsConfig(log_access=False)) as srv:
        sock, head = _hold(srv, UNREAD[-1], key=False)
        with sock:
            assert head.startswith(b"HTTP/1.1 405 ") and b"\r\nconnection: close\r\n" in head.lower()
            read_until_closed(sock, limit_s=WAIT_S)
            sock.settimeout(0.5)
            assert sock.recv(1) == b""


def test_a_kept_alive_connection_whose_body_was_read_stays_open():
    """The fix closes only connections with body left unread: a completion whose body was read keeps
    its connection for the next request."""
    with OpsLiveServer(FakeEngine(), OpsConfig(log_access=False)) as srv, httpx.Client(base_url=srv.url) as c:
        bodies = [c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
                  for _ in range(2)]
        assert [r.status_code for r in bodies] == [200, 200]
        assert all(r.headers.get("connection") != "close" for r in bodies)
        assert bodies[0].json()["choices"][0]["text"] == bodies[1].json()["choices"][0]["text"]


class _Transport:
    """The little of an asyncio transport the protocol touches; records abort()."""

    def __init__(self) -> None:
        self.aborted = False
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_client_that_stops_reading_is_dropped_after_the_read_timeout():
    """While the send buffer is full (pause_writing) and the client reads nothing, the connection is
    aborted after the read timeout (50 ms here); one that drains in time (resume_writing) is kept."""

    async def go() -> tuple[bool, bool, int]:
        config = uvicorn.Config(app=lambda *a: None, lifespan="off")
        cls = header_timeout_protocol(0.05)
        stalled, drained = _Transport(), _Transport()
        loop = asyncio.get_running_loop()
        protos = [cls(config=config, server_state=ServerState(), app_state={}, _loop=loop) for _ in range(2)]
        for proto, transport in zip(protos, (stalled, drained), strict=True):
            proto.connection_made(transport)  # type: ignore[arg-type]
            proto._disarm()  # only the write timer is under test
            proto.pause_writing()
        protos[1].resume_writing()
        await asyncio.sleep(0.3)
        for proto in protos:
            proto.connection_lost(None)
        return stalled.aborted, drained.aborted, protos[0].num_write_timeouts

    assert asyncio.run(go()) == (True, False, 1)
