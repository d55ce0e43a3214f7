"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), /health and /metrics, over an
AsyncEngine.

Imports allowed: the standard library, fastapi/starlette, prometheus_client (through
stallfree.server.prometheus), stallfree.server and the torch-free stallfree.engine.outputs, .errors and
.inputs; the engine is an EngineClient (its typed view: info, stats, headroom, encode, ...), and
stallfree.engine.sampling is imported only to find SamplingParams when none is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from stallfree.core.request import DEFAULT_TENANT
from stallfree.engine.errors import ContextLengthExceeded, InvalidLoraAdapter, InvalidPrompt, UnknownLora
from stallfree.engine.inputs import check_token_ids
from stallfree.engine.outputs import EngineClient, LoraInfo
from stallfree.server.async_engine import AsyncEngine, EngineDead, QueueFull, RequestStream, StepFailed
from stallfree.server.body import (
    BodyError,
    BodyLimits,
    check_framing,
    check_json_content_type,
    min_tokens,
    short_repr,
)
from stallfree.server.prometheus import ServerMetrics
from stallfree.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from stallfree.server.streaming import DONE, SSEResponse, completion_chunk, sse, usage_dict
from stallfree.server.tenants import TENANT_SCOPE_KEY, TokenRateLimiter

__all__ = ["ServerConfig", "create_app"]

logger = logging.getLogger("stallfree.server")

# SamplingParams fields we may pass, for naming the parameter in a ValueError the engine raises.
_PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop",
                 "ignore_eos")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Server options.

    Args:
        served_model_names: names the API answers to (the first is reported); default: the
            engine's model_name.
        default_max_tokens: max_tokens of a request that sets none, in tokens; it is further
            bounded by the context length and the KV capacity left after the prompt. The reservation
            scheduler reserves KV for prompt + max_tokens, so this is what such a request reserves.
        max_waiting: the most requests waiting for admission; more are answered 429. None: unbounded.
        max_waiting_tokens: the most prompt tokens waiting to be prefilled (requests added and not yet at
            their first token); a request that would pass it is answered 429 (queue_full). None: unbounded.
        tenant_tokens_per_minute: each tenant's allowance of prompt + max_tokens tokens a minute
            (stallfree.server.tenants.TokenRateLimiter); past it a request is answered 429 (rate_limited,
            Retry-After). None: no limit.
        log_interval_s: seconds between stats log lines (0 disables).
        sampling_params_cls: the engine's SamplingParams class (default stallfree.engine.SamplingParams).
        max_request_bytes: the largest request body, in bytes; a larger one is answered 413 before it is
            parsed. Default 2 MiB: a 128k-token prompt of English text is about 0.5 MB as text, or about
            0.9 MB as a JSON list of token ids (about 7 bytes per id), so this leaves twice that room.
        prefix_cache_isolation: "none" (default): requests share cached prompt prefixes unless they
            send different `cache_salt` values (vLLM's field); "salt": every completion request must
            send a cache_salt (a 400 otherwise), so that a multi-tenant server never shares KV, nor
            tells through usage.prompt_tokens_details.cached_tokens, across tenants that do not share
            a salt (docs/server.md, "Prefix caching and the side channel").
    """

    served_model_names: tuple[str, ...] = ()
    default_max_tokens: int = 256
    max_waiting: int | None = 1024
    max_waiting_tokens: int | None = None
    tenant_tokens_per_minute: int | None = None
    log_interval_s: float = 10.0
    sampling_params_cls: Any = None
    max_request_bytes: int = 2 * 1024 * 1024
    prefix_cache_isolation: str = "none"


#: The values of ServerConfig.prefix_cache_isolation (and of serve --prefix-cache-isolation).
PREFIX_CACHE_ISOLATION = ("none", "salt")


def _error_response(body: dict[str, Any], status: int, headers: dict[str, str] | None) -> Response:
    """An error object as JSON with every non-ASCII character escaped, so that any text it quotes (a lone
    surrogate included) encodes: an error answer is never itself a plain-text 500."""
    content = json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return Response(content, status_code=status, headers=headers, media_type="application/json")


def _sampling_params_cls(config: ServerConfig) -> Any:
    if config.sampling_params_cls is not None:
        return config.sampling_params_cls
    from stallfree.engine import SamplingParams  # the real engine; optional until it is installed

    return SamplingParams


class _State:
    """What the routes share: the loop, metrics, names and limits."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.info = engine.info
        self.config = config
        self.names = config.served_model_names or (self.info.model_name,)
        self.metrics = ServerMetrics(self.names[0])
        self.async_engine = AsyncEngine(engine, max_waiting=config.max_waiting, observer=self.metrics,
                                        max_waiting_tokens=config.max_waiting_tokens)
        self.metrics.queued_by_tenant = self.async_engine.queued_tokens_by_tenant
        self.rate_limiter = (None if config.tenant_tokens_per_minute is None
                             else TokenRateLimiter(config.tenant_tokens_per_minute))
        self.params_cls = _sampling_params_cls(config)
        self.limits = BodyLimits(max_prompt_tokens=self.info.max_model_len)
        if config.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
            raise ValueError(f"prefix_cache_isolation must be one of {list(PREFIX_CACHE_ISOLATION)}, got "
                             f"{config.prefix_cache_isolation!r}")
        self.created = int(time.time())
        #: The served LoRA adapters by name (the engine's list, read again after each load and unload).
        self.loras: dict[str, LoraInfo] = {}
        if self.info.enable_lora:
            self.loras = {a.name: a for a in engine.lora_adapters()}
        self.metrics.lora_active = self.async_engine.active_by_lora
        self.metrics.lora_adapters = lambda: self.async_engine.lora_snapshot
        self.lora_lock = asyncio.Lock()  # one load or unload at a time


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    """Build the FastAPI app serving `engine` (LLMEngine, or anything implementing EngineClient).

    The engine loop starts with the app's lifespan (or on the first request when no lifespan runs,
    as under httpx's ASGITransport); app.state.server.async_engine.stop() ends it.
    """
    state = _State(engine, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start()
        log_task = asyncio.create_task(_log_stats(state)) if state.config.log_interval_s > 0 else None
        try:
            yield
        finally:
            if log_task is not None:
                log_task.cancel()
                await asyncio.gather(log_task, return_exceptions=True)
            await state.async_engine.stop()

    app = FastAPI(title="stallfree", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, exc: BodyError) -> Response:
        return _error_response(ApiError.from_body_error(exc).body(), exc.status, exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        # A bug on some input: the client still gets an error object (logged here), never plain text.
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        err = ApiError(500, f"internal server error ({type(exc).__name__}); the server log has the details")
        return _error_response(err.body(), 500, None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # An unknown route (404) or method (405) gets OpenAI's error object too, not {"detail": ...}.
        if exc.status_code == 404:
            msg = f"unknown route {request.method} {request.url.path}; this server serves " + ", ".join(_ROUTES)
        else:
            msg = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(ApiError(exc.status_code, msg).body(), exc.status_code, getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> JSONResponse:
        aeng = state.async_engine
        if aeng.dead_reason is not None:
            raise ApiError(503, f"the engine is not running: {aeng.dead_reason}")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [
            {"id": name, "object": "model", "created": state.created, "owned_by": "stallfree",
             "root": state.info.model_name, "parent": None, "max_model_len": state.info.max_model_len}
            for name in state.names
        ]
        # Adapters as vLLM lists them: root is the adapter's folder, parent the base model's served name.
        data += [{"id": a.name, "object": "model", "created": state.created, "owned_by": "stallfree",
                  "root": a.path, "parent": state.names[0], "max_model_len": state.info.max_model_len}
                 for a in sorted(state.loras.values(), key=lambda a: a.name)]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        check_framing(request.headers)
        check_json_content_type(request.headers)
        name, path = _lora_body(state, await _read_body(request, state.config.max_request_bytes), with_path=True)
        if name in state.names:
            raise ApiError(400, f"lora_name {name!r} is the base model's served name; choose another", "lora_name")
        async with state.lora_lock:
            await _engine_lora_call(state, lambda: state.engine.load_lora_adapter(name, path))
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        check_framing(request.headers)
        check_json_content_type(request.headers)
        name, _ = _lora_body(state, await _read_body(request, state.config.max_request_bytes), with_path=False)
        async with state.lora_lock:
            if name not in state.loras:
                raise ApiError(404, f"LoRA adapter {name!r} is not served; served adapters: "
                               f"{sorted(state.loras) or 'none'}", "lora_name", code="model_not_found")
            await _engine_lora_call(state, lambda: state.engine.unload_lora_adapter(name))
        logger.info("LoRA adapter %r unloaded", name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    # Parsing, the chat template and tokenizing take time in proportion to the body: they run in a
    # worker thread, so that one large request never stalls the event loop (every stream's next token).
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_framing(request.headers)
        check_json_content_type(request.headers)
        raw = await _read_body(request, state.config.max_request_bytes)
        req, ids, lora = await asyncio.to_thread(_prepare_completion, state, raw)
        return await _serve(state, request, req, ids, chat=False, lora=lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_framing(request.headers)
        check_json_content_type(request.headers)
        raw = await _read_body(request, state.config.max_request_bytes)
        req, ids, lora = await asyncio.to_thread(_prepare_chat, state, raw)
        return await _serve(state, request, req, ids, chat=True, lora=lora)

    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Put the request schemas of the POST routes into /openapi.json (they read the raw body, so that
    errors are OpenAI's objects, and FastAPI cannot see the schemas): clients and schema-driven tests
    learn from it what a request may hold."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, cls in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
            body = cls.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[cls.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{cls.__name__}"}}},
            }
        for path, fields in (("/v1/load_lora_adapter", ("lora_name", "lora_path")),
                             ("/v1/unload_lora_adapter", ("lora_name",))):
            body = {"type": "object", "required": list(fields),
                    "properties": {f: {"type": "string", "minLength": 1} for f in fields}}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": body}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


_ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /v1/load_lora_adapter",
           "POST /v1/unload_lora_adapter", "GET /health", "GET /metrics")
# A body declared larger than this many times the limit is refused without reading it (the connection
# then closes); a smaller one is read and discarded first, so that the client gets its 413 cleanly.
_DRAIN_FACTOR = 16


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or ApiError(413) as soon as it is known to exceed `limit` bytes (from the
    Content-Length header before reading anything, or while reading a body sent without one).

    A client that sent `Expect: 100-continue` and declared too large a body gets its 413 before any
    `100 Continue` (the server sends that only when the body is first read), and the connection closes:
    RFC 9110 section 10.1.1 lets a server answer a final status instead, so the body is never sent.
    """
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is larger than the server's limit of {limit} bytes "
                       "(--max-request-bytes)", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if "100-continue" in request.headers.get("expect", "").lower():
            raise ApiError(413, too_big.message, code="request_too_large", headers={"Connection": "close"})
        if int(declared) <= _DRAIN_FACTOR * limit:
            async for _ in request.stream():
                pass
        raise too_big
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        parts.append(chunk)
    return b"".join(parts)


def _prepare_completion(state: _State, raw: bytes) -> tuple[Any, list[int], str | None]:
    """Parse a completion body and tokenize its prompt (in a worker thread); with the LoRA adapter it names."""
    req = parse_request(raw, CompletionRequest, state.limits)
    lora = _resolve_model(state, req.model)
    return req, _completion_prompt_ids(state, req.prompt), lora


def _prepare_chat(state: _State, raw: bytes) -> tuple[Any, list[int], str | None]:
    """Parse a chat body, render its messages with the chat template and tokenize (in a worker thread)."""
    req = parse_request(raw, ChatCompletionRequest, state.limits)
    lora = _resolve_model(state, req.model)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    # The template's cost grows with the text: refuse, before rendering, a text that cannot fit.
    _check_text_length(state, "".join(m["content"] for m in messages), "messages")
    try:
        text = state.engine.apply_chat_template(messages)
    except (ValueError, TypeError, KeyError) as exc:
        raise ApiError(400, f"messages: the chat template rejected them: {short_repr(str(exc), 200)}",
                       "messages") from None
    _check_text_length(state, text, "messages")
    return req, _encode(state, text, "messages"), lora


def _check_text_length(state: _State, text: str, where: str) -> None:
    """Refuse, without tokenizing, a text too long to fit the context whatever its tokens: each token
    decodes to at most info.max_token_chars characters, to at most info.max_token_alnum ASCII letters
    and digits, and stands for at most info.max_token_bytes UTF-8 bytes (body.min_tokens).

    Raises:
        ApiError(400, code context_length_exceeded): the bound is past the context length.
    """
    info = state.info
    alnum = getattr(info, "max_token_alnum", 0)
    nbytes = getattr(info, "max_token_bytes", 0)
    bound = min_tokens(text, info.max_token_chars, alnum, nbytes)
    if bound > info.max_model_len:
        per = f"at most {info.max_token_chars} characters"
        if alnum:
            per += f", {alnum} ASCII letters or digits"
        if nbytes:
            per += f" and {nbytes} UTF-8 bytes"
        raise ApiError(
            400,
            f"This model's maximum context length is {info.max_model_len} tokens. However, the {where} "
            f"holds {len(text)} characters, at least {bound} tokens ({per} per token). Please reduce "
            f"the length of the {where}.",
            where, code="context_length_exceeded",
        )


# A text longer than the context in UTF-8 bytes is first tokenized in pieces of about this many
# characters, cut after a whitespace character where there is one, stopping once the count is past
# the context: no prompt costs much more than a context's worth of tokenizing before its 400.
_PIECE_CHARS = 8192
# Tokens a cut between two pieces may add to the sum of the pieces' counts over the count of the whole
# (a BOS that each piece gets, a merge across the cut, SentencePiece's dummy prefix): the sum, less this
# per piece, is still a lower bound of the whole's count.
_PIECE_SLACK = 4


def _encode(state: _State, text: str, where: str) -> list[int]:
    """Tokenize `text`; refuse it when it is longer than the context.

    A text longer than one piece and of more UTF-8 bytes than the context has tokens is first counted
    in pieces (_PIECE_CHARS characters each), and refused as soon as the pieces' count, less
    _PIECE_SLACK per piece, is past the context; only a text that may fit is tokenized whole.

    Raises:
        ApiError(400): the tokenizer library refused the text (naming `where`), or (code
            context_length_exceeded) the pieces already hold more tokens than the context.
    """
    limit = state.info.max_model_len
    if len(text) > _PIECE_CHARS and len(text.encode("utf-8", "surrogatepass")) > limit:
        counted = pieces = 0
        start = 0
        while start < len(text):
            end = min(len(text), start + _PIECE_CHARS)
            if end < len(text):
                cut = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
                end = cut + 1 if cut > start else end
            counted += len(_encode_whole(state.engine, text[start:end], where))
            pieces += 1
            start = end
            at_least = counted - _PIECE_SLACK * pieces
            if at_least > limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, the {where} holds "
                    f"{len(text)} characters, and its first {start} characters already hold at least "
                    f"{at_least} tokens. Please reduce the length of the {where}.",
                    where, code="context_length_exceeded",
                )
    return _encode_whole(state.engine, text, where)


def _encode_whole(engine: EngineClient, text: str, where: str) -> list[int]:
    """Tokenize `text`; any error of the tokenizer library is the client's 400, naming `where`."""
    try:
        return engine.encode(text)
    except Exception as exc:  # noqa: BLE001 - a library error on client input is a 400, never a 500
        raise ApiError(400, f"{where}: the text cannot be tokenized ({type(exc).__name__}: "
                       f"{short_repr(str(exc))})", where) from None


async def _log_stats(state: _State) -> None:
    """Log one stats line every log_interval_s while there is or was work since the last line."""
    quiet = True
    while True:
        await asyncio.sleep(state.config.log_interval_s)
        m = state.metrics
        busy = m.num_running > 0 or state.async_engine.num_waiting > 0
        if busy or not quiet:
            logger.info(state.metrics.stats_line(state.async_engine.num_waiting - m.num_waiting))
        quiet = not busy


def _resolve_model(state: _State, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names: None for the base model (a served name, or no model).

    Raises:
        ApiError(404, model_not_found): neither a served name nor a served adapter; the message lists both.
    """
    if model is None or model in state.names:
        return None
    if model in state.loras:
        return model
    adapters = f" and the LoRA adapters {sorted(state.loras)}" if state.loras else ""
    raise ApiError(404, f"The model {short_repr(model)} does not exist; this server serves {list(state.names)}"
                   f"{adapters}.", "model", code="model_not_found")


def _lora_body(state: _State, raw: bytes, with_path: bool) -> tuple[str, str]:
    """lora_name (and lora_path) of a load or unload body, as vLLM's routes take them.

    Raises:
        ApiError(400): LoRA is not enabled, the body is not a JSON object, or a field is missing or not a
            non-empty string (naming it).
    """
    if not state.info.enable_lora:
        raise ApiError(400, "LoRA is not enabled on this server; start it with --enable-lora")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object with lora_name" + (" and lora_path" if with_path else ""))
    fields = ("lora_name", "lora_path") if with_path else ("lora_name",)
    for f in fields:
        value = body.get(f)
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"{f} must be a non-empty string, got {short_repr(value)}", f)
    return body["lora_name"], body.get("lora_path", "") if with_path else ""


async def _engine_lora_call(state: _State, fn: Any) -> None:
    """Run a load or unload on the engine between steps, then read its adapters again.

    Raises:
        ApiError(400): the engine refused it (InvalidLoraAdapter names why); ApiError(503): the loop stopped.
    """

    def call() -> list[LoraInfo]:
        fn()
        return state.engine.lora_adapters()

    try:
        served = await state.async_engine.call_between_steps(call)
    except InvalidLoraAdapter as exc:
        raise ApiError(400, str(exc), "lora_name") from None
    except EngineDead as exc:
        raise ApiError(503, str(exc)) from None
    state.loras = {a.name: a for a in served}


def _completion_prompt_ids(state: _State, prompt: Any) -> list[int]:
    """Token ids of a completion prompt: a string, token ids, or a batch of exactly one of them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one "
                           "request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_text_length(state, prompt, "prompt")
        ids = _encode(state, prompt, "prompt")
    else:
        ids = list(prompt)
        try:
            check_token_ids(ids, state.info.vocab_size)  # the engine's own rule (engine/inputs.py)
        except InvalidPrompt as exc:
            raise ApiError(400, str(exc), "prompt") from None
    if not ids:
        raise ApiError(400, "prompt: the prompt is empty (0 tokens); send at least one token", "prompt")
    return ids


def _resolve_max_tokens(state: _State, requested: int | None, num_prompt: int, chat: bool) -> int:
    """max_tokens of a request: the one asked for, checked against the context length and the KV
    capacity; or default_max_tokens, bounded by both."""
    limit = state.info.max_model_len
    kv_total = state.info.kv_total_tokens
    where = "messages" if chat else "prompt"
    if requested is None:
        room = min(limit, kv_total) - num_prompt
        max_tokens = min(state.config.default_max_tokens, room)
        if max_tokens >= 1:
            return max_tokens
        requested = 1
    if num_prompt + requested > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + requested} tokens ({num_prompt} in the {where}, {requested} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            where if num_prompt >= limit else "max_tokens",
            code="context_length_exceeded",
        )
    if num_prompt + requested > kv_total:
        raise ApiError(
            400,
            f"The request can never fit in the KV cache: {num_prompt} tokens in the {where} + max_tokens "
            f"{requested} = {num_prompt + requested} tokens > KV capacity {kv_total} tokens.",
            where if num_prompt >= kv_total else "max_tokens",
        )
    return requested


def _build_params(state: _State, req: Any, max_tokens: int) -> Any:
    """The engine's SamplingParams for a request: only the fields the client set (engine defaults
    otherwise); top_k of 0 or -1 means "off", as in vLLM, and is left to the default."""
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "min_p", "seed"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.top_k is not None and req.top_k > 0:
        kw["top_k"] = req.top_k
    # `is not None`, never truthiness: "", 0 and False are values a client may mean (parse_request
    # refuses an empty stop string; an empty list is "no stop" and passes through as such).
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids is not None:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos is True:
        kw["ignore_eos"] = True
    try:
        return state.params_cls(**kw)
    except ValueError as exc:
        msg = str(exc)
        param = next((f for f in _PARAM_FIELDS if f in msg), None)
        if len(msg) > 200:  # the engine's message may quote the value: never echo a whole input
            msg = f"{msg[:200]}... ({len(msg)} characters)"
        raise ApiError(400, msg, param) from None


async def _serve(state: _State, request: Request, req: Any, ids: list[int], chat: bool,
                 lora: str | None = None) -> Response:
    """Validate limits, add the request to the loop, and answer it (streamed or whole)."""
    requested = req.effective_max_tokens() if chat else req.max_tokens
    max_tokens = _resolve_max_tokens(state, requested, len(ids), chat)
    params = _build_params(state, req, max_tokens)
    if req.priority != 0 and state.info.scheduling_policy != "priority":
        # Accepted fields take effect or are refused: under FCFS a priority would be silently ignored.
        raise ApiError(400, f"priority={req.priority}: this server schedules first come, first served "
                       f"(--scheduling-policy {state.info.scheduling_policy}); only priority 0 is accepted; "
                       "start it with --scheduling-policy priority to use priorities", "priority")
    if req.cache_salt is None and state.config.prefix_cache_isolation == "salt":
        raise ApiError(400, "cache_salt: this server keeps prefix caches apart (--prefix-cache-isolation salt); "
                       "every request must send a cache_salt (a non-empty string; requests share cached "
                       "prefixes only with requests of the same salt)", "cache_salt")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    salt: dict[str, Any] = {} if req.cache_salt is None else {"cache_salt": req.cache_salt}
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is not None:
        salt["tenant"] = tenant
    if lora is not None:
        salt["lora"] = lora
    if state.rate_limiter is not None:
        wait = state.rate_limiter.take(tenant or DEFAULT_TENANT, len(ids) + max_tokens)
        if wait is not None:
            retry = max(1, math.ceil(wait))
            raise ApiError(429, f"tenant {tenant or DEFAULT_TENANT!r} is over its token rate "
                           f"(--tenant-tokens-per-minute {state.config.tenant_tokens_per_minute}); retry in "
                           f"{retry} s", code="rate_limited", headers={"Retry-After": str(retry)})
    try:
        stream = await state.async_engine.add_request(rid, ids, params, num_prompt_tokens=len(ids),
                                                      max_tokens=max_tokens, priority=req.priority, **salt)
    except QueueFull as exc:
        raise ApiError(429, str(exc), code="queue_full") from None
    except EngineDead as exc:
        raise ApiError(503, str(exc)) from None
    except ContextLengthExceeded as exc:
        raise ApiError(400, str(exc), "messages" if chat else "prompt", code="context_length_exceeded") from None
    except UnknownLora as exc:  # unloaded since the model field was checked
        raise ApiError(404, str(exc), "model", code="model_not_found") from None
    except ValueError as exc:  # EngineError, RequestRejected: the input processor's other refusals
        raise ApiError(400, str(exc), "messages" if chat else "prompt") from None
    model = state.names[0] if lora is None else lora
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream_body(stream, rid, created, model, chat, include_usage)
        return SSEResponse(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole_response(request, stream, rid, created, model, chat)


async def _stream_body(
    stream: RequestStream, rid: str, created: int, model: str, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body: chunks as tokens come (the finish_reason on the chunk with the last text), an
    optional usage chunk, then [DONE]; a failure after the headers went out is an error event."""
    prompt_tokens = completion_tokens = 0
    cached: int | None = None
    try:
        if chat:
            yield sse(completion_chunk(rid, created, model, True, "", None, role=True,
                                       with_usage_field=include_usage))
        async for out in stream:
            if out.finished and out.finish_reason == "timeout":
                yield sse(_queue_timeout().body())
                break
            prompt_tokens, completion_tokens = out.num_prompt_tokens, out.num_generated
            cached = getattr(out, "num_cached_tokens", None)
            if out.text or out.finished:
                text = out.text if (out.text or not chat) else None
                reason = out.finish_reason if out.finished else None
                yield sse(completion_chunk(rid, created, model, chat, text, reason,
                                           with_usage_field=include_usage))
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": model, "choices": [],
                       "usage": usage_dict(prompt_tokens, completion_tokens, cached)})
    except (StepFailed, EngineDead) as exc:
        status = 503 if isinstance(exc, EngineDead) else 500
        yield sse(ApiError(status, str(exc)).body())
    finally:
        stream.abort()  # a no-op once finished; otherwise the client left mid-stream
    yield DONE


async def _whole_response(
    request: Request, stream: RequestStream, rid: str, created: int, model: str, chat: bool
) -> Response:
    """Collect a request's text; abort it if the client disconnects before it finishes."""
    parts: list[str] = []
    last: Any = None

    async def collect() -> None:
        nonlocal last
        async for out in stream:
            parts.append(out.text)
            last = out

    task = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    exc = task.exception()
    if isinstance(exc, EngineDead):
        raise ApiError(503, str(exc))
    if exc is not None:
        raise ApiError(500, str(exc))
    if last is not None and last.finish_reason == "timeout":
        raise _queue_timeout()
    text = "".join(parts)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return JSONResponse({
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_dict(last.num_prompt_tokens, last.num_generated, getattr(last, "num_cached_tokens", None)),
    })


#: Retry-After of a request shed by the queue time limit, seconds: one limit's wait is a fair first guess.
_RETRY_AFTER_S = 1


def _queue_timeout() -> ApiError:
    """429 for a request that waited longer than the queue time limit (serve --max-queue-time) and was shed
    before any token (SchedulerConfig.max_queue_time_s)."""
    return ApiError(429, "the request waited longer than the server's queue time limit (--max-queue-time) "
                    "without being admitted; retry later", code="queue_timeout",
                    headers={"Retry-After": str(_RETRY_AFTER_S)})


async def _wait_disconnect(request: Request) -> None:
    """Return when the client has disconnected (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
