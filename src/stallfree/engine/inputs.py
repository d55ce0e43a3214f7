"""One input processor for a served prompt: checked and turned into the scheduler's Request in one place.

Imports allowed: the standard library, stallfree.core and the torch-free stallfree.engine.errors.

A prompt reaches the engine as text or token ids with its sampling parameters and a few request fields
(priority, cache salt, tenant, LoRA adapter). `InputProcessor.process` checks all of them and builds the
stallfree.core.Request the scheduler gets; LLMEngine.add_request, the admission rule a server asks ahead of
a step (LLMEngine.admission) and the server's own checks (`check_token_ids`) all go through this module, so
a prompt is judged by one rule wherever it is judged. Every refusal is an EngineError subclass (a
ValueError), so that a caller catches it by type: ContextLengthExceeded, UnknownLora, InvalidPrompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.core import Request
from stallfree.engine.errors import ContextLengthExceeded, InvalidPrompt, UnknownLora

__all__ = ["InputProcessor", "ProcessedPrompt", "check_token_ids"]


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Refuse a token id outside [0, vocab_size).

    Raises:
        InvalidPrompt: the first id out of range, named with the vocabulary's bounds.
    """
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InvalidPrompt(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt the engine accepts: its token ids and the scheduler's Request for it.

    Attributes:
        token_ids: the prompt's tokens, [prompt_len] ints in [0, vocab_size).
        request: the stallfree.core.Request (prompt_len = len(token_ids), max_new = max_tokens, the
            block hashes under prefix caching, the adapter's id under LoRA).
    """

    token_ids: list[int]
    request: Request


class InputProcessor:
    """Checks a prompt and its request fields and builds its core Request (thread-safe: it reads only
    the tokenizer and fixed facts, so a server may call it during a step).

    Args:
        encode: text -> token ids (the engine's tokenizer, no chat template); may raise TypeError,
            ValueError or UnicodeError on text it cannot tokenize.
        vocab_size: token ids are in [0, vocab_size).
        max_model_len: the context length, tokens: prompt + max_tokens must not pass it.
        block_hashes: (token ids, cache salt or None) -> the prompt's block hashes for prefix caching, or
            None when the engine does not cache.
        lora_id: adapter name -> the id the scheduler counts it by (Request.lora); raises UnknownLora for
            a name not served. None: no adapter is served, and a request naming one is refused.
    """

    __slots__ = ("_encode", "vocab_size", "max_model_len", "_hashes", "_lora_id")

    def __init__(self, encode: Callable[[str], Sequence[int]], vocab_size: int, max_model_len: int,
                 block_hashes: Callable[[Sequence[int], str | None], Sequence[Hashable] | None] | None = None,
                 lora_id: Callable[[str], Hashable] | None = None) -> None:
        self._encode = encode
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._hashes = block_hashes
        self._lora_id = lora_id

    def encode(self, text: str) -> list[int]:
        """Tokenize `text` (no chat template; "" gives []).

        Raises:
            InvalidPrompt: the tokenizer cannot tokenize it (e.g. a lone surrogate).
        """
        try:
            return list(self._encode(text))
        except (TypeError, ValueError, UnicodeError) as exc:
            raise InvalidPrompt(f"prompt cannot be tokenized ({exc}): {text!r:.80}") from None

    def token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: text tokenized (no chat template), or ids checked against the vocabulary.

        Raises:
            InvalidPrompt: the text cannot be tokenized, an id is outside the vocabulary, the prompt is
                neither text nor a list of ints, or it is empty.
        """
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = [int(i) for i in prompt]
            check_token_ids(ids, self.vocab_size)
        else:
            raise InvalidPrompt(f"prompt must be a string or a list of token ids, got {prompt!r:.80}")
        if not ids:
            raise InvalidPrompt("prompt is empty (0 tokens); it needs at least 1 token")
        return ids

    def process(self, rid: Hashable, prompt: str | Sequence[int], max_tokens: int, *, priority: int = 0,
                cache_salt: str | None = None, tenant: str | None = None, lora: str | None = None,
                arrival: float | None = None) -> ProcessedPrompt:
        """Check a request and build its core Request.

        Args:
            rid: the request id.
            prompt: text or token ids (see token_ids).
            max_tokens: the most tokens to generate, >= 1.
            priority: an integer, lower is more urgent.
            cache_salt: None or a non-empty string mixed into the prompt's block hashes.
            tenant: None or a non-empty string.
            lora: None (the base model) or the name of a served LoRA adapter.
            arrival: the arrival time, seconds of time.monotonic(); None: now.

        Raises:
            InvalidPrompt: priority is not an integer, cache_salt or tenant is not a non-empty string,
                lora is not a string, or the prompt is refused (token_ids).
            UnknownLora: lora names no served adapter (the message lists the served ones).
            ContextLengthExceeded: prompt tokens + max_tokens > max_model_len.
            RequestRejected: a field the core Request refuses (e.g. max_tokens < 1).
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidPrompt(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidPrompt(f"cache_salt must be a non-empty string, got {cache_salt!r:.80}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise InvalidPrompt(f"tenant must be None or a non-empty string, got {tenant!r:.80}")
        lora_key = self.lora_key(lora)
        ids = self.token_ids(prompt)
        if len(ids) + max_tokens > self.max_model_len:
            raise ContextLengthExceeded(len(ids), max_tokens, self.max_model_len)
        hashes = None if self._hashes is None else self._hashes(ids, cache_salt)
        hashes = None if hashes is None else tuple(hashes)
        request = Request(rid, len(ids), max_tokens, priority=priority,
                          arrival=time.monotonic() if arrival is None else arrival,
                          block_hashes=hashes, lora=lora_key, tenant=tenant)
        return ProcessedPrompt(ids, request)

    def lora_key(self, lora: Any) -> Hashable | None:
        """The scheduler's id of adapter `lora` (None for the base model).

        Raises:
            InvalidPrompt: lora is neither None nor a string.
            UnknownLora: no adapter of that name is served.
        """
        if lora is None:
            return None
        if not isinstance(lora, str):
            raise InvalidPrompt(f"lora must be None or an adapter name, got {lora!r:.80}")
        if self._lora_id is None:
            raise UnknownLora(lora, ())
        return self._lora_id(lora)
