"""Connection limits uvicorn does not have: a deadline for reading a request's headers and one for its
body, so that a client sending a byte at a time (a "slowloris") holds a connection for at most the
deadline and never stalls the other streams.

- Headers: HeaderTimeoutH11Protocol, uvicorn's h11 protocol with a timer from a request's first byte
  (or from the connection's opening) until its headers are parsed; when it fires the server writes
  408 Request Timeout with `Connection: close` and closes the connection.
- Body: BodyReadTimeout, an ASGI middleware giving the app's body reads a deadline counted from the
  moment the headers were parsed; when it passes, the app sees the client as gone, and the client
  gets 408 with `Connection: close` (unless a response had started).

So a request may take up to twice the timeout to arrive: the headers within it, then the body within
it. Idle keep-alive connections are uvicorn's --timeout-keep-alive; --limit-concurrency is uvicorn's
cap on connections (503 past it).

Every state a connection can idle in has a deadline:

- before a request's headers are in: the header timer (above);
- while the app reads the body: BodyReadTimeout (above);
- after a response, between requests: uvicorn's keep-alive timer. uvicorn cancels it on any byte and
  re-arms nothing while h11 still expects the body of the request answered, so a response that
  completes before its request's body has arrived (a 401, 404, 405, /health, /metrics, /v1/models,
  uvicorn's own 503 past --limit-concurrency: answers that never read the body) is sent with
  `Connection: close` and the connection is closed after it (RFC 9112 section 9.6);
- while a response is being sent to a client that reads nothing (the send buffer full): the write
  timer; after the read timeout without progress the connection is aborted.

Sources: RFC 9110 section 15.5.9 (408 Request Timeout, "the server did not receive a complete request
message within the time that it was prepared to wait", with the "close" connection option); the
slowloris attack and the defence of Apache's mod_reqtimeout (a header and a body timeout) and nginx's
client_header_timeout / client_body_timeout (60 s each).

Imports allowed: the standard library, h11, uvicorn, stallfree.server.options and stallfree.server.protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from stallfree.server.options import ServerConfigError
from stallfree.server.protocol import error_body

__all__ = ["BodyReadTimeout", "HeaderTimeoutH11Protocol", "header_timeout_protocol"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _timeout_body(what: str, timeout_s: float) -> bytes:
    return json.dumps(error_body(f"the request's {what} did not arrive within {timeout_s:g} s "
                                 "(--request-read-timeout)", "invalid_request_error", None,
                                 "request_timeout")).encode()


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers (header_timeout_s seconds).

    The timer starts when the connection opens and again with the first byte of each later request
    on it; it stops when the headers are parsed. Between requests an idle keep-alive connection is
    uvicorn's own timeout_keep_alive. A response that starts before its request's body has arrived
    carries `Connection: close` and the connection closes after it; a client that reads nothing of a
    response for header_timeout_s seconds while the send buffer is full is dropped
    (num_write_timeouts counts them). Use header_timeout_protocol(s) to get a class with s set.
    """

    header_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self.num_write_timeouts = 0

    def connection_made(self, transport: Any) -> None:
        """uvicorn's, then start the header timer (a connection that sends nothing is bounded too)."""
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Start the timer on a new request's first byte; stop it once its headers are parsed."""
        idle_between = self.cycle is None or self.cycle.response_complete
        if self._header_timer is None and self.conn.their_state is h11.IDLE and idle_between:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in; the body's deadline is BodyReadTimeout's

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timers, then uvicorn's."""
        self._disarm()
        self._disarm_write()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        """uvicorn's; then make a new request's response close the connection when it starts before the
        request's body has all arrived (the app answered without reading it)."""
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not getattr(cycle, "_stallfree_close_unread", False):
            cycle._stallfree_close_unread = True  # type: ignore[attr-defined]
            send = cycle.send
            conn = self.conn

            async def send_closing_if_unread(message: Any) -> None:
                if message["type"] == "http.response.start" and conn.their_state is h11.SEND_BODY:
                    headers = list(message.get("headers", ()))
                    if not any(k.lower() == b"connection" and v.lower() == b"close" for k, v in headers):
                        message = {**message, "headers": [*headers, (b"connection", b"close")]}
                await send(message)

            cycle.send = send_closing_if_unread  # type: ignore[method-assign]

    def on_response_complete(self) -> None:
        """Close the connection when the request's body has not all arrived (nothing would bound the
        wait for the rest: uvicorn's keep-alive timer stops at the next byte); else uvicorn's."""
        if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
        super().on_response_complete()

    def pause_writing(self) -> None:
        """uvicorn's, and start the write timer: a client that reads nothing for header_timeout_s seconds
        while the send buffer is full is dropped (abort: close() would wait for the buffer to drain)."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.header_timeout_s, self._on_write_timeout)

    def resume_writing(self) -> None:
        """Stop the write timer, then uvicorn's."""
        self._disarm_write()
        super().resume_writing()

    def _on_write_timeout(self) -> None:
        self._write_timer = None
        self.num_write_timeouts += 1
        self.transport.abort()

    def _disarm_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:
            # h11 cannot send a response before it has a request, so the 408 is written as bytes.
            body = _timeout_body("headers", self.header_timeout_s)
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n".encode() + b"connection: close\r\n\r\n" + body)
        self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """A HeaderTimeoutH11Protocol subclass with header_timeout_s = timeout_s, for uvicorn.Config(http=...).

    Raises:
        ServerConfigError (a ValueError): timeout_s is not a number of seconds > 0 (the message gives the value).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ServerConfigError(f"request read timeout must be a number of seconds > 0, got {timeout_s!r}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": float(timeout_s)})


class BodyReadTimeout:
    """Give the app's reads of a request body a deadline: timeout_s seconds from the app's start.

    When the deadline passes before the last body chunk, the app's receive() returns
    `http.disconnect` (it stops as for a client that left), whatever it then sends is dropped, and
    the client gets 408 with `Connection: close` if no response had started. Reads after the body
    (waiting for a disconnect) have no deadline.

    Args:
        app: the ASGI app.
        timeout_s: seconds (> 0).
        clock: time source, seconds (time.monotonic).

    Raises:
        ServerConfigError (a ValueError): timeout_s is not a number of seconds > 0.
    """

    def __init__(self, app: ASGIApp, timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ServerConfigError(f"request read timeout must be a number of seconds > 0, got {timeout_s!r}")
        self.app = app
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.num_timeouts = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a deadline on its body reads."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = self.clock() + self.timeout_s
        body_done = False
        timed_out = False
        started = False

        async def timed_receive() -> MutableMapping[str, Any]:
            nonlocal body_done, timed_out
            if body_done or timed_out:
                return await receive() if not timed_out else {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), max(deadline - self.clock(), 0.0))
            except TimeoutError:
                timed_out = True
                self.num_timeouts += 1
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if timed_out:
                return  # the 408 below answers instead
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not timed_out:
                raise
        if timed_out and not started:
            body = _timeout_body("body", self.timeout_s)
            await send({"type": "http.response.start", "status": 408, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
