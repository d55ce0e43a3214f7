"""Helpers of the operator-option tests: an app with install_ops over the fake engine, in process
(httpx ASGITransport) or under the GracefulServer on 127.0.0.1 (port 0) in a background thread; raw
sockets for clients that send slowly; the outcome counters."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, assert_all_free, make_config, wait_idle
from stallfree.server import create_app
from stallfree.server.ops import install_ops, make_server
from stallfree.server.options import OpsConfig


def ops_app(engine: FakeEngine, ops: OpsConfig, **config: Any) -> Any:
    """create_app over `engine` with the fake SamplingParams, then install_ops."""
    app = create_app(engine, make_config(**config))
    install_ops(app, ops)
    return app


@contextlib.asynccontextmanager
async def ops_client(engine: FakeEngine, ops: OpsConfig, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process httpx client of ops_app; on exit, checks that all KV is free."""
    app = ops_app(engine, ops, **config)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
            await wait_idle(app, engine)
            assert_all_free(engine)
    finally:
        await app.state.server.async_engine.stop()


def outcomes(app: Any) -> dict[str, float]:
    """stallfree_request_success_total by finished_reason."""
    reg = app.state.server.metrics.registry
    return {r: reg.get_sample_value("stallfree_request_success_total",
                                    {"model_name": "fake-model", "finished_reason": r}) or 0.0
            for r in ("stop", "length", "abort", "error")}


class OpsLiveServer:
    """The GracefulServer serving ops_app on 127.0.0.1 (a free port) in a background thread.

    Signals reach only the main thread, so tests start a drain with shutdown(); leaving the block
    drains too (if the test did not) and waits for the thread, bounded.
    """

    def __init__(self, engine: FakeEngine, ops: OpsConfig, **config: Any) -> None:
        self.engine = engine
        self.app = ops_app(engine, ops, **config)
        self.server = make_server(self.app, "127.0.0.1", 0, ops, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> OpsLiveServer:
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def shutdown(self) -> None:
        """Begin the graceful shutdown, as SIGTERM does."""
        self.server.shutdown_gracefully()

    def join(self, timeout_s: float = WAIT_S) -> None:
        """Wait for the server thread to end; fail if it does not within timeout_s seconds."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the server did not exit within {timeout_s} s"

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.shutdown()
            self.join()
        if exc[0] is None:
            assert_all_free(self.engine)

    def connect(self) -> socket.socket:
        """A raw TCP connection to the server."""
        return socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S)


def read_until_closed(sock: socket.socket, limit_s: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection (bounded by limit_s seconds)."""
    sock.settimeout(limit_s)
    got = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not chunk:
            break
        got += chunk
    return got
