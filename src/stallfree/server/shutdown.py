"""Graceful shutdown: on SIGTERM or SIGINT the server keeps listening but refuses new requests (503
with Retry-After, /health 503 too, so a load balancer takes it out), lets the requests in flight
finish for up to a deadline, then aborts the rest and exits with status 0.

Every request the engine accepted ends in exactly one counted outcome (stallfree_request_success_total:
stop or length when it finished, abort when the deadline cut it, as when a client leaves), every
request that arrived during the drain is counted refused (stallfree_requests_refused_total), and the
engine's KV is all returned (AsyncEngine.stop aborts what is left in the engine). One log line at the
end says how many were served before the signal and, during the drain, how many finished, were
aborted and were refused.

A second signal cuts the wait (the rest is aborted at once); a third is uvicorn's own forced exit.

Sources: Kubernetes' pod termination (SIGTERM, then SIGKILL after terminationGracePeriodSeconds,
30 s by default: hence the default deadline); RFC 9110 section 15.6.4 (503) and section 10.2.3
(Retry-After, in seconds).

Imports allowed: the standard library, uvicorn, prometheus_client and stallfree.server.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable, MutableMapping
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client import Counter

from stallfree.server.options import ServerConfigError
from stallfree.server.protocol import error_body

__all__ = ["Drain", "DrainGate", "GracefulServer"]

logger = logging.getLogger("stallfree.server")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths that never count as work in flight: probes and scrapes go on during a drain.
_PROBES = ("/health", "/metrics")
# After the deadline's aborts, how long the aborted requests' last bytes (an error event, a 503) may
# take to go out before the server closes, in seconds.
_FLUSH_S = 5.0
_POLL_S = 0.05
# The shutdown's log lines belong to no request: the signal handler may run in the middle of one, whose
# id would otherwise be the current one (RequestIdFilter keeps a request_id given here).
_NO_REQUEST = {"request_id": "-"}


class Drain:
    """The shutdown state that the gate, the server and the app share.

    Owns the draining flag and the count of HTTP requests in flight (every request past the gate
    except /health and /metrics); it never touches the engine itself: drain() calls
    AsyncEngine.stop() once the deadline passes.

    Args:
        timeout_s: seconds the requests in flight may take to finish once draining starts (>= 0).
        retry_after_s: the Retry-After of a 503 while draining, in whole seconds (>= 0).
        clock: time source, seconds (time.monotonic).

    Raises:
        ServerConfigError (a ValueError): timeout_s or retry_after_s is negative or not a number (the message names it).
    """

    def __init__(self, timeout_s: float = 30.0, retry_after_s: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(timeout_s, int | float) or not timeout_s >= 0:
            raise ServerConfigError(f"shutdown timeout_s must be a number of seconds >= 0, got {timeout_s!r}")
        if isinstance(retry_after_s, bool) or not isinstance(retry_after_s, int) or retry_after_s < 0:
            raise ServerConfigError(f"retry_after_s must be an integer >= 0, got {retry_after_s!r}")
        self.timeout_s = float(timeout_s)
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.draining = False
        self.cut = False  # a second signal: abort now
        self.in_flight = 0
        self.num_refused = 0
        self.refused: Counter | None = None
        self.summary: dict[str, float] = {}

    def bind_metrics(self, registry: Any, model_name: str) -> None:
        """Register stallfree_requests_refused_total{model_name, reason} in the app's registry."""
        self.refused = Counter("stallfree_requests_refused", "Requests refused before they reached the engine "
                               "(reason shutting_down: during a graceful shutdown).",
                               ["model_name", "reason"], registry=registry)
        self._model_name = model_name
        self.refused.labels(model_name, "shutting_down")

    def count_refused(self) -> None:
        """Count one request refused while draining."""
        self.num_refused += 1
        if self.refused is not None:
            self.refused.labels(self._model_name, "shutting_down").inc()

    async def drain(self, state: Any) -> dict[str, float]:
        """Wait for the requests in flight (bounded by timeout_s, or a cut), abort the rest, let their
        answers go out (bounded), and return the summary that is also logged.

        Args:
            state: the app's shared state (app.state.server): its async_engine and metrics are read.

        Returns:
            {"drain_s", "served_before", "finished", "aborted", "client_left", "errors", "refused",
            "in_flight_left"}: seconds; served_before counts the requests that finished (stop, length)
            before the signal, the others count requests that ended, were refused or were still in
            flight during the drain.
        """
        self.draining = True
        t0 = self.clock()
        before = _outcomes(state)
        deadline = t0 + self.timeout_s
        while self.in_flight > 0 and self.clock() < deadline and not self.cut:
            await asyncio.sleep(_POLL_S)
        at_deadline = _outcomes(state)
        # Every live request ends "abort"; the engine's KV is returned; later adds get EngineDead (503).
        await state.async_engine.stop(outcome="abort", message="the server shut down before this request "
                                      f"finished (--shutdown-timeout {self.timeout_s:g} s)")
        num_cut = _outcomes(state)["abort"] - at_deadline["abort"]
        flush_end = self.clock() + _FLUSH_S
        while self.in_flight > 0 and self.clock() < flush_end:
            await asyncio.sleep(_POLL_S)
        after = _outcomes(state)
        done = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        self.summary = {
            "drain_s": round(self.clock() - t0, 3),
            "served_before": before.get("stop", 0.0) + before.get("length", 0.0),
            "finished": done.get("stop", 0.0) + done.get("length", 0.0),
            "aborted": float(num_cut),
            "client_left": done.get("abort", 0.0) - num_cut,
            "errors": done.get("error", 0.0),
            "refused": float(self.num_refused),
            "in_flight_left": float(self.in_flight),
        }
        s = self.summary
        logger.info("shutdown: drained in %.2f s: %d served before the signal; during the drain %d finished, "
                    "%d aborted at the deadline, %d refused (503), %d left by their clients, %d failed",
                    s["drain_s"], s["served_before"], s["finished"], s["aborted"], s["refused"],
                    s["client_left"], s["errors"], extra=_NO_REQUEST)
        return self.summary


def _outcomes(state: Any) -> dict[str, float]:
    """The outcome counters (stallfree_request_success_total by finished_reason) as plain numbers."""
    reg = state.metrics.registry
    name = state.names[0]
    return {r: reg.get_sample_value("stallfree_request_success_total",
                                    {"model_name": name, "finished_reason": r}) or 0.0
            for r in ("stop", "length", "abort", "error")}


class DrainGate:
    """Refuse requests while draining (503, Retry-After; /health too) and count those in flight.

    Args:
        app: the ASGI app.
        drain: the shared Drain.
    """

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, counting it, unless draining."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        d = self.drain
        if d.draining and path != "/metrics":
            if path != "/health":
                d.count_refused()
            body = json.dumps(error_body("the server is shutting down and takes no new requests; retry "
                                         "(on another replica if there is one)", "server_error", None,
                                         "shutting_down")).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(d.retry_after_s).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        if path in _PROBES:
            await self.app(scope, receive, send)
            return
        d.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            d.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's Server with a drain before uvicorn's own shutdown.

    The first SIGTERM or SIGINT starts Drain.drain on the event loop (the listening socket stays open,
    the gate answers 503); when it returns the server exits as uvicorn does, with status 0 (the
    signal is not re-raised). A second signal cuts the drain's wait; a third is uvicorn's handler
    (forced exit). shutdown() does the same as the first signal, for callers without signals.

    Args:
        config: the uvicorn Config.
        drain: the Drain the app's gate shares.
        state: the app's shared state (app.state.server).
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, state: Any) -> None:
        super().__init__(config)
        self.drain = drain
        self.state = state
        self.num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[Any] | None = None

    async def serve(self, sockets: Any = None) -> None:
        """Serve as uvicorn does, remembering the loop the signal handler hands the drain to."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): begin the drain; a second signal cuts it; a third is uvicorn's."""
        self.num_signals += 1
        if self.num_signals >= 3 or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if self.num_signals == 2:
            self.drain.cut = True
            return
        self.drain.draining = True  # at once, before the loop runs the drain: no request slips in
        self._loop.call_soon_threadsafe(self._begin, signal.Signals(sig).name, context=contextvars.Context())

    def shutdown_gracefully(self) -> None:
        """From any thread, do what a SIGTERM does: the first call begins the drain, a second cuts it."""
        self.handle_exit(signal.SIGTERM, None)

    def _begin(self, why: str) -> None:
        if self._drain_task is not None:
            return
        logger.info("shutdown: %s received; refusing new requests, waiting up to %g s for %d in flight",
                    why, self.drain.timeout_s, self.drain.in_flight, extra=_NO_REQUEST)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit(),
                                                                  context=contextvars.Context())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.drain(self.state)
        except Exception:  # noqa: BLE001 - a bug in the drain must not keep the server up forever
            logger.exception("shutdown: the drain failed; exiting", extra=_NO_REQUEST)
        self.should_exit = True
