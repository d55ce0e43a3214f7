"""The OpenAI request schemas we accept (with the extras vLLM users send) and the error object we answer.

Validation is strict: a wrong type is an error (no "5" for 5), an unknown field is an error, and an
OpenAI field we do not implement (n > 1, best_of, logprobs, penalties, ...) is accepted only at its
neutral value, so nothing a client asks for is silently ignored.

Imports allowed: the standard library, pydantic, stallfree.core.errors (stdlib only) and
stallfree.server.body (the checks before validation).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stallfree.core.errors import StallfreeError
from stallfree.server.body import BodyError, check_sizes, decode_json, short_repr

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "MAX_INT32",
    "MAX_PRIORITY",
    "CompletionRequest",
    "StreamOptions",
    "error_body",
    "parse_request",
]


class ApiError(StallfreeError):
    """An error answered to the client as an OpenAI error object.

    Args:
        status: the HTTP status (400, 404, 405, 413, 429, 500, 503).
        message: what went wrong, naming the field and the value.
        param: the request field at fault, or None.
        err_type: OpenAI's error type ("invalid_request_error", ...).
        code: OpenAI's error code (e.g. "context_length_exceeded"), or None.
        headers: response headers to send with it (e.g. Connection: close), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _default_type(status)
        self.code = code
        self.headers = headers

    @classmethod
    def from_body_error(cls, exc: BodyError) -> ApiError:
        """The ApiError of a refusal by stallfree.server.body (same status, message, param, code, headers)."""
        return cls(exc.status, exc.message, exc.param, code=exc.code, headers=exc.headers)

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return error_body(self.message, self.err_type, self.param, self.code)


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Return OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


#: The largest max_tokens, top_k or stop token id accepted (2**31 - 1).
MAX_INT32 = 2**31 - 1
#: The bound of a request's priority: -MAX_PRIORITY to MAX_PRIORITY (vLLM takes any integer).
MAX_PRIORITY = 1_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    """stream_options: include_usage adds a final chunk with usage (and empty choices)."""

    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None  # body.MAX_STOP strings
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=256)  # body.MAX_STOP_TOKEN_IDS
    # Bounded, so that no value is first forever under --scheduling-policy priority (-10**4000 was).
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # vLLM's: mixed into the prefix-cache block hashes, so requests with different salts share no KV.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI/vLLM fields we do not implement: accepted only at their neutral values (see _UNSUPPORTED).
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: one prompt (a string, or token ids; a batch of one is accepted)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; content is a string or a list of text parts."""

    role: Literal["system", "user", "assistant", "developer"]
    content: str | Annotated[list[_TextPart], Field(max_length=64)]  # body.MAX_CONTENT_PARTS parts
    # Accepted only as null: the chat template has no place for a participant's name (parse_request).
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)  # body.MAX_MESSAGES
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def effective_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# field -> (neutral value test, what we say). Anything else is a 400 naming the field. The tests compare
# by identity or exact type where 0, "" or False mean something of their own: `0 in (None, False)` is True
# in Python, and `logprobs: 0` asks for the chosen tokens' log-probabilities (it is not "off").
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v == 1, "not supported (only n=1)"),
    "best_of": (lambda v: v is None or v == 1, "not supported (only best_of=1)"),
    "logprobs": (lambda v: v is None or v is False, "logprobs are not supported (only null)"),
    "top_logprobs": (lambda v: v is None or v == 0, "logprobs are not supported"),
    "echo": (lambda v: v is False, "echo is not supported"),
    "suffix": (lambda v: v is None, "suffix is not supported"),
    "presence_penalty": (lambda v: v == 0.0, "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (lambda v: v == 0.0, "frequency_penalty is not supported (only 0)"),
    "repetition_penalty": (lambda v: v == 1.0, "repetition_penalty is not supported (only 1.0)"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "min_tokens": (lambda v: v == 0, "min_tokens is not supported (only 0)"),
    "skip_special_tokens": (lambda v: v is True, "skip_special_tokens=false is not supported"),
    "tools": (lambda v: not v, "tools are not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool_choice is not supported"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "only response_format 'text' is supported"),
}


def parse_request(raw: bytes, model_cls: type[_SamplingFields], limits: Any = None) -> Any:
    """Parse and validate a JSON body into `model_cls`.

    The body is decoded as strict UTF-8 and its lists and objects are measured first
    (stallfree.server.body: decode_json, check_sizes), so that the full validation never runs on
    inputs that would make it slow; only the first validation error is reported (with the number of
    others), and a value is quoted back at most 60 characters long.

    Args:
        limits: the engine's body.BodyLimits (the longest prompt token list), or None.

    Returns:
        The validated request object.

    Raises:
        ApiError(400): a body that is not UTF-8 JSON, not an object, or over a length limit; a wrong
            type, a value out of range, an unknown field, or an unsupported feature at a non-neutral
            value; `param` names the field.
    """
    try:
        data = decode_json(raw, None if limits is None else limits.max_values)
        check_sizes(data, limits)
    except BodyError as exc:
        raise ApiError.from_body_error(exc) from None
    # Lone surrogates can only come from \uD800-\uDFFF escapes (raw bytes are decoded strictly).
    bad = _first_unencodable(data, "") if _SURROGATE_ESCAPE.search(raw) else None
    if bad is not None:
        # JSON's \ud800 escapes give Python strings that no UTF-8 library (the tokenizer) accepts.
        param = bad.split(".")[0].split("[")[0] or "body"
        raise ApiError(400, f"{bad}: the string holds a lone UTF-16 surrogate (not valid Unicode text)", param)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if isinstance(req, ChatCompletionRequest):
        named = next((i for i, m in enumerate(req.messages) if m.name is not None), None)
        if named is not None:
            raise ApiError(400, f"messages[{named}].name: not supported (the chat template has no place for a "
                           "participant's name); leave it out or put it in the content", "messages")
    for name, (ok, why) in _UNSUPPORTED.items():
        if name in req.model_fields_set and not ok(getattr(req, name)):
            raise ApiError(400, f"{name}={short_repr(getattr(req, name))}: {why}", name)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options may only be set when stream is true", "stream_options")
    if req.stop_token_ids is not None and any(not 0 <= t <= MAX_INT32 for t in req.stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be >= 0 and <= {MAX_INT32}, got {short_repr(req.stop_token_ids)}",
                       "stop_token_ids")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(s == "" for s in stops):
        # An empty stop string would match at once: refused, whether alone ("") or in a list ([""]).
        raise ApiError(400, f"stop must hold non-empty strings, got {short_repr(req.stop)}", "stop")
    return req


def _validation_error(exc: ValidationError) -> ApiError:
    """The 400 for a pydantic error: the most specific of its first errors (the deepest location, so
    a wrong list item rather than "not a string" from the first branch of a union), how many others
    there are, and the value quoted at most 60 characters long."""
    errors = exc.errors(include_url=False)[:_ERRORS_READ]
    first = errors[0]
    field = first["loc"][:1]
    err = max((e for e in errors if e["loc"][:1] == field), key=lambda e: len(e["loc"]))
    param = _param_of(err["loc"])
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"{param}: unknown or unsupported field", param)
    branches = [str(e["loc"][1]) for e in errors if e["loc"][:1] == field and len(e["loc"]) == 2]
    if len(err["loc"]) == 2 and len(branches) > 1:  # the value fits no branch of a union: name them all
        msg = f"{param}: should be one of: {', '.join(_type_name(b) for b in branches)}"
    else:
        msg = f"{param}: {err['msg']}"
    more = exc.error_count() - 1
    tail = f"; and {more} more error{'s' if more > 1 else ''}" if more > 0 else ""
    return ApiError(400, f"{msg} (got {short_repr(err.get('input'))}){tail}", param)


# Only the first few of a ValidationError's errors are read (building the dicts costs per error).
_ERRORS_READ = 8


def _type_name(tag: str) -> str:
    """A pydantic union-branch tag as a JSON type: 'str' -> 'a string', 'list[int]' -> 'a list of integers'."""
    names = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
             "list[int]": "a list of integers", "list[str]": "a list of strings",
             "list[list[int]]": "a list of lists of integers", "list[_TextPart]": "a list of text parts",
             "dict[str,float]": "an object of numbers", "StreamOptions": "an object"}
    return names.get(tag.replace(" ", ""), tag)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _first_unencodable(value: Any, path: str) -> str | None:
    """The path (e.g. "messages[0].content") of the first string in `value` that is not valid UTF-8
    text (it holds a lone surrogate), or None. Keys are checked as well as values."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(item, dict):
            for k, v in reversed(list(item.items())):
                sub = f"{where}.{k}" if where else str(k)
                stack.append((v, sub))
                stack.append((k, sub))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def _param_of(loc: tuple[int | str, ...]) -> str:
    """Name the field of a pydantic error location: the top-level field, plus list indices and
    nested field names, skipping the union-branch tags pydantic inserts (e.g. 'list[int]')."""
    out = str(loc[0]) if loc else "body"
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):
            out += f".{part}"
    return out
