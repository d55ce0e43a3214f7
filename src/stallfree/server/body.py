"""What a request body must be before it is validated in full: UTF-8 JSON, one framing, and lists and
objects of bounded length, so that no body under the size limit costs much more than reading it.

The checks here are cheap (a length or a type per container, never per character or per list item
beyond the ones a limit allows) and run before pydantic's validation, whose cost grows with the
number of values and of errors it builds: a 250,000-item token list with one string in it made
500,001 errors and took 1.5 s, holding the GIL against every stream's next token.

Imports allowed: the standard library and stallfree.core.errors. (stallfree.server.protocol imports this
module; its parse_request turns a BodyError into its ApiError, and the app answers either alike.)

Limits (documented in docs/server.md):

======================  =======  ==================================================================
what                    limit    why
======================  =======  ==================================================================
prompt token ids        context  a longer list can never fit (max_model_len tokens), a 400 at once
prompts in a batch      1        one prompt per request (as before; n and best_of are 1 too)
messages                1024     a long conversation fits; a million empty messages cannot
content parts           64       per message; text parts are joined anyway
stop strings            16       OpenAI allows 4; vLLM any number; 16 leaves room for 4 variants each
stop string length      256      characters; text is held back this long while a stop may begin
stop_token_ids          256      token ids
any other list/object   256      items (logit_bias, tools, response_format, ... and the body itself)
lists and objects       4096     in the whole body, at any depth
JSON values             context  in the whole body, plus 16,384; counted in the raw bytes before
                        + 16384  parsing, since json.loads itself holds the GIL (0.08-0.3 s for a 1.9
                                 MB list of 250,000 integers)
======================  =======  ==================================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stallfree.core.errors import StallfreeError

__all__ = [
    "MAX_CONTAINERS",
    "MAX_CONTENT_PARTS",
    "MAX_INT_DIGITS",
    "MAX_ITEMS",
    "MAX_MESSAGES",
    "MAX_PROMPTS",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "BodyError",
    "BodyLimits",
    "check_framing",
    "check_json_content_type",
    "check_sizes",
    "check_value_count",
    "decode_json",
    "min_tokens",
    "short_repr",
]

MAX_PROMPTS = 1
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 64
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_ITEMS = 256
MAX_CONTAINERS = 4096
# JSON values a body may hold beyond the prompt's token ids (BodyLimits.max_values).
EXTRA_VALUES = 16384

# The most digits of an integer in a body: every integer field fits 64 bits (20 digits); a longer one
# is refused while parsing, before Python builds, compares or prints it.
MAX_INT_DIGITS = 20
_LONG_DIGITS = re.compile(rb"[0-9]{21}")


def _bounded_int(digits: str) -> int:
    """json.loads's parse_int: the integer, or BodyError(400) for more than MAX_INT_DIGITS digits."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyError(400, f"the request body holds an integer of {len(digits.lstrip('-'))} digits; integers "
                       f"may have at most {MAX_INT_DIGITS} digits")
    return int(digits)


# The most characters of a value quoted back in an error message: an error never echoes the input.
_QUOTE_CHARS = 60


class BodyError(StallfreeError):
    """A body refused by these checks; answered as OpenAI's error object (status 400 unless given).

    Args:
        status: the HTTP status.
        message: what is wrong, naming the field, its length or kind, and the limit.
        param: the request field at fault, or None.
        code: OpenAI's error code (e.g. "context_length_exceeded"), or None.
        headers: response headers to send with it (Connection: close), or None.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """The limits that depend on the engine.

    Args:
        max_prompt_tokens: the longest prompt token list accepted, in tokens (the context length).
    """

    max_prompt_tokens: int

    @property
    def max_values(self) -> int:
        """The most JSON values in a body: a full prompt of token ids plus EXTRA_VALUES (16,384)."""
        return self.max_prompt_tokens + EXTRA_VALUES


def short_repr(value: Any, limit: int = _QUOTE_CHARS) -> str:
    """repr(value) cut to about `limit` characters (with "..." and the full length), for error messages.

    A list or dict is summarised by its type and length before repr is called, so that quoting a
    2 MB value costs nothing.
    """
    if isinstance(value, list | dict) and len(value) > 8:
        kind = "list" if isinstance(value, list) else "object"
        return f"<a {kind} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_framing(headers: Mapping[str, str]) -> None:
    """Refuse a request whose body framing or declared charset is ambiguous, before reading the body.

    Raises:
        BodyError(400): both Transfer-Encoding and Content-Length are present (RFC 9112 section 6.1: a
            server MAY reject such a message and MUST close the connection after it, as the two may
            frame the body differently and let a proxy and the server disagree on where the next
            request starts: request smuggling); or Content-Type names a charset other than UTF-8
            (RFC 8259 section 8.1: JSON between systems is UTF-8). The answer closes the connection.
    """
    if "transfer-encoding" in headers and "content-length" in headers:
        raise BodyError(400, "the request has both Transfer-Encoding and Content-Length headers; send one "
                       "(RFC 9112 section 6.1)", headers={"Connection": "close"})
    ctype = headers.get("content-type", "")
    match = re.search(r";\s*charset\s*=\s*\"?([^\s;\"]+)", ctype, re.IGNORECASE)
    if match and match.group(1).lower() not in ("utf-8", "utf8"):
        raise BodyError(400, f"Content-Type charset {short_repr(match.group(1))}: request bodies are JSON in "
                       "UTF-8 only (RFC 8259 section 8.1)", headers={"Connection": "close"})


def check_json_content_type(headers: Mapping[str, str]) -> None:
    """Refuse a body not declared as JSON, before reading it.

    Without an API key a server on localhost can be driven by any web page the user opens: a browser
    sends a cross-origin POST without asking first only when its Content-Type is text/plain, a form
    type or absent, so requiring `application/json` (or a `+json` type) makes the browser ask
    (CORS preflight), which this server never allows.

    Raises:
        BodyError(415): the Content-Type header is absent or another media type; the message names it
            (at most 60 characters) and what to send.
    """
    ctype = headers.get("content-type")
    media = (ctype or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = "no Content-Type header" if ctype is None else f"Content-Type {short_repr(ctype)}"
    raise BodyError(415, f"the request has {got}; request bodies are JSON: send `Content-Type: "
                   "application/json`", code="unsupported_media_type")


def check_value_count(raw: bytes, max_values: int) -> None:
    """Refuse, before parsing, a body holding more than `max_values` JSON values, from its raw bytes.

    Cost: a few passes over the bytes in C (about 2 ms for 2 MB) unless the body holds many commas and
    few strings, when one Python step per string is added (at most 2 * max_values of them). The count
    is a lower bound of the values: commas outside strings (each separates two values); or, when there
    are too many strings to split on, a quarter of the unescaped quotes (a string is a key or a value,
    and there are no more keys than values).

    Raises:
        BodyError(400): more than `max_values` values.
    """
    commas = raw.count(b",")
    if commas < max_values:
        return
    quotes = raw.count(b'"') - raw.count(b'\\"')
    if quotes // 4 > max_values:
        found = quotes // 4
    else:
        plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        found = sum(part.count(b",") for part in plain.split(b'"')[::2])
        if found < max_values:
            return
    raise BodyError(400, f"the request body holds at least {found} JSON values, more than {max_values} (a prompt "
                   f"may hold {max_values - EXTRA_VALUES} token ids, the context length, and the rest of a "
                   f"body {EXTRA_VALUES} values)")


def decode_json(raw: bytes, max_values: int | None = None) -> dict[str, Any]:
    """Parse a request body: UTF-8 JSON text holding one object.

    Python's json.loads would also read UTF-16 and UTF-32 (it guesses from the first bytes); RFC 8259
    section 8.1 says JSON exchanged between systems is UTF-8, and a UTF-16 body passed the checks
    that look for UTF-8 bytes, so the body is decoded as strict UTF-8 first.

    Args:
        max_values: the most JSON values the body may hold (check_value_count, before parsing); None: any.

    Raises:
        BodyError(400): the bytes are not UTF-8 (the offset of the first bad byte is given), the text
            starts with a byte order mark, it holds more than max_values values, it is not JSON, it is
            nested too deeply, it holds an integer of more than MAX_INT_DIGITS (20) digits, or it is
            not an object.
    """
    if max_values is not None:
        check_value_count(raw, max_values)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the request body is not UTF-8 text (byte {raw[exc.start]:#04x} at offset "
                       f"{exc.start}); JSON request bodies are UTF-8 only (RFC 8259 section 8.1)") from None
    if text.startswith("\ufeff"):
        raise BodyError(400, "the request body starts with a byte order mark; send JSON without one "
                       "(RFC 8259 section 8.1)")
    try:
        # A digit run longer than any 64-bit integer sends the parse through the slow, checking path:
        # Python's int of 4,300 digits parses, but printing it in a message raises (a 500 before).
        data = json.loads(text, parse_int=_bounded_int) if _LONG_DIGITS.search(raw) else json.loads(text)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(400, "malformed JSON in the request body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, an integer with too many digits
        raise BodyError(400, f"malformed JSON in the request body: {short_repr(str(exc), 200)}") from None
    if not isinstance(data, dict):
        raise BodyError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def check_sizes(data: dict[str, Any], limits: BodyLimits | None = None) -> None:
    """Refuse a parsed body whose lists or objects are longer than the limits (module docstring), or whose
    prompt list mixes kinds, before any full validation; costs one step per list or object, plus one
    type test per prompt list item (at most the context length of them).

    Args:
        data: the parsed body (decode_json).
        limits: the engine's limits; None skips the prompt token count (a later check counts it).

    Raises:
        BodyError(400): naming the field, its length and the limit; `code` is "context_length_exceeded"
            for a token list longer than the context.
    """
    if len(data) > MAX_ITEMS:
        raise BodyError(400, f"the request body has {len(data)} fields, more than {MAX_ITEMS}")
    _check_prompt(data.get("prompt"), limits)
    _check_list(data, "messages", MAX_MESSAGES)
    messages = data.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                _check_list(m, "content", MAX_CONTENT_PARTS, f"messages[{i}].content", "messages")
    stop = data.get("stop")
    _check_list(data, "stop", MAX_STOP)
    for i, s in enumerate(stop if isinstance(stop, list) else [stop]):
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            where = f"stop[{i}]" if isinstance(stop, list) else "stop"
            raise BodyError(400, f"{where}: a stop string of {len(s)} characters, more than {MAX_STOP_CHARS}",
                           "stop")
    _check_list(data, "stop_token_ids", MAX_STOP_TOKEN_IDS)
    _check_containers(data)


def _check_list(obj: dict[str, Any], key: str, limit: int, where: str | None = None,
                param: str | None = None) -> None:
    value = obj.get(key)
    if isinstance(value, list) and len(value) > limit:
        raise BodyError(400, f"{where or key}: {len(value)} items, more than the limit of {limit}", param or key)


def _check_prompt(prompt: Any, limits: BodyLimits | None) -> None:
    """A prompt list is token ids (integers), or a batch of one string or one token list."""
    if not isinstance(prompt, list) or not prompt:
        return
    first = prompt[0]
    if isinstance(first, str | list):
        if len(prompt) > MAX_PROMPTS:
            raise BodyError(400, f"prompt: a batch of {len(prompt)} prompts is not supported; send one request "
                           "per prompt", "prompt")
        if isinstance(first, list):
            _check_token_list(first, limits, "prompt[0]")
        return
    _check_token_list(prompt, limits, "prompt")


def _check_token_list(ids: list[Any], limits: BodyLimits | None, where: str) -> None:
    if limits is not None and len(ids) > limits.max_prompt_tokens:
        raise BodyError(400, f"This model's maximum context length is {limits.max_prompt_tokens} tokens. However, "
                       f"the prompt holds {len(ids)} token ids. Please reduce the length of the prompt.",
                       "prompt", code="context_length_exceeded")
    bad = next((i for i, t in enumerate(ids) if type(t) is not int), None)
    if bad is not None:
        kind = "a string" if isinstance(ids[bad], str) else f"a {_json_type(ids[bad])}"
        raise BodyError(400, f"{where}[{bad}]: {kind} ({short_repr(ids[bad])}) in a list of token ids; a prompt is "
                       "a string, a list of token ids (integers), or a batch of one of them", "prompt")


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _check_containers(data: dict[str, Any]) -> None:
    """Every list or object at most MAX_ITEMS long (the prompt's token list and messages aside), and at
    most MAX_CONTAINERS of them in all."""
    stack: list[tuple[Any, str]] = [(v, k) for k, v in data.items() if isinstance(v, list | dict)]
    count = 1
    while stack:
        value, where = stack.pop()
        count += 1
        if count > MAX_CONTAINERS:
            raise BodyError(400, f"the request body holds more than {MAX_CONTAINERS} lists and objects")
        special = where in ("prompt", "messages", "prompt[0]") or where.endswith(".content")
        if not special and len(value) > MAX_ITEMS:
            top = where.split(".")[0].split("[")[0]
            raise BodyError(400, f"{where}: {len(value)} items, more than the limit of {MAX_ITEMS}", top)
        if where == "prompt" and value and not isinstance(value[0], str | list):
            continue  # token ids: no containers inside (checked by _check_prompt)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(v, list | dict):
                stack.append((v, f"{where}.{k}" if isinstance(value, dict) else f"{where}[{k}]"))


def min_tokens(text: str, max_token_chars: int, max_token_alnum: int = 0, max_token_bytes: int = 0) -> int:
    """A lower bound on the tokens `text` tokenizes to, computed without tokenizing (about 1 ms per MB).

    Every token decodes to at most `max_token_chars` characters, to at most `max_token_alnum` ASCII
    letters and digits (25 for SmolLM2's vocabulary, whose longest token is 81 characters of '#'), and
    stands for at most `max_token_bytes` UTF-8 bytes of text: so the text has at least
    ceil(len / max_token_chars) tokens, at least ceil(alnum / max_token_alnum), where alnum counts its
    ASCII letters and digits, and at least ceil(utf8_len / max_token_bytes). The second bound refuses a
    663,000-character prompt without spaces (26,520 tokens at least) that the first let through to a
    499,000-token encode; the third a 660,000-character prompt of a three-byte CJK character (1.98 MB,
    24,445 tokens at least for SmolLM2) that the first two let through to a 1.98 M-token encode.

    Args:
        text: the prompt text.
        max_token_chars: the most characters one token decodes to (EngineInfo.max_token_chars), >= 1.
        max_token_alnum: the most ASCII letters and digits in one token; 0 (unknown) skips that bound.
        max_token_bytes: the most UTF-8 bytes of text one token stands for (EngineInfo.max_token_bytes);
            0 (unknown) skips that bound.

    Returns:
        The bound, in tokens.
    """
    bound = -(-len(text) // max(1, max_token_chars))
    if max_token_alnum > 0 or max_token_bytes > 0:
        data = text.encode("utf-8", "surrogatepass")
        if max_token_bytes > 0:
            bound = max(bound, -(-len(data) // max_token_bytes))
        if max_token_alnum > 0:
            alnum = len(data) - len(data.translate(None, _ALNUM))
            bound = max(bound, -(-alnum // max_token_alnum))
    return bound


_ALNUM = bytes(range(48, 58)) + bytes(range(65, 91)) + bytes(range(97, 123))
