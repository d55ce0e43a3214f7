"""The OpenAI-compatible server: HTTP routes, server-sent events, Prometheus metrics and the async
engine loop that steps an LLMEngine in a worker thread.

Imports allowed: the standard library, fastapi/starlette, uvicorn (cli only), prometheus_client,
pydantic, and stallfree.engine (duck-typed; imported only when a real engine is served).

The public names are loaded on first use (PEP 562 module __getattr__), so that importing
`stallfree.server.cli` to register `serve` does not import FastAPI and pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stallfree.server.app import ServerConfig, create_app
    from stallfree.server.async_engine import AsyncEngine, EngineDead, QueueFull, RequestStream, StepFailed
    from stallfree.server.prometheus import ServerMetrics

__all__ = [
    "AsyncEngine",
    "EngineDead",
    "QueueFull",
    "RequestStream",
    "ServerConfig",
    "ServerMetrics",
    "StepFailed",
    "create_app",
]

# Where each public name lives.
_HOME = {
    "AsyncEngine": "stallfree.server.async_engine",
    "EngineDead": "stallfree.server.async_engine",
    "QueueFull": "stallfree.server.async_engine",
    "RequestStream": "stallfree.server.async_engine",
    "StepFailed": "stallfree.server.async_engine",
    "ServerConfig": "stallfree.server.app",
    "create_app": "stallfree.server.app",
    "ServerMetrics": "stallfree.server.prometheus",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'stallfree.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
