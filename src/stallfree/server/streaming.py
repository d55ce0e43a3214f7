"""Server-sent events: the OpenAI chunk objects, their `data:` framing, and a response that aborts the
request when the client goes away.

Imports allowed: the standard library and starlette.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["DONE", "SSEResponse", "completion_chunk", "sse", "usage_dict"]

DONE = "data: [DONE]\n\n"


#: Characters a client may take for the end of a line that JSON leaves unescaped: NEL, LINE SEPARATOR and
#: PARAGRAPH SEPARATOR (Python's str.splitlines and httpx's line reader split on them; JSON escapes every
#: control character below U+0020 itself). Escaped, a generated token holding one cannot cut an event in two.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse(obj: dict[str, Any]) -> str:
    """Frame one JSON object as a server-sent event (`data: {...}` and a blank line): UTF-8 text as is,
    except the characters that line readers other than the SSE specification's split on (escaped)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object (token counts); with prefix caching, prompt_tokens_details.cached_tokens."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    chat: bool,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """One streamed chunk with one choice.

    Args:
        chat: a chat.completion.chunk (delta) rather than a text_completion (text).
        text: the new text; for chat, None leaves `content` out of the delta.
        role: put role "assistant" in the delta (the first chat chunk).
        with_usage_field: include "usage": null (when the client asked for a final usage chunk).
    """
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None}
    choice["finish_reason"] = finish_reason
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose body iterator is always closed, so that a client that
    disconnects mid-stream (cancelled body, or a send that fails) has its request aborted at once
    by the iterator's cleanup rather than whenever the generator is garbage collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
