"""Request ids: each HTTP request gets an id, taken from its `X-Request-Id` header when that is safe to
log, else generated; the id is returned in the response's `X-Request-Id` header, is the current id
of the logging records made while the request is served, and ends one access log line per request.

A client's id is kept when it is 1 to MAX_REQUEST_ID_CHARS visible ASCII characters (0x21-0x7E: no
spaces, no control characters, so that a log line cannot be forged with a newline); anything else is
replaced by a generated one (32 hex digits). The response body's `id` ("cmpl-...") stays the
server's own, as in OpenAI's API; the two differ on purpose.

Sources: the de facto `X-Request-Id` header (Heroku's router, nginx's $request_id, vLLM's
`--enable-request-id-headers`); log-injection is CWE-117.

Imports allowed: the standard library.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["MAX_REQUEST_ID_CHARS", "TENANT_SCOPE_KEY", "RequestIdFilter", "RequestIdMiddleware", "current_request_id",
           "valid_request_id"]

#: The ASGI scope key under which the API-key middleware leaves the tenant of the request's key
#: (stallfree.server.tenants); the access line names it.
TENANT_SCOPE_KEY = "stallfree.tenant"

#: The longest client request id kept, in characters.
MAX_REQUEST_ID_CHARS = 128

#: The id of the request being served in this context ("-" outside any request).
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("stallfree_request_id", default="-")

access_logger = logging.getLogger("stallfree.server.access")
logger = logging.getLogger("stallfree.server")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def valid_request_id(raw: bytes) -> str | None:
    """The id in an X-Request-Id header value, or None when it is empty, too long or not visible ASCII."""
    if not 1 <= len(raw) <= MAX_REQUEST_ID_CHARS or not all(0x21 <= b <= 0x7E for b in raw):
        return None
    return raw.decode("ascii")


class RequestIdFilter(logging.Filter):
    """Set `record.request_id` on every record (the current request's id, or "-"), for a log format
    with %(request_id)s; it never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Add the attribute; always True."""
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


class RequestIdMiddleware:
    """Give each HTTP request an id, return it as X-Request-Id and log one access line when it ends.

    The access line (logger "stallfree.server.access", INFO): `<id> <client> "<METHOD> <path>" <status>
    <seconds>s`, then ` tenant=<name>` when the request's API key belongs to a tenant (stallfree.server.tenants);
    status 0 when the client left before any response started. An exception out of the
    app before any response started is logged under the request's id and answered as a JSON 500 that
    carries the id (access status 500); after a response started it propagates.

    Args:
        app: the ASGI app.
        log_access: write the access line (off in tests that count log records).
    """

    def __init__(self, app: ASGIApp, log_access: bool = True) -> None:
        self.app = app
        self.log_access = log_access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request under its id."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v for k, v in scope.get("headers", ()) if k == b"x-request-id"]
        rid = (valid_request_id(given[0]) if len(given) == 1 else None) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        token = current_request_id.set(rid)
        status = 0
        start = time.perf_counter()

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode("ascii"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status != 0:
                raise  # a response had started: nothing else can be sent; the server drops the connection
            # A bug on some input: logged here, under this request's id, and answered as a JSON 500 with
            # the id (the framework's own handler, outside this layer, knew neither).
            logger.error("unhandled error in %s %s", scope.get("method", "-"),
                         str(scope.get("path", "-")).encode("unicode_escape").decode("ascii"), exc_info=exc)
            body = json.dumps({"error": {"message": f"internal server error ({type(exc).__name__}); the server "
                               "log has the details", "type": "server_error", "param": None, "code": None}}).encode()
            await send_with_id({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send_with_id({"type": "http.response.body", "body": body})
        finally:
            if self.log_access:
                client = scope.get("client")
                where = f"{client[0]}:{client[1]}" if client else "-"
                path = str(scope.get("path", "-")).encode("unicode_escape").decode("ascii")  # no forged lines
                tenant = scope.get(TENANT_SCOPE_KEY)
                if tenant is None:
                    access_logger.info('%s %s "%s %s" %d %.3fs', rid, where, scope.get("method", "-"), path,
                                       status, time.perf_counter() - start)
                else:  # a key's tenant (names from the keys file: no spaces or control characters checked)
                    access_logger.info('%s %s "%s %s" %d %.3fs tenant=%s', rid, where, scope.get("method", "-"),
                                       path, status, time.perf_counter() - start,
                                       str(tenant).encode("unicode_escape").decode("ascii"))
            current_request_id.reset(token)
