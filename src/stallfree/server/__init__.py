"""The OpenAI-compatible server: HTTP routes, server-sent events, Prometheus metrics and the async
engine loop that steps an LLMEngine in a worker thread.

Imports allowed: the standard library, fastapi/starlette, uvicorn (cli only), prometheus_client,
pydantic, and stallfree.engine (duck-typed; imported only when a real engine is served).
"""

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
