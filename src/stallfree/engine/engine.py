"""LLMEngine: owns a scheduler, the model and its paged KV cache, and runs one forward pass per step.

Imports allowed: the standard library, torch, stallfree.core, stallfree.engine.

Each step() is the scheduler's schedule(), one forward pass over the plan's flat batch, sampling,
and complete(plan, stopped): the step loop of iteration-level scheduling (Orca, OSDI'22) with
chunked prefill (Sarathi-Serve, OSDI'24).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stallfree.core import FinishReason, InvalidConfig, Request, RequestStatus, Scheduler, SchedulerConfig, StepPlan
from stallfree.core.errors import check_positive_int
from stallfree.core.kv_tier import TieredKV
from stallfree.core.prefix_cache import hash_blocks
from stallfree.engine.batch import BatchBuilder
from stallfree.engine.errors import (
    EngineError,
    InvalidLoraAdapter,
    InvalidPrompt,
    StepFailed,
)
from stallfree.engine.inputs import InputProcessor
from stallfree.engine.kv_cache import HostKVCache, KVCache
from stallfree.engine.lora import LoraManager, LoraStep
from stallfree.engine.model import LlamaModel
from stallfree.engine.outputs import Admission, EngineInfo, EngineStats, Headroom, LoraInfo, RequestOutput
from stallfree.engine.sampling import NO_TOKEN, SamplingParams, sample_tokens
from stallfree.engine.stops import StopMatcher
from stallfree.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from stallfree.engine.weights import load_checkpoint

__all__ = ["KV_POLICIES", "SCHEDULING_POLICIES", "LLMEngine", "RequestOutput", "default_kv_tokens", "engine_config",
           "resolve_device", "resolve_dtype"]

#: The KV policies (docs/engine.md): "reserve" keeps prompt + max_tokens of KV per request from admission;
#: "paged" takes blocks as tokens are computed and preempts by recompute when they run out (vLLM).
KV_POLICIES = ("reserve", "paged")
#: The scheduling policies: "fcfs" (arrival order) and "priority" (lower priority values first, with aging).
SCHEDULING_POLICIES = ("fcfs", "priority")
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# KV memory when kv_tokens is not given: 2 GiB on CPU; half the free memory on a GPU.
_CPU_KV_BYTES = 2 * 1024**3
_GPU_KV_FRACTION = 0.5


class _Seq:
    """The engine's record of one live request: its tokens, text and sampler. Engine-owned."""

    __slots__ = ("rid", "params", "token_ids", "num_prompt", "num_generated", "detok", "text",
                 "emitted", "hold", "cut", "generator", "aborted", "cached", "stops", "lora")

    def __init__(self, rid: Hashable, ids: list[int], params: SamplingParams, tok: Tokenizer,
                 generator: torch.Generator | None) -> None:
        self.rid = rid
        self.params = params
        self.token_ids = ids  # prompt, then generated tokens; position p is token_ids[p]
        self.num_prompt = len(ids)
        self.num_generated = 0
        self.detok = IncrementalDetokenizer(tok)
        self.text = ""  # all output text so far (stop strings cut off)
        self.emitted = 0  # characters of `text` already returned
        # Characters held back so a stop string split across steps is never partly returned.
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.cut = False  # a stop string was found and the text cut before it
        self.stops = StopMatcher(params.stop) if params.stop else None  # one pass over the text, any number of stops
        self.generator = generator
        self.aborted = False
        self.cached: int | None = None  # prefix caching: prompt tokens hit at the first admission
        self.lora: Hashable | None = None  # the adapter's lora_id (Request.lora); None: the base model


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Return `device`, or cuda when None and a GPU is present, else cpu.

    Raises:
        EngineError: cuda was asked for and none is present, or the name is unknown.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EngineError(f"device {device!r} is not a torch device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} asked for, but CUDA is not available")
    return dev


def cpu_has_bf16_matrix_units() -> bool:
    """True when this CPU multiplies bfloat16 matrices in hardware: Intel AMX tiles and AVX512-BF16,
    reached through oneDNN. Read from torch's own CPU feature check; False where torch cannot tell.

    Measured on such a CPU (one thread, docs/engine.md): a [16, 576] x [576, 3072] matmul takes
    0.43 ms in bfloat16 against 1.09 ms in float32, and a whole batched run of the bundled model
    half the time. CPUs without these units run bfloat16 matmuls slower than float32.
    """
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.cpu._is_amx_tile_supported()
                    and torch.cpu._is_avx512_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype used when none is given: bfloat16 on a GPU and on a CPU with bf16 matrix units
    (cpu_has_bf16_matrix_units), float32 on other CPUs (see from_pretrained for why)."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_bf16_matrix_units():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32"/"bf16"/"bfloat16"/"fp16"/"float16" (or a torch.dtype) to a torch.dtype.

    Raises:
        EngineError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise EngineError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None


def _check_policies(kv_policy: str, scheduling_policy: str) -> None:
    """Raise InvalidConfig naming the field when a policy is unknown or the pair is not available."""
    if kv_policy not in KV_POLICIES:
        raise InvalidConfig(f"kv_policy must be one of {list(KV_POLICIES)}, got {kv_policy!r}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise InvalidConfig(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {scheduling_policy!r}")


def engine_config(token_budget: int = 512, max_seqs: int = 64, kv_tokens: int = 16, block_size: int = 16,
                  kv_policy: str = "reserve", scheduling_policy: str | None = None, **options: Any) -> SchedulerConfig:
    """A SchedulerConfig with the engine's defaults (LLMEngine, `generate`, `serve`): budget 512 and 64
    sequences (a CPU's), 16-token blocks, under "reserve" whole-block reservations with unaligned chunks
    (as under "paged"); `scheduling_policy` is SchedulerConfig.policy (either name may be given).

    Args:
        token_budget, max_seqs, kv_tokens (tokens), block_size (tokens), kv_policy: as SchedulerConfig.
        scheduling_policy: "fcfs" or "priority" (default fcfs).
        **options: any other SchedulerConfig field by name (enable_prefix_caching, the partial-prefill
            limits, cpu_kv_tokens, max_model_len, policy, ...).

    Raises:
        InvalidConfig: a value the scheduler refuses, or an unknown policy; the message names the field.
    """
    policy = options.pop("policy", None) or scheduling_policy or "fcfs"
    _check_policies(kv_policy, policy)
    options.setdefault("align_chunks", None if kv_policy == "paged" else False)
    return SchedulerConfig(token_budget, max_seqs, kv_tokens, kv_policy=kv_policy, block_size=block_size,
                           policy=policy, **options)


def default_kv_tokens(model: LlamaModel, max_seqs: int) -> int:
    """The engine's KV capacity when none is given, tokens: min(max_model_len x max_seqs, what fits in 2 GiB
    on a CPU or half the free memory on a GPU), at least max_model_len. Bytes per token: 2 (K and V) x
    layers x KV heads x head_dim x the model dtype's element size."""
    cfg = model.config
    elem = torch.tensor([], dtype=model.dtype).element_size()
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        memory = int(free * _GPU_KV_FRACTION)
    else:
        memory = _CPU_KV_BYTES
    return min(cfg.max_model_len * max_seqs, max(cfg.max_model_len, memory // per_token))


_WARNED: set[str] = set()


def _warn_once(old: str, new: str) -> None:
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=4)


def _fit_config(config: SchedulerConfig, max_model_len: int) -> SchedulerConfig:
    """`config` as the engine runs it: 16-token blocks when it names none (the engine follows block
    tables), kv_tokens rounded up to whole blocks (never below what the cache was sized for), the
    model's context length when it gives none (T's default is 4% of it).

    Raises:
        InvalidConfig: the result is not a valid configuration.
    """
    if not isinstance(config, SchedulerConfig):
        raise InvalidConfig(f"scheduler must be a SchedulerConfig or a Scheduler, got {type(config).__name__}")
    bs = config.block_size or 16
    return config.replace(block_size=bs, kv_tokens=-(-config.kv_tokens // bs) * bs,
                          max_model_len=config.max_model_len or max_model_len)


def _tier_stats(s: Any) -> dict[str, int]:
    """EngineStats' CPU-tier counters from a scheduler (zeros without a tier)."""
    kv = getattr(s, "kv_manager", None)
    if not isinstance(kv, TieredKV):
        return {}
    return {"prefix_cache_cpu_hits": kv.tier_stats.cpu_hits, "kv_blocks_loaded": kv.tier.num_loads,
            "kv_blocks_offloaded": kv.tier.num_stores}


def salt_block_hashes(hashes: Sequence[int], salt: str) -> tuple[int, ...]:
    """Mix `salt` into each of a prompt's chained block hashes (hash_blocks), for vLLM's cache_salt.

    Salted hash i is the first 16 bytes of SHA-256 over "stallfree-cache-salt", SHA-256(salt as UTF-8)
    and unsalted hash i (16 bytes, little endian), read as an unsigned integer: equal salts and prefixes
    give equal hashes; different salts, or a salt and none, give different ones (up to a 2**-128
    collision chance), so they share no cached block. Mixing in here, rather than seeding the chain,
    keeps stallfree.core's hash_blocks unchanged.

    Args:
        hashes: hash_blocks' output, integers in [0, 2**128).
        salt: a non-empty string (UTF-8 encodable; a lone surrogate is encoded as surrogatepass).

    Returns:
        One salted hash per block, integers in [0, 2**128).
    """
    key = hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()
    out = []
    for h in hashes:
        d = hashlib.sha256(b"stallfree-cache-salt" + key + int(h).to_bytes(16, "little")).digest()
        out.append(int.from_bytes(d[:16], "little"))
    return tuple(out)


def _sample_rows_alone(logits: torch.Tensor, params: Sequence[SamplingParams],
                       gens: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample each row on its own after sample_tokens raised for the batch: a row that raises again
    gets NO_TOKEN (its request fails), every other row its token. Shapes: logits [S, V] -> [S] int64 (CPU)."""
    out = []
    for i in range(logits.shape[0]):
        try:
            out.append(int(sample_tokens(logits[i : i + 1], params[i : i + 1], gens[i : i + 1])[0]))
        except Exception:  # noqa: BLE001 - this row is at fault; it alone fails
            out.append(NO_TOKEN)
    return torch.tensor(out, dtype=torch.int64)


def _max_token_chars(tokenizer: Tokenizer) -> tuple[int, int, int]:
    """The most characters any token of `tokenizer` decodes to (at least 1), the most ASCII letters and
    digits in any one token (at least 1), and the most UTF-8 bytes of text any one token stands for (at
    least 1), from its vocabulary strings: a byte-level token's string has one character per byte (ASCII
    letters and digits stand for themselves), and a vocabulary string's UTF-8 length is never less than
    the bytes it stands for (a byte-level character is 1 or 2 bytes for 1; SentencePiece's U+2581 is 3
    for a space, "<0xAB>" 6 for one byte; a special token's string is what it matches in a prompt), so
    all three bound the text."""
    longest = alnum = most_bytes = 1
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_str(i)
        longest = max(longest, len(piece))
        alnum = max(alnum, sum(c.isascii() and c.isalnum() for c in piece))
        most_bytes = max(most_bytes, len(piece.encode("utf-8", "surrogatepass")))
    return longest, alnum, most_bytes


class LLMEngine:
    """Runs requests through a scheduler and a Llama-family model, one forward pass per step.

    It owns the scheduler, the model, the KV cache and the requests' tokens; the scheduler owns
    admission and the order of the batch. KV blocks: under either KV policy the engine writes and
    reads a request's KV where the scheduler's block table says (`scheduler.block_table`, read
    once a step for each prefill chunk and for each decode that starts a block); a preempted
    request is recomputed from its kept token ids. The cache holds the scheduler's blocks.

    Args:
        model: the decoder.
        tokenizer: its tokenizer.
        model_name: the name reported to clients.
        scheduler: a stallfree.SchedulerConfig (the engine builds Scheduler(config) with 16-token blocks
            when it names none, kv_tokens rounded up to whole blocks, the model's context length as
            max_model_len when it gives none; `engine_config(...)` makes one with the engine's defaults:
            budget 512, 64 sequences, reserve KV in whole blocks with unaligned chunks, FCFS), or a
            scheduler to use as it is (it must hand out block tables: `block_table` rid -> block ids,
            `block_size`, and `num_blocks` or `kv_total`), or None: engine_config() with the KV capacity
            of default_kv_tokens (min(max_model_len x 64, 2 GiB of KV on a CPU or half the free GPU
            memory)). Under kv_policy "paged" the engine reads and writes KV where the block tables say;
            with prefix caching each prompt's full blocks are hashed (hash_blocks); with cpu_kv_tokens a
            CPU KV tier's copies run before each forward pass (plan.kv_offloads, then kv_loads).
        *legacy, **legacy_options: the former form (token_budget, max_seqs, kv_tokens, block_size,
            scheduler, kv_policy, scheduling_policy, enable_prefix_caching, the partial-prefill limits,
            cpu_kv_tokens): deprecated, one warning; the same engine.

    Raises:
        InvalidConfig (a ValueError): token_budget, max_seqs, kv_tokens or block_size is not an
            integer >= 1, a policy is unknown or not available with the other, `scheduler`
            hands out no block tables (a reservation Scheduler built without a block_size), or
            cpu_kv_tokens is not an integer >= 0, or > 0 without paged KV and prefix caching, or
            below one block.
    """

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, model_name: str = "model", *legacy: Any,
                 scheduler: Any = None, enable_lora: bool = False,
                 lora_modules: Mapping[str, str | Path] | None = None, max_lora_rank: int = 16,
                 **legacy_options: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        cfg = model.config
        self.max_model_len = cfg.max_model_len
        self.eos_token_ids = tokenizer.eos_token_ids
        if legacy or legacy_options:
            scheduler = self._legacy_config(legacy, legacy_options, scheduler)
        if scheduler is None:
            scheduler = engine_config(kv_tokens=default_kv_tokens(model, 64))
        if not hasattr(scheduler, "schedule"):
            scheduler = Scheduler(_fit_config(scheduler, cfg.max_model_len))
        kv_policy = str(scheduler.config.kv_policy)
        config = getattr(scheduler, "config", None)
        scheduling_policy = config.policy if isinstance(config, SchedulerConfig) else "fcfs"
        self.scheduler = scheduler
        #: Prefix caching: prompts are hashed (hash_blocks) and cached KV blocks reused.
        self.enable_prefix_caching = bool(scheduler.config.enable_prefix_caching)
        self.kv_policy = kv_policy
        self.scheduling_policy = scheduling_policy
        table = scheduler.block_table
        if table is None:
            raise InvalidConfig("scheduler hands out no block tables (block_table is None): build it with "
                                "a block_size, e.g. Scheduler(..., block_size=16)")
        self._block_table: Callable[[Hashable], Sequence[int]] = table
        block_size = int(scheduler.config.block_size)
        num_blocks = int(scheduler.stats().num_blocks)
        self.block_size = block_size
        self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                          model.dtype, model.device)
        tier = getattr(scheduler, "kv_manager", None)
        #: A CPU KV tier's host blocks (None without one); plans' copies run through it.
        self.host_kv: HostKVCache | None = None
        if isinstance(tier, TieredKV):
            self.host_kv = HostKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tier.cpu_blocks, block_size,
                                       model.dtype, pin=model.device.type == "cuda")
        self._copied_step = -1  # the step whose KV copies are done (a retried plan does not redo them)
        self._builder = BatchBuilder(block_size, self.max_model_len, self.kv.pad_block,
                                     self._table_for, model.device)
        self._aborted: set[Hashable] = set()  # aborted while in the plan in flight
        self._seqs: dict[Hashable, _Seq] = {}
        self._pending: StepPlan | None = None
        self.last_plan: StepPlan | None = None
        #: LoRA adapters (engine/lora.py): None unless enable_lora; at most the scheduler's max_loras in a step.
        self.lora: LoraManager | None = None
        if enable_lora or lora_modules:
            check_positive_int("max_lora_rank", max_lora_rank)
            self.lora = LoraManager(cfg, getattr(scheduler.config, "max_loras", None), max_lora_rank,
                                    model.device, model.dtype)
            for lora_name, lora_path in (lora_modules or {}).items():
                self.lora.add(self.lora.read(lora_name, lora_path))
        self._num_lora_seqs = 0  # live requests with an adapter: a step looks for adapters only when > 0
        #: The one input processor: every prompt is checked and made a core Request there (engine/inputs.py).
        self.inputs = InputProcessor(tokenizer.encode, cfg.vocab_size, self.max_model_len, self._hashes,
                                     None if self.lora is None else self.lora.id_of)
        max_chars, max_alnum, max_bytes = _max_token_chars(tokenizer)
        self._info = EngineInfo(
            model_name=model_name, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
            max_token_chars=max_chars, max_token_alnum=max_alnum, max_token_bytes=max_bytes,
            token_budget=int(scheduler.config.token_budget),
            max_seqs=int(scheduler.config.max_seqs), kv_total_tokens=int(scheduler.stats().kv_total),
            num_blocks=num_blocks, block_size=block_size, kv_policy=kv_policy,
            scheduling_policy=scheduling_policy, device=str(model.device),
            dtype=str(model.dtype).removeprefix("torch."), enable_lora=self.lora is not None,
            max_loras=None if self.lora is None else self.lora.max_loras,
            max_lora_rank=None if self.lora is None else max_lora_rank,
        )

    # ------------------------------------------------------------------ the typed view (EngineClient)

    @property
    def info(self) -> EngineInfo:
        """The engine's fixed facts (model, vocabulary, context, KV capacity, policies)."""
        return self._info

    def stats(self) -> EngineStats:
        """A snapshot of the queues and the KV cache, from the scheduler's stats().

        Call it between steps (not while step() runs in another thread).
        """
        st = self.scheduler.stats()
        return EngineStats(
            num_running=st.num_running, num_waiting=st.num_waiting,
            num_will_wait=self.headroom().will_wait if st.num_waiting else 0,
            kv_free_tokens=st.kv_free, kv_total_tokens=st.kv_total, num_preemptions=st.num_preemptions,
            last_step_tokens=0 if self.last_plan is None else int(self.last_plan.num_tokens),
            prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits,
            **_tier_stats(self.scheduler),
        )

    def headroom(self) -> Headroom:
        """What the next step leaves, from the scheduler's own plan of it (Scheduler.headroom: exact under
        both KV policies, priority, caching hits and partial prefills); see Headroom. Under "paged" the
        KV left is counted above the watermark. Call it between steps.

        Cost: one copy of the scheduler and one schedule() on it.
        """
        s = self.scheduler
        h = s.headroom()
        reserve = self.kv_policy != "paged"
        kv = h.kv_free if reserve else (h.num_free_blocks - s.stats().watermark_blocks) * self.block_size
        return Headroom(h.will_wait, h.slots, kv, h.budget_tokens, reserve, self.block_size)

    def admission(self) -> Admission:
        """The admission rule as of now, for a server to ask from its own thread during the next step
        (Admission: a detached copy of the scheduler and this engine's request builder). Call it between
        steps. Cost: one copy of the scheduler."""
        return Admission(self.scheduler.snapshot(), self._core_request)

    def _core_request(self, rid: Hashable, prompt: str | Sequence[int], params: Any, priority: int,
                      cache_salt: str | None, tenant: str | None = None, lora: str | None = None) -> Request | None:
        """The scheduler's Request for a prompt (thread-safe: the input processor reads only the tokenizer
        and fixed facts); None when add_request would refuse the prompt."""
        try:
            return self.inputs.process(rid, prompt, params.max_tokens, priority=priority, cache_salt=cache_salt,
                                       tenant=tenant, lora=lora).request
        except ValueError:
            return None

    def _hashes(self, ids: Sequence[int], cache_salt: str | None) -> Sequence[int] | None:
        if not self.enable_prefix_caching:
            return None
        hashes = hash_blocks(ids, self.block_size)
        return hashes if cache_salt is None else salt_block_hashes(hashes, cache_salt)

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt (no chat template); safe to call from another thread during step().

        Raises:
            InvalidPrompt: the text cannot be tokenized (e.g. a lone surrogate).
        """
        return self.inputs.encode(text)

    @property
    def num_preemptions(self) -> int:
        """Running requests preempted so far (0 under the reservation scheduler)."""
        return int(self.scheduler.stats().num_preemptions)

    def _legacy_config(self, args: tuple[Any, ...], options: dict[str, Any], scheduler: Any) -> Any:
        """The former keyword form LLMEngine(model, tokenizer, name, token_budget, max_seqs, kv_tokens, block_size,
        scheduler, kv_policy, ...): its SchedulerConfig (engine_config), or the Scheduler it was given; warns once."""
        names = ("token_budget", "max_seqs", "kv_tokens", "block_size", "scheduler", "kv_policy", "scheduling_policy",
                 "enable_prefix_caching", "max_num_partial_prefills", "max_long_partial_prefills",
                 "long_prefill_token_threshold", "cpu_kv_tokens")
        if len(args) > len(names):
            raise TypeError(f"LLMEngine() takes at most {3 + len(names)} positional arguments")
        given = dict(zip(names, args, strict=False))
        for name, value in options.items():
            if name not in names or name in given:
                raise TypeError(f"LLMEngine() got an unexpected or repeated argument {name!r}")
            given[name] = value
        _warn_once("LLMEngine(token_budget=..., max_seqs=..., ...)",
                   "LLMEngine(model, tokenizer, name, scheduler=engine_config(...) or a SchedulerConfig)")
        if given.pop("scheduler", None) is not None or scheduler is not None:
            return scheduler if scheduler is not None else args[4]
        if given.get("kv_tokens") is None:
            given["kv_tokens"] = default_kv_tokens(self.model, given.get("max_seqs", 64))
        return engine_config(**given)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        token_budget: int = 512,
        max_seqs: int = 64,
        kv_tokens: int | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
        scheduler: Any = None,
        kv_policy: str = "reserve",
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = False,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int | None = None,
        long_prefill_token_threshold: int | None = None,
        compile: bool = False,
        max_model_len: int | None = None,
        cpu_kv_tokens: int = 0,
        kv_offloading_size: float | None = None,
        enable_lora: bool = False,
        lora_modules: Mapping[str, str | Path] | None = None,
        max_lora_rank: int = 16,
        **options: Any,
    ) -> LLMEngine:
        """Load a checkpoint and build an engine around it.

        Args:
            path: None for the bundled SmolLM2-135M-Instruct; a .gguf file; or a Hugging Face
                directory (config.json, *.safetensors, tokenizer.json).
            device: "cpu", "cuda", "cuda:N", or None (cuda when present, else cpu).
            dtype: "float32", "bfloat16" ("bf16") or "float16" ("fp16"); None (the default) picks
                bfloat16 on a GPU (tensor cores, half the bytes per weight and KV token, and
                float32's exponent range, so no fp16 overflow) and on a CPU with bf16 matrix units
                (Intel AMX: about twice the tokens/s of float32 on the bundled model), float32 on
                other CPUs (they run 16-bit matmuls several times slower than float32). Pass
                "float32" for greedy outputs equal to transformers' in float32; bfloat16 ones
                drift from them after a few tokens (docs/engine.md). Weights are dequantized to
                float32 first.
            compile: torch.compile the dense part of each layer (LlamaModel(compile=True)). Off by
                default: on this project's CPU it made decode steps no faster and took about 45 s
                to compile (docs/engine.md).
            max_model_len: cap the context at this many tokens (vLLM's --max-model-len), at most
                the checkpoint's own; None: the checkpoint's.
            kv_offloading_size: instead of cpu_kv_tokens, the CPU KV tier in GiB of host memory (vLLM's
                --kv-offloading-size; one rank here), converted with the model's KV bytes per token:
                floor(GiB x 2^30 / (2 x layers x KV heads x head_dim x bytes per element)) tokens.
            enable_lora, lora_modules, max_lora_rank: LoRA adapters (vLLM's --enable-lora, --lora-modules,
                --max-lora-rank; LLMEngine's): with LoRA and no max_loras in **options, max_loras=1 (vLLM's
                default), the most distinct adapters in one step.
            scheduler: a SchedulerConfig or a scheduler (as LLMEngine's); None: engine_config() of the
                scheduler keywords here (token_budget, max_seqs, kv_tokens (None: default_kv_tokens),
                block_size, kv_policy, scheduling_policy, enable_prefix_caching, the partial-prefill limits,
                cpu_kv_tokens) and **options (any other SchedulerConfig field by name).

        Raises:
            ModelLoadError: the checkpoint cannot be found or read (see load_checkpoint).
            EngineError: an unknown device or dtype, or cuda without a GPU.
            InvalidConfig: a scheduler argument out of range, or max_model_len above the checkpoint's.
        """
        # Check the scheduler's numbers before the (slow) checkpoint load.
        if (enable_lora or lora_modules) and scheduler is None:
            options.setdefault("max_loras", 1)
        check_positive_int("max_lora_rank", max_lora_rank)
        check_positive_int("token_budget", token_budget)
        check_positive_int("max_seqs", max_seqs)
        if kv_tokens is not None:
            check_positive_int("kv_tokens", kv_tokens)
        check_positive_int("block_size", block_size)

        def config_for(tier_tokens: int) -> SchedulerConfig:  # kv_tokens as given, or one block to check with
            return engine_config(token_budget, max_seqs, kv_tokens or block_size, block_size, kv_policy,
                                 scheduling_policy, enable_prefix_caching=enable_prefix_caching,
                                 max_num_partial_prefills=max_num_partial_prefills,
                                 max_long_partial_prefills=max_long_partial_prefills,
                                 long_prefill_token_threshold=long_prefill_token_threshold,
                                 cpu_kv_tokens=tier_tokens, **options)

        if scheduler is None:
            config_for(cpu_kv_tokens)
        elif cpu_kv_tokens or kv_offloading_size is not None or options:
            raise InvalidConfig("cpu_kv_tokens, kv_offloading_size and other scheduler fields size the scheduler the "
                                "engine builds: with scheduler=, give them in its SchedulerConfig instead")
        if kv_offloading_size is not None:
            if isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, (int, float)) or not (
                    0 < kv_offloading_size < math.inf):
                raise InvalidConfig(f"kv_offloading_size must be a number of GiB > 0, got {kv_offloading_size!r}")
            if cpu_kv_tokens:
                raise InvalidConfig("cpu_kv_tokens and kv_offloading_size both size the CPU KV tier: give one")
            config_for(block_size)
        dev = resolve_device(device)
        dt = default_dtype(dev) if dtype is None else resolve_dtype(dtype)
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len)
        ckpt = load_checkpoint(path)
        cfg = ckpt.config
        if max_model_len is not None:
            if max_model_len > cfg.max_model_len:
                raise InvalidConfig(f"max_model_len {max_model_len} is above the model's context length of "
                                    f"{cfg.max_model_len} tokens")
            cfg = dataclasses.replace(cfg, max_model_len=max_model_len)
        model = LlamaModel(cfg, ckpt.tensors, dtype=dt, device=dev, compile=compile)
        if kv_offloading_size is not None:
            per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dt).element_size()
            cpu_kv_tokens = int(kv_offloading_size * 2**30 // per_token)
            config_for(cpu_kv_tokens)
        if scheduler is None:
            scheduler = config_for(cpu_kv_tokens).replace(
                kv_tokens=kv_tokens or default_kv_tokens(model, max_seqs))
        return cls(model, ckpt.tokenizer, ckpt.name, scheduler=scheduler, enable_lora=enable_lora,
                   lora_modules=lora_modules, max_lora_rank=max_lora_rank)

    # ------------------------------------------------------------------ requests

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        """Render chat messages as a prompt, ending with the assistant turn's opening.

        Raises:
            ModelLoadError: the model has no chat template.
            ValueError: a malformed message (the message says which).
        """
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def add_request(
        self, rid: Hashable, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
        priority: int | None = None, cache_salt: str | None = None, tenant: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a request.

        Args:
            rid: a hashable id, unique among live requests.
            prompt: text (tokenized here; no chat template is applied) or token ids.
            params: sampling parameters (default SamplingParams()).
            priority: the request's priority (lower is more urgent); None takes params.priority. It
                has an effect only under scheduling_policy "priority".
            cache_salt: with prefix caching, a string mixed into every block hash of the prompt (vLLM's
                cache_salt): requests share cached blocks only when their salts are equal (None is its
                own salt, the unsalted hashes), so different salts share nothing.
            tenant: the client it is served for (Request.tenant; None: "default"); read by the scheduler
                under fairness="vtc" and by per-tenant queue time limits.
            lora: None (the base model) or the name of a served LoRA adapter (load_lora_adapter); the
                scheduler counts it by its lora_id, so at most max_loras distinct adapters run in a step.

        Raises:
            InvalidPrompt: the prompt is empty, not text or ids, holds an id outside the
                vocabulary, or rid is live; or priority is not an integer; or cache_salt is not a
                non-empty string.
            ContextLengthExceeded: prompt tokens + max_tokens > max_model_len.
            UnknownLora: lora names no served adapter.
            RequestRejected: the KV cache can never hold prompt + max_tokens tokens.
            Nothing is queued when any of these is raised.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidPrompt(f"params must be a SamplingParams, got {type(params).__name__}")
        if rid in self._seqs:
            raise InvalidPrompt(f"rid {rid!r} is already live")
        if priority is None:
            priority = params.priority
        processed = self.inputs.process(rid, prompt, params.max_tokens, priority=priority, cache_salt=cache_salt,
                                        tenant=tenant, lora=lora)
        ids = processed.token_ids
        # Everything that can fail happens before the scheduler holds the request: a request the
        # scheduler knows and the engine does not would break every later step.
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.model.device)
            if params.seed is not None:
                gen.manual_seed(params.seed)
            else:
                gen.seed()
        seq = _Seq(rid, ids, params, self.tokenizer, gen)
        self.scheduler.add(processed.request)
        self._seqs[rid] = seq
        if processed.request.lora is not None and self.lora is not None:
            seq.lora = processed.request.lora
            self.lora.acquire(seq.lora)
            self._num_lora_seqs += 1

    def abort(self, rid: Hashable) -> None:
        """Stop a request: it emits nothing more and its KV is released.

        A request in the step in flight (or in a failed step) is removed at that step's
        completion. A request that already finished is a no-op.

        Raises:
            KeyError: `rid` is unknown.
        """
        self.scheduler.abort(rid)
        seq = self._seqs.get(rid)
        if seq is None:
            return
        try:
            self.scheduler.request_state(rid)
        except KeyError:
            self._release(rid)
            return
        seq.aborted = True  # deferred by the scheduler: the plan in flight still holds it
        self._aborted.add(rid)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._seqs) or self.scheduler.has_unfinished()

    def _release(self, rid: Hashable) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None and seq.lora is not None and self.lora is not None:
            self.lora.release(seq.lora)
            self._num_lora_seqs -= 1
        self._aborted.discard(rid)
        self._builder.release(rid)

    def _table_for(self, rid: Hashable, num_tokens: int) -> Sequence[int]:
        """The scheduler's block table of `rid`; it covers the tokens of the plan in flight, so
        `num_tokens` (what the batch needs) is only a bound the batch builder checks."""
        return self._block_table(rid)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, one forward pass, sample, complete.

        Returns:
            One RequestOutput per request that emitted a token this step, in batch order
            (aborted requests emit nothing). A request whose own sampling failed (its logits or
            probabilities are not finite, or sampling its row alone raised) is aborted, its KV
            released, and gets one last output with no token, finish_reason "error" and `error`
            saying why; the other requests of the step go on as if it had not been there. A request
            that waited longer than max_queue_time_s (SchedulerConfig) gets one output with no token
            and finish_reason "timeout".

        Raises:
            StepFailed: building the batch, the forward pass or sampling raised (the cause is
                chained). The scheduler's plan stays in flight and no request advanced (a seeded
                sampler may have advanced); the next step() retries the same plan without the
                requests aborted in between, so a caller can abort the requests it suspects
                (StepFailed.rids) and carry on with the others.
        """
        plan = self._pending if self._pending is not None else self.scheduler.schedule()
        self._pending = plan
        self.last_plan = plan
        samplers: list[_Seq] = []
        try:
            tokens = self._execute(plan, samplers)
        except Exception as exc:
            rids = tuple(c.rid for c in plan)
            raise StepFailed(f"step {plan.step} failed ({type(exc).__name__}: {exc}); its plan "
                             "will be retried by the next step()", rids) from exc
        self._pending = None
        failed = [seq for seq, tok in zip(samplers, tokens, strict=True) if tok == NO_TOKEN]
        for seq in failed:
            self.scheduler.abort(seq.rid)  # in the plan in flight: it takes effect at complete()
        stopped = [seq.rid for seq, tok in zip(samplers, tokens, strict=True)
                   if tok != NO_TOKEN and self._append(seq, tok)]
        self.scheduler.complete(plan, stopped)
        finished = self.scheduler.last_finished
        outputs = [self._failed_output(seq) for seq in failed]
        for rid in plan.timed_out:  # waited past max_queue_time_s: ends with no token
            shed = self._seqs.get(rid)
            if shed is not None:
                outputs.append(RequestOutput(rid, [], "", True, str(FinishReason.TIMEOUT), shed.num_prompt, 0,
                                             shed.cached))
        stop_set = set(stopped)
        for seq, tok in zip(samplers, tokens, strict=True):
            if tok == NO_TOKEN:
                continue
            reason = finished.get(seq.rid)
            if reason is FinishReason.ABORT:
                continue
            if reason is not None and seq.rid in stop_set:
                # One rule wherever the token came from (a decode or a last prefill chunk, so also after
                # a preemption): EOS, a stop token or a stop string on the last allowed token is "stop",
                # as OpenAI and vLLM report it, not "length".
                reason = FinishReason.STOP
            outputs.append(self._output(seq, tok, reason))
        for rid in finished:
            self._release(rid)
        return outputs

    def _execute(self, plan: StepPlan, samplers: list[_Seq]) -> list[int]:
        """Build the flat batch of `plan`, run the model and sample; changes no request state
        (the builder's copy of each sampler's last token aside)."""
        if self.host_kv is not None and self._copied_step != plan.step:
            # Offloads first: a block the step evicts may be a load's destination.
            self.host_kv.offload(self.kv, plan.kv_offloads)
            self.host_kv.load(self.kv, plan.kv_loads)
            self._copied_step = plan.step
        if self.enable_prefix_caching:
            for chunk in plan.prefills:  # a few per step
                seq = self._seqs[chunk.rid]
                if seq.cached is None and not seq.aborted:
                    seq.cached = int(self.scheduler.num_cached_tokens(chunk.rid))  # live until complete()
        built = self._builder.build(plan, lambda rid: self._seqs[rid].token_ids,
                                    frozenset(self._aborted))
        if built is None:
            return []
        batch, rids, rows = built
        samplers.extend(self._seqs[rid] for rid in rids)
        lora_step = self._lora_step(plan) if self._num_lora_seqs else None
        # Without adapters the forward pass is called as it always was.
        logits = (self.model.forward(batch, self.kv) if lora_step is None
                  else self.model.forward(batch, self.kv, lora_step))
        params, gens = [s.params for s in samplers], [s.generator for s in samplers]
        try:
            tokens = sample_tokens(logits, params, gens).cpu()  # the step's one copy back
        except Exception:  # noqa: BLE001 - find the rows at fault: they fail alone, never the step
            tokens = _sample_rows_alone(logits, params, gens)
        self._builder.record(rows, tokens.clamp(min=0))
        return tokens.tolist()  # type: ignore[no-any-return]

    def _lora_step(self, plan: StepPlan) -> LoraStep | None:
        """The step's adapters and their rows, in the flat batch's order (BatchBuilder.build: the decodes in
        plan order, then each prefill chunk), aborted requests left out as the builder leaves them out."""
        assert self.lora is not None
        seqs, skip = self._seqs, self._aborted
        entries: list[tuple[Hashable | None, int]] = [
            (seqs[rid].lora, 1) for rid in plan.decode_rids if rid not in skip]
        entries += [(seqs[c.rid].lora, c.num_tokens) for c in plan.prefills if c.rid not in skip]
        return self.lora.step(entries, self.model.device)

    # ------------------------------------------------------------------ LoRA adapters

    def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter in folder `path` under `name` (vLLM's /v1/load_lora_adapter). Call it
        between steps; the running requests are untouched.

        Raises:
            InvalidLoraAdapter: LoRA is not enabled, the name is served already or malformed, or the
                folder is refused (engine/lora.py, read_peft_adapter: missing files, rank above
                max_lora_rank, a target module or shape not of the base model).
        """
        if self.lora is None:
            raise InvalidLoraAdapter("LoRA is not enabled on this engine (enable_lora=True, serve --enable-lora)")
        self.lora.add(self.lora.read(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name`: new requests naming it are refused; running ones finish with it, and
        its weights are dropped when the last of them ends.

        Raises:
            InvalidLoraAdapter: LoRA is not enabled, or no adapter of that name is served.
        """
        if self.lora is None:
            raise InvalidLoraAdapter("LoRA is not enabled on this engine (enable_lora=True, serve --enable-lora)")
        self.lora.remove(name)

    def lora_adapters(self) -> list[LoraInfo]:
        """The served adapters by name, with the requests added for each and its device loads so far."""
        return [] if self.lora is None else self.lora.served()

    def _failed_output(self, seq: _Seq) -> RequestOutput:
        """The last output of a request whose sampling failed (finish_reason "error", no token)."""
        why = ("sampling failed for this request (its logits or probabilities were not finite, "
               f"or sampling raised); temperature={seq.params.temperature}, top_p={seq.params.top_p}, "
               f"top_k={seq.params.top_k}, min_p={seq.params.min_p}")
        return RequestOutput(seq.rid, [], "", True, "error", seq.num_prompt, seq.num_generated,
                             seq.cached, error=why)

    def _append(self, seq: _Seq, tok: int) -> bool:
        """Record a sampled token and its text; return True when it ends the request (stop)."""
        seq.token_ids.append(tok)
        seq.num_generated += 1
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return True
        new = seq.detok.push(tok)
        seq.text += new
        if seq.stops is not None:
            cut = seq.stops.feed(new)
            if cut >= 0:
                seq.text = seq.text[:cut]
                seq.cut = True
                return True
        return False

    def _output(self, seq: _Seq, tok: int, reason: FinishReason | None) -> RequestOutput:
        if reason is not None and not seq.cut:
            rest = seq.detok.flush()
            seq.text += rest
            if seq.stops is not None:
                cut = seq.stops.feed(rest)
                seq.text = seq.text[:cut] if cut >= 0 else seq.text
        end = len(seq.text) if reason is not None else max(seq.emitted, len(seq.text) - seq.hold)
        text = seq.text[seq.emitted:end]
        seq.emitted = end
        return RequestOutput(seq.rid, [tok], text, reason is not None,
                             None if reason is None else str(reason), seq.num_prompt,
                             seq.num_generated, seq.cached)
