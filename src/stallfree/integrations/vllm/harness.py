"""A CPU harness for vLLM schedulers: build one without an engine, feed it requests, answer each step with a
fake model output (as vLLM's own scheduler tests do), and record the plans.

Imports allowed: the standard library, stallfree.core and vLLM 0.33 or 0.34 (with torch, which vLLM imports).

Used by tests/integrations/ and benchmarks/vllm_side_by_side.py; the model config is read from the Hugging
Face cache (offline in the environment of benchmarks/vllm_cpu/make_env.sh), no weights are loaded.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request as VllmRequest
from vllm.v1.structured_output import StructuredOutputManager

from stallfree.integrations.vllm import _compat

__all__ = ["EOS", "StepRecord", "fake_model_output", "make_request", "make_scheduler", "run_workload"]

#: The end-of-sequence token id of the harness's requests (a fake model samples it to stop a request).
EOS = 2
_hash_ready = False


def make_scheduler(
    cls: type = VllmScheduler,
    *,
    model: str = "facebook/opt-125m",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    num_blocks: int = 10_000,
    block_size: int = 16,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = False,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    scheduler_reserve_full_isl: bool = True,
    additional_config: Mapping[str, Any] | None = None,
    num_speculative_tokens: int = 0,
    prefill_schedule_interval: int = 1,
    sliding_window: int | None = None,
    scheduler_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Build a vLLM scheduler of class `cls` over `num_blocks` KV blocks of `block_size` tokens (one
    full-attention group, and a second, sliding-window group of `sliding_window` tokens when given: a hybrid
    model), as vLLM's tests do; max_model_len defaults to max_num_batched_tokens.
    num_speculative_tokens > 0: speculative decoding with vLLM's n-gram drafter config (k drafts per step, no
    draft slots; the GPU n-gram drafter for an async class), as vLLM's tests configure it.
    scheduler_kwargs: more fields of vLLM's SchedulerConfig (e.g. a knob only one vLLM version has)."""
    model_config = ModelConfig(model=model, dtype="float16", seed=42, max_model_len=max_model_len)
    mml = max_model_len or max_num_batched_tokens
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=mml,
        long_prefill_token_threshold=long_prefill_token_threshold, async_scheduling=issubclass(cls, AsyncScheduler),
        is_encoder_decoder=False, watermark=0.0, policy=policy,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl, prefill_schedule_interval=prefill_schedule_interval,
        **dict(scheduler_kwargs or {}),
    )
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=enable_prefix_caching)
    spec_config = None
    if num_speculative_tokens:
        # vLLM's async scheduling takes the GPU n-gram drafter (its tests' configuration).
        extra = ({"method": "ngram_gpu", "prompt_lookup_max": num_speculative_tokens, "prompt_lookup_min": 1}
                 if issubclass(cls, AsyncScheduler) else {})
        spec_config = SpeculativeConfig(model="ngram", num_speculative_tokens=num_speculative_tokens, **extra)
    config = VllmConfig(scheduler_config=sched, model_config=model_config, cache_config=cache,
                        additional_config=dict(additional_config or {}), speculative_config=spec_config)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer"], spec)]
    if sliding_window is not None:
        window = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                   sliding_window=sliding_window)
        groups.append(KVCacheGroupSpec(["window_layer"], window))
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cache.num_gpu_blocks = num_blocks
    s = cls(vllm_config=config, kv_cache_config=kv_config, block_size=block_size, log_stats=False,
            structured_output_manager=StructuredOutputManager(config))
    if _compat.V1_RUNNER:  # vLLM 0.33: the model runner its own tests' schedulers use
        s.use_v2_model_runner = False
    return s


def make_request(
    rid: str, prompt_len: int, max_tokens: int, *, priority: int = 0, arrival: float | None = None,
    prompt_token_ids: list[int] | None = None, block_size: int = 16,
    images: Iterable[tuple[int, int]] = (),
) -> VllmRequest:
    """A vLLM request of `prompt_len` tokens (by default one token id repeated, derived from the rid by CRC-32,
    so that requests with different rids share no prefix) generating at most `max_tokens` tokens; EOS stops it.
    `images`: (offset, length) in tokens of each multimodal placeholder (an image whose encoder output has
    `length` embeddings, identified by rid and index)."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    ids = prompt_token_ids if prompt_token_ids is not None else [10 + zlib.crc32(rid.encode()) % 30_000] * prompt_len
    features = [
        MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy(), mm_position=PlaceholderRange(offset=o, length=n),
                              identifier=f"{rid}-image{i}", modality="image")
        for i, (o, n) in enumerate(images)
    ]
    return VllmRequest(
        request_id=rid, prompt_token_ids=list(ids), sampling_params=params, pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256), priority=priority,
        arrival_time=time.time() if arrival is None else arrival, mm_features=features or None,
    )


def fake_model_output(scheduler_output: Any, requests: Mapping[str, VllmRequest], stop: Iterable[str] = ()) -> Any:
    """A ModelRunnerOutput for a step: each request whose scheduled tokens reach the end of its known tokens
    samples one token (EOS for the rids in `stop`, else token 7); a prefill chunk short of it samples none."""
    stop = set(stop)
    ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in ids:
        r = requests.get(rid)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        sampled.append(([EOS] if rid in stop else [7]) if done else [])
    return _compat.model_runner_output(ids, sampled)


@dataclass
class StepRecord:
    """One step of a run: the tokens each request got (batch order), the preempted rids, the schedule() time."""

    tokens: dict[str, int]
    preempted: tuple[str, ...]
    seconds: float
    finished: tuple[str, ...] = field(default_factory=tuple)


def run_workload(
    scheduler: Any,
    arrivals: Mapping[int, list[VllmRequest]],
    stops: Mapping[str, int] | None = None,
    max_steps: int = 100_000,
) -> list[StepRecord]:
    """Drive `scheduler` synchronously (schedule, fake output, update_from_output) until every request ends.

    Args:
        arrivals: step -> the requests added before that step's schedule().
        stops: rid -> the output token (1-based) on which it samples EOS; others run to max_tokens.
        max_steps: a bound that raises RuntimeError when reached (a scheduler that stalls).
    """
    stops = dict(stops or {})
    records: list[StepRecord] = []
    pending = sorted(arrivals)
    step = 0
    while True:
        while pending and pending[0] <= step:
            for r in arrivals[pending.pop(0)]:
                scheduler.add_request(r)
        if not pending and not scheduler.has_unfinished_requests():
            return records
        t0 = time.perf_counter()
        out = scheduler.schedule()
        dt = time.perf_counter() - t0
        reqs = scheduler.requests
        stop_now = [rid for rid in out.num_scheduled_tokens
                    if rid in stops and reqs[rid].num_computed_tokens >= reqs[rid].num_tokens
                    and reqs[rid].num_output_tokens + 1 == stops[rid]]
        result = scheduler.update_from_output(out, fake_model_output(out, reqs, stop_now))
        finished = tuple(o.request_id for outs in result.values() for o in outs.outputs if o.finish_reason is not None)
        records.append(StepRecord(dict(out.num_scheduled_tokens), tuple(sorted(out.preempted_req_ids or ())), dt,
                                  finished))
        step += 1
        if step >= max_steps:
            raise RuntimeError(f"run_workload: not done after {max_steps} steps")
