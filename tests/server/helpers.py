"""Shared helpers of the server tests: an in-process client (httpx ASGITransport) and a live uvicorn
on 127.0.0.1 (port 0), both over the fake engine, each checking at the end that all KV came back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn

from server.fake_engine import FakeEngine, FakeSamplingParams
from stallfree.server import ServerConfig, create_app

# Bounded waits: every poll loop in these tests gives up after this many seconds.
WAIT_S = 10.0


def make_config(**kw: Any) -> ServerConfig:
    """A ServerConfig with the fake SamplingParams and no stats log."""
    kw.setdefault("sampling_params_cls", FakeSamplingParams)
    kw.setdefault("log_interval_s", 0.0)
    return ServerConfig(**kw)


def assert_all_free(engine: FakeEngine) -> None:
    """The engine holds no request and every KV token is free."""
    assert not engine.has_unfinished()
    assert engine.scheduler.kv_free == engine.scheduler.stats().kv_total


async def wait_idle(app: Any, engine: FakeEngine) -> None:
    """Wait (bounded) until the loop serves nothing and the engine is empty."""
    aeng = app.state.server.async_engine
    deadline = time.monotonic() + WAIT_S
    while aeng.num_live or engine.has_unfinished() or aeng._aborts:
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {WAIT_S} s: live {aeng.num_live}")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def asgi_client(
    engine: FakeEngine, check_free: bool = True, **config: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client calling the app in process; on exit, checks that all KV is free (unless the
    test killed the engine on purpose: check_free=False)."""
    app = create_app(engine, make_config(**config))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
            if check_free:
                await wait_idle(app, engine)
                assert_all_free(engine)
    finally:
        await app.state.server.async_engine.stop()


def run(coro: Any) -> Any:
    """Run a coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


class LiveServer:
    """uvicorn serving the app on 127.0.0.1 with a free port, in a background thread."""

    def __init__(self, engine: FakeEngine, **config: Any) -> None:
        self.engine = engine
        self.app = create_app(engine, make_config(**config))
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", ws="none",
                             lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_idle(self) -> None:
        """Wait (bounded) until the engine is empty, from the test thread."""
        aeng = self.app.state.server.async_engine
        deadline = time.monotonic() + WAIT_S
        while aeng.num_live or self.engine.has_unfinished():
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {WAIT_S} s")
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait_idle()
                assert_all_free(self.engine)
        finally:
            self.server.should_exit = True
            self.thread.join(WAIT_S)


def sse_events(body: str) -> list[Any]:
    """Parse an SSE body into JSON objects, with the string "[DONE]" for the terminator."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
