"""How the vLLM adapter is configured, and what it refuses: vLLM's own flags where they exist, stallfree's own
options through `--additional-config '{"stallfree": {...}}'`, and the vLLM features it does not support.

Imports allowed: the standard library and stallfree.core. vLLM's config objects are read by attribute
only, so this module needs no vLLM import.

vLLM flags read (SchedulerConfig / CacheConfig of vLLM 0.33):

- --max-num-batched-tokens (or max_num_scheduled_tokens when set): the token budget of a step;
- --max-num-seqs (or max_num_active_seqs when set): the most running requests;
- --scheduling-policy fcfs | priority;
- --long-prefill-token-threshold: T of the partial-prefill rules when max_num_partial_prefills > 1
  (otherwise unused: stallfree's K = 1 contract has one partial prefill and no long/short distinction);
- --enable-prefix-caching, --watermark, scheduler_reserve_full_isl: obeyed by vLLM's KV cache manager, which
  keeps the blocks;
- --enable-lora's --max-loras (LoRAConfig.max_loras): the core's max_loras, the most distinct adapters among
  the running requests and so in one step (stallfree.core.lora); a request's adapter is its
  lora_request.lora_int_id (`core_lora`), as vLLM's own scheduler counts it.

stallfree's options (the keys of the "stallfree" object; any other key is refused):

- max_num_partial_prefills (K, default 1), max_long_partial_prefills (L, default 1 when K > 1),
  long_prefill_token_threshold (T in tokens; default vLLM's flag when set, else 4% of max_model_len, vLLM's
  own default for that threshold);
- aging_interval (> 0; under --scheduling-policy priority only): a waiting request's effective priority
  drops by one every aging_interval steps (or seconds with "aging_clock": "wall", measured from the
  request's arrival_time, wall-clock seconds as vLLM stamps it);
- decode_overflow: "oldest" (default) or "rotate" (fcfs only): which decodes run when they exceed the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stallfree.core.config import SchedulerConfig
from stallfree.core.errors import InvalidConfig

__all__ = ["StallfreeOptions", "core_config", "core_lora", "refused_features", "refused_request_features"]

_KEYS = (
    "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold", "aging_interval",
    "aging_clock", "decode_overflow",
)


@dataclass(frozen=True)
class StallfreeOptions:
    """stallfree's options inside vLLM, from `additional_config["stallfree"]`.

    Attributes:
        max_num_partial_prefills: K, prompts partially prefilled at once (1: the contract).
        max_long_partial_prefills: L, of those at most this many long; None: 1 when K > 1.
        long_prefill_token_threshold: T in tokens; None: vLLM's flag when > 0, else 4% of max_model_len.
        aging_interval: steps (or seconds, aging_clock "wall") per unit of priority aging; None: static.
        aging_clock: "steps" or "wall".
        decode_overflow: "oldest" or "rotate".
    """

    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    aging_interval: float | None = None
    aging_clock: str = "steps"
    decode_overflow: str = "oldest"

    @classmethod
    def from_additional_config(cls, additional_config: object) -> StallfreeOptions:
        """Read the "stallfree" object of vLLM's additional_config (a dict; absent: the defaults).

        Raises:
            InvalidConfig: "stallfree" is not an object, has a key other than the options above, or a value
                of the wrong type or out of range; the message names the key and the value.
        """
        if not isinstance(additional_config, Mapping):
            return cls()
        raw = additional_config.get("stallfree", {})
        if not isinstance(raw, Mapping):
            raise InvalidConfig(f'additional_config "stallfree" must be a JSON object, got {raw!r}')
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise InvalidConfig(
                f'additional_config "stallfree" has unknown key(s) {unknown}; the options are {list(_KEYS)}'
            )
        clock = raw.get("aging_clock", "steps")
        if clock not in ("steps", "wall"):
            raise InvalidConfig(f'additional_config "stallfree".aging_clock must be "steps" or "wall", got {clock!r}')
        for key in ("max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold"):
            value = raw.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidConfig(f'additional_config "stallfree".{key} must be an integer, got {value!r}')
        return cls(
            max_num_partial_prefills=raw.get("max_num_partial_prefills", 1),
            max_long_partial_prefills=raw.get("max_long_partial_prefills"),
            long_prefill_token_threshold=raw.get("long_prefill_token_threshold"),
            aging_interval=raw.get("aging_interval"),
            aging_clock=clock,
            decode_overflow=raw.get("decode_overflow", "oldest"),
        )


def core_config(vllm_config: Any, options: StallfreeOptions, kv_tokens: int, block_size: int) -> SchedulerConfig:
    """The stallfree.core SchedulerConfig that vLLM's config and `options` give: vLLM's budget and sequence
    limit, --max-loras when LoRA is on, its policy (priority ties by arrival_time, as vLLM orders them), paged
    KV in vLLM's blocks with no watermark of our own (vLLM's KV cache manager, which the adapter's KV manager
    asks, keeps its own), and the additional_config options (aging, decode overflow, partial prefills; T's
    default is 4% of vLLM's max_model_len, the config's own rule).

    Args:
        kv_tokens: the KV capacity, tokens (vLLM's free blocks x block_size).
        block_size: vLLM's KV block size, tokens.

    Raises:
        InvalidConfig: a field out of range, naming it (additional_config "stallfree": L or T with K = 1).
    """
    sc = vllm_config.scheduler_config
    kw: dict[str, Any] = {}
    if options.aging_interval is not None:
        kw["aging_interval"] = options.aging_interval
        if options.aging_clock == "wall":
            clock: Callable[[], float] = time.time
            kw["clock"] = clock
    if options.max_num_partial_prefills != 1:
        kw["max_num_partial_prefills"] = options.max_num_partial_prefills
        kw["max_long_partial_prefills"] = options.max_long_partial_prefills
        kw["long_prefill_token_threshold"] = options.long_prefill_token_threshold or sc.long_prefill_token_threshold \
            or None
    elif options.max_long_partial_prefills is not None or options.long_prefill_token_threshold is not None:
        raise InvalidConfig(
            'additional_config "stallfree": max_long_partial_prefills and long_prefill_token_threshold apply '
            "when max_num_partial_prefills > 1; got max_num_partial_prefills = 1"
        )
    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is not None:
        kw["max_loras"] = int(lora_config.max_loras)
    return SchedulerConfig(
        token_budget=sc.max_num_scheduled_tokens or sc.max_num_batched_tokens,
        max_seqs=sc.max_num_active_seqs or sc.max_num_seqs, kv_tokens=kv_tokens, kv_policy="paged",
        block_size=block_size, watermark=0.0, policy=str(sc.policy), decode_overflow=options.decode_overflow,
        priority_ties="arrival", max_model_len=vllm_config.model_config.max_model_len, **kw)


def refused_features(vllm_config: Any, kv_cache_config: Any) -> list[str]:
    """The vLLM features in use that the adapter does not support, each named with the flag that turns it on;
    empty when none. The scheduler refuses to build with any of them (InvalidConfig listing them all).
    `kv_cache_config` (vLLM's KVCacheConfig) is accepted with any KV cache groups."""
    out = []
    mc = vllm_config.model_config
    sc = vllm_config.scheduler_config
    pc = vllm_config.parallel_config
    if getattr(mc, "is_encoder_decoder", False):
        out.append("encoder-decoder models")
    if getattr(mc, "is_diffusion", False):
        out.append("diffusion models")
    elif getattr(mc, "runner_type", "generate") != "generate":
        out.append(f"runner {getattr(mc, 'runner_type', '?')!r} (pooling; only generating models are supported)")
    # Any KV cache groups (hybrid, Mamba, sliding-window or chunked attention): vLLM's KV cache manager, which
    # the core asks for every admission and growth, allocates and frees their blocks.
    if pc.pipeline_parallel_size > 1:
        out.append("pipeline parallelism (--pipeline-parallel-size > 1)")
    if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
        out.append("context parallelism (--decode-context-parallel-size / --prefill-context-parallel-size)")
    if getattr(sc, "long_prefill_token_threshold_adaptive", False):
        out.append("--long-prefill-token-threshold-adaptive")
    return out


def core_lora(request: Any) -> int | None:
    """The core's adapter of a vLLM Request: its lora_request's lora_int_id (vLLM's own key for counting
    adapters against max_loras), or None for the base model (no lora_request)."""
    lora_request = getattr(request, "lora_request", None)
    return None if lora_request is None else int(lora_request.lora_int_id)


def refused_request_features(request: Any) -> list[str]:
    """The per-request features of a vLLM Request that the adapter does not support; empty when none. Such a
    request is finished with an error naming them, never scheduled. (Multimodal inputs and structured outputs
    are supported: see the scheduler's chunk cap.)"""
    out = []
    if getattr(request, "pooling_params", None) is not None:
        out.append("pooling")
    if getattr(request, "resumable", False):
        out.append("streaming input sessions")
    if getattr(request, "kv_transfer_params", None):
        out.append("KV transfer parameters")
    return out
