"""API keys: every /v1 route (and /metrics with protect_metrics) requires `Authorization: Bearer KEY`.

The check is a pure ASGI middleware, so that it runs before the body is read and for every route,
known or not (an unknown /v1 path is a 401 too, so the key guards the route list). The key is compared
in constant time (hmac.compare_digest of SHA-256 digests, so that neither the content nor the length of
the key leaks through timing), and it is never logged or echoed: the 401 body names what is wrong,
never what was sent.

Sources: vLLM's `--api-key` and its environment variable VLLM_API_KEY (here STALLFREE_API_KEY);
the Bearer scheme of RFC 6750 (section 2.1, the header; section 3, `WWW-Authenticate` on a 401, with
`error="invalid_token"` for a wrong key); the scheme name is case-insensitive (RFC 9110 section 11.1);
OpenAI's 401 error object (type "invalid_request_error", code "invalid_api_key").

With several keys (`serve --api-keys-file`), each key belongs to a tenant: the middleware leaves the tenant
of the key a request carries in its ASGI scope under stallfree.server.tenants.TENANT_SCOPE_KEY ("default"
for `--api-key`), for the route (Request.tenant) and the access log.

Imports allowed: the standard library, stallfree.core, stallfree.server.options, stallfree.server.tenants
and stallfree.server.protocol (the error body).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from stallfree.core.request import DEFAULT_TENANT
from stallfree.server.options import API_KEY_ENV, ServerConfigError, check_api_key, resolve_api_key
from stallfree.server.protocol import error_body
from stallfree.server.tenants import TENANT_SCOPE_KEY

__all__ = ["API_KEY_ENV", "ApiKeyMiddleware", "check_api_key", "resolve_api_key"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """Answer 401 to a request for a protected path without `Authorization: Bearer KEY`.

    Owns nothing but the key's digest; it never reads the body and never touches the engine.

    Args:
        app: the ASGI app it guards.
        api_key: the key (visible ASCII; see check_api_key), of the tenant "default"; or None with `tenants`.
        protect_metrics: also require the key for /metrics (Prometheus can send a bearer token).
        tenants: more keys, key -> tenant (serve --api-keys-file); each checked as api_key.

    Protected paths: /v1 and everything under it, and /metrics when protect_metrics; /health (and
    the OpenAPI schema) stay open, so that probes need no key.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, protect_metrics: bool = False,
                 tenants: Mapping[str, str] | None = None) -> None:
        keys = dict(tenants or {})
        if api_key is not None:
            keys[api_key] = DEFAULT_TENANT
        if not keys:
            raise ServerConfigError("ApiKeyMiddleware needs api_key or tenants")
        for key in keys:
            problem = check_api_key(key, "api_key")
            if problem is not None:
                raise ServerConfigError(problem)
        self.app = app
        # Digests only: a key is looked up by the SHA-256 of the token sent, never compared as text.
        self._tenants = {_digest(k.encode("ascii")): t for k, t in keys.items()}
        self._digest = next(iter(self._tenants))
        self.protect_metrics = protect_metrics

    def protects(self, path: str) -> bool:
        """True when `path` needs the key."""
        if path == "/v1" or path.startswith("/v1/"):
            return True
        return self.protect_metrics and (path == "/metrics" or path.startswith("/metrics/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on when its path is open or its key is right; else answer 401."""
        if scope["type"] != "http" or not self.protects(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        problem = self._problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        if problem[0] == "":
            scope[TENANT_SCOPE_KEY] = problem[1].decode()
            await self.app(scope, receive, send)
            return
        message, challenge = problem
        body = json.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge)]})
        await send({"type": "http.response.body", "body": body})

    def _problem(self, scope: Scope) -> tuple[str, bytes] | None:
        """("", the key's tenant) when the request carries a key; else (the 401 message, the WWW-Authenticate
        value)."""
        values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        if not values:
            return ("Missing API key: send the header `Authorization: Bearer <key>` (the server was started "
                    "with --api-key or STALLFREE_API_KEY)", b'Bearer realm="stallfree"')
        if len(values) > 1:
            return ("More than one Authorization header; send exactly one `Authorization: Bearer <key>`",
                    b'Bearer realm="stallfree", error="invalid_request"')
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return ("The Authorization header must use the Bearer scheme: `Authorization: Bearer <key>`",
                    b'Bearer realm="stallfree", error="invalid_request"')
        sent = _digest(token.strip())
        if len(self._tenants) == 1:
            if not hmac.compare_digest(sent, self._digest):
                return ("Incorrect API key provided", b'Bearer realm="stallfree", error="invalid_token"')
            return ("", next(iter(self._tenants.values())).encode())
        tenant = self._tenants.get(sent)
        if tenant is None:
            return ("Incorrect API key provided", b'Bearer realm="stallfree", error="invalid_token"')
        return ("", tenant.encode())
