"""What an operator sets around the API: the API key, the graceful shutdown, request ids and the
connection limits; install_ops puts them on an app, run_server serves it with uvicorn.

The layers, outermost first: RequestIdMiddleware (every answer, a 401, 408 or 503 included, carries
X-Request-Id and gets an access line), DrainGate (503 while shutting down), ApiKeyMiddleware (401),
BodyReadTimeout (408), then the app. Under uvicorn the h11 protocol with a header deadline
(HeaderTimeoutH11Protocol) reads the requests, and GracefulServer drains on SIGTERM/SIGINT.

Sources: vLLM's `--api-key`; uvicorn's `--limit-concurrency` and `--timeout-keep-alive` (5 s is vLLM's
default); see auth.py, shutdown.py, limits.py and request_id.py for each part's.

Imports allowed: the standard library, uvicorn, fastapi/starlette and stallfree.server.
"""

from __future__ import annotations

from typing import Any

from stallfree.server.auth import ApiKeyMiddleware
from stallfree.server.limits import BodyReadTimeout, header_timeout_protocol
from stallfree.server.options import OpsConfig, ServerConfigError
from stallfree.server.request_id import RequestIdMiddleware
from stallfree.server.shutdown import Drain, DrainGate, GracefulServer

__all__ = ["OpsConfig", "install_ops", "make_server", "run_server"]


def install_ops(app: Any, ops: OpsConfig) -> Drain:
    """Add the operator layers to a stallfree app (from create_app); return its Drain (also
    app.state.drain), whose stallfree_requests_refused_total goes into the app's /metrics."""
    drain = Drain(ops.shutdown_timeout_s)
    state = app.state.server
    drain.bind_metrics(state.metrics.registry, state.names[0])
    app.state.drain = drain
    # add_middleware puts each new layer outside the ones before it: innermost first.
    app.add_middleware(BodyReadTimeout, timeout_s=ops.request_read_timeout_s)
    if ops.api_key is not None or ops.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_key=ops.api_key, protect_metrics=ops.protect_metrics,
                           tenants=ops.api_keys)
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(RequestIdMiddleware, log_access=ops.log_access)
    return drain


def make_server(app: Any, host: str, port: int, ops: OpsConfig, log_level: str = "info") -> GracefulServer:
    """A GracefulServer for an app that install_ops prepared, with the h11 header deadline, the
    keep-alive timeout and the concurrency limit of `ops` (uvicorn's access log off: ours has the id).

    Raises:
        ServerConfigError (a ValueError): install_ops was not called on `app` (it has no drain).
    """
    import uvicorn

    drain = getattr(app.state, "drain", None)
    if not isinstance(drain, Drain):
        raise ServerConfigError("make_server needs an app prepared by install_ops(app, ops)")
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, ws="none", lifespan="on",
        http=header_timeout_protocol(ops.request_read_timeout_s),
        timeout_keep_alive=ops.timeout_keep_alive_s,  # seconds; uvicorn types it int but takes a float
        limit_concurrency=ops.limit_concurrency, timeout_graceful_shutdown=int(_FLUSH_AFTER_S),
    )
    return GracefulServer(config, drain, app.state.server)


# uvicorn's own wait for connections after our drain, in seconds (our drain already let them finish).
_FLUSH_AFTER_S = 5


def run_server(app: Any, host: str, port: int, ops: OpsConfig, log_level: str = "info") -> int:
    """Serve `app` until a signal and its drain end it; return 0 (the exit status of a clean drain)."""
    make_server(app, host, port, ops, log_level).run()
    return 0
