"""What the engine hands back per request and step (RequestOutput), and the typed view a server has of
an engine (EngineClient: EngineInfo, EngineStats, Headroom); no torch, so that servers and their tests
can use them without the model stack.

Imports allowed: the standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stallfree.core import Request as CoreRequest

__all__ = ["Admission", "EngineClient", "EngineInfo", "EngineStats", "Headroom", "LoraInfo", "RequestOutput"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request emitted in one step.

    Attributes:
        rid: the request.
        new_token_ids: the tokens sampled this step (one per step; EOS and stop tokens included).
        text: the new text of this step; never ends inside a multi-byte character, excludes stop
            strings and the text of EOS / stop tokens, and may be "" while text is held back.
        finished: the request ended this step.
        finish_reason: "stop" (EOS, a stop token or string), "length" (max_tokens), "error" (this
            request's sampling failed; it alone ended, with no token) or None.
        num_prompt_tokens: the prompt's length, in tokens.
        num_generated: tokens generated so far, this step's included.
        num_cached_tokens: with prefix caching, the prompt tokens found cached at the request's first
            admission (OpenAI's usage.prompt_tokens_details.cached_tokens); None without caching.
        error: why the request failed, when finish_reason is "error"; None otherwise.
    """

    rid: Hashable
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated: int
    num_cached_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What does not change while an engine runs: the facts a server checks requests against.

    Attributes:
        model_name: the name reported to clients.
        vocab_size: token ids are in [0, vocab_size).
        max_model_len: the context length, in tokens (prompt + completion).
        max_token_chars: the most characters one token decodes to; a text longer than
            max_model_len * max_token_chars characters cannot fit the context (a bound checked
            without tokenizing).
        token_budget: the most tokens in one step.
        max_seqs: the most running requests.
        kv_total_tokens: KV cache capacity, in tokens (num_blocks * block_size under "paged").
        num_blocks: KV blocks in the cache.
        block_size: tokens per KV block.
        kv_policy: "reserve" (KV for prompt + max_tokens reserved at admission) or "paged" (blocks
            taken as tokens are computed; preemption by recompute when they run out).
        scheduling_policy: "fcfs" (a request's priority has no effect) or "priority".
        device: the torch device the model runs on, e.g. "cpu" or "cuda:0".
        dtype: the model's dtype, e.g. "float32".
        max_token_alnum: the most ASCII letters and digits one token decodes to; a text with more than
            max_model_len * max_token_alnum of them cannot fit the context either (a tighter bound for
            text without spaces); 0 when not known.
        max_token_bytes: the most UTF-8 bytes of prompt text one token stands for; a text of more than
            max_model_len * max_token_bytes bytes cannot fit the context (the bound for text of
            multi-byte characters, where the character count says too little); 0 when not known.
        enable_lora: LoRA adapters may be served (load_lora_adapter); a request may name one.
        max_loras: the most distinct adapters in one step (the scheduler's max_loras); None: no limit.
        max_lora_rank: the largest adapter rank accepted; None without LoRA.
    """

    model_name: str
    vocab_size: int
    max_model_len: int
    max_token_chars: int
    token_budget: int
    max_seqs: int
    kv_total_tokens: int
    num_blocks: int
    block_size: int
    kv_policy: str
    scheduling_policy: str
    device: str = "cpu"
    dtype: str = "float32"
    max_token_alnum: int = 0
    max_token_bytes: int = 0
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """A served LoRA adapter as a server lists it (LLMEngine.lora_adapters).

    Attributes:
        name: the name requests give in `model`.
        path: its folder.
        rank: r.
        lora_id: the id the scheduler counts it by (unique for the engine's life).
        num_requests: requests added with it so far.
        num_loads: times its weights were put on the device so far (at most max_loras are there at once).
    """

    name: str
    path: str
    rank: int
    lora_id: int
    num_requests: int = 0
    num_loads: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine between steps (read with no step in flight).

    Attributes:
        num_running: requests admitted and not finished.
        num_waiting: requests not admitted yet (preempted ones included).
        num_will_wait: of those, how many the next step will not admit, whatever holds them back
            (no free slot, too little KV, or no budget left); the rest start at the next step.
        kv_free_tokens: KV not in use (unreserved under "reserve"; free blocks x block_size under
            "paged"), in tokens.
        kv_total_tokens: KV capacity, in tokens.
        num_preemptions: running requests preempted so far (always 0 under "reserve").
        last_step_tokens: tokens in the last step's batch (0 before the first step).
        prefix_cache_queries, prefix_cache_hits: prefix caching: prompt tokens looked up at admissions
            and found cached, so far (vLLM's counters; 0 without caching).
        prefix_cache_cpu_hits: of prefix_cache_hits, the tokens found in a CPU KV tier (0 without one).
        kv_blocks_loaded, kv_blocks_offloaded: KV blocks copied from a CPU tier into the cache and
            from the cache to the tier, so far (0 without one).
    """

    num_running: int
    num_waiting: int
    num_will_wait: int
    kv_free_tokens: int
    kv_total_tokens: int
    num_preemptions: int
    last_step_tokens: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_cpu_hits: int = 0
    kv_blocks_loaded: int = 0
    kv_blocks_offloaded: int = 0

    @property
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use, 0..1."""
        return 1.0 - self.kv_free_tokens / self.kv_total_tokens if self.kv_total_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Headroom:
    """What the next step leaves for requests not yet added, after admitting the waiting ones it can.

    A new request (prompt_tokens, max_tokens) would start at the next step only if none of the waiting
    requests will wait (strict first come, first served) and it fits all three; see LLMEngine.headroom.

    Attributes:
        will_wait: waiting requests the next step will not admit.
        slots: free sequence slots left.
        kv_tokens: KV left, in tokens (what a request needs: prompt + max_tokens under "reserve", its
            first chunk's blocks above the watermark under "paged").
        budget_tokens: step budget left for prompt tokens.
        reserve: True when a request needs KV for prompt + max_tokens at admission ("reserve");
            False when it needs the blocks of its first chunk ("paged").
        block_size: tokens per KV block (what a chunk's KV is rounded up to under "paged").
    """

    will_wait: int
    slots: int
    kv_tokens: int
    budget_tokens: int
    reserve: bool = True
    block_size: int = 1

    def kv_needed(self, prompt_tokens: int, max_tokens: int, chunk_tokens: int) -> int:
        """KV a new request needs to be admitted, in tokens, when its first chunk is `chunk_tokens`."""
        if self.reserve:
            return prompt_tokens + max_tokens
        return -(-chunk_tokens // self.block_size) * self.block_size


class Admission:
    """The engine's admission rule as of the last step boundary, which a server may ask from its own thread
    while the next step runs (LLMEngine.admission): a detached copy of the scheduler and a builder of the
    scheduler's requests (tokenize, hash the prompt blocks with the request's cache salt).

    Args:
        scheduler: a detached scheduler copy (stallfree.core.Scheduler.snapshot()).
        make_request: (rid, prompt, params, priority, cache_salt[, tenant[, lora]]) -> the stallfree.core.Request
            the engine would add, or None when the engine would refuse the prompt.
    """

    __slots__ = ("_make", "_scheduler")

    def __init__(self, scheduler: Any, make_request: Callable[..., CoreRequest | None]) -> None:
        self._scheduler = scheduler
        self._make = make_request

    def request(self, rid: Hashable, prompt: Any, params: Any, priority: int = 0,
                cache_salt: str | None = None, tenant: str | None = None,
                lora: str | None = None) -> CoreRequest | None:
        """The scheduler's Request for a request not yet added (None: the engine would refuse it)."""
        if lora is not None:
            return self._make(rid, prompt, params, priority, cache_salt, tenant, lora)
        if tenant is None:  # builders written before tenants take five arguments
            return self._make(rid, prompt, params, priority, cache_salt)
        return self._make(rid, prompt, params, priority, cache_salt, tenant)

    def waiting_after(self, requests: Sequence[CoreRequest]) -> int:
        """Requests waiting after the next step if `requests` were added now, in this order, those already
        waiting included: the next step planned by the scheduler's own rules (Scheduler.headroom)."""
        return int(self._scheduler.headroom(requests).will_wait)


@runtime_checkable
class EngineClient(Protocol):
    """The engine as a server sees it (LLMEngine implements it; so do test fakes).

    A server uses nothing else: no attribute of the engine's scheduler, no inspection of signatures.
    Only one thread may call it at a time, and never during step().
    """

    @property
    def info(self) -> EngineInfo:
        """The engine's fixed facts."""

    def stats(self) -> EngineStats:
        """A snapshot of its queues and KV cache."""

    def headroom(self) -> Headroom:
        """What the next step leaves after admitting the waiting requests it can."""

    def admission(self) -> Admission:
        """Its admission rule as of now (call between steps), to be asked from any thread."""

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt (thread-safe: a server may call it from another thread, even during step())."""

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        """Render chat messages as a prompt (thread-safe like encode)."""

    def add_request(self, rid: Hashable, prompt: str | Sequence[int], params: Any, *, priority: int = 0) -> None:
        """Queue a request; raises an EngineError (a ValueError) that names the field when it is refused.
        Keywords cache_salt, tenant and lora (a served adapter's name) are passed only when set."""

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve a PEFT adapter folder under `name`; InvalidLoraAdapter naming what is refused."""

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (running requests finish with it); InvalidLoraAdapter when not served."""

    def lora_adapters(self) -> list[LoraInfo]:
        """The served adapters by name ([] without LoRA)."""

    def abort(self, rid: Hashable) -> None:
        """Abort a request; KeyError when unknown."""

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    def step(self) -> list[RequestOutput]:
        """Run one step; raises StepFailed (with the step's rids) when it fails."""
