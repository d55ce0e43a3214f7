"""LLMEngine: owns a scheduler, the model and its paged KV cache, and runs one forward pass per step.

Imports allowed: the standard library, torch, stallfree.core, stallfree.engine.

Each step() is the scheduler's schedule(), one forward pass over the plan's flat batch, sampling,
and complete(plan, stopped): the step loop of iteration-level scheduling (Orca, OSDI'22) with
chunked prefill (Sarathi-Serve, OSDI'24).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from stallfree.core import FinishReason, Request, Scheduler, StepPlan
from stallfree.core import RequestRejected as CoreRequestRejected
from stallfree.core.errors import check_positive_int
from stallfree.engine.batch import BatchBuilder
from stallfree.engine.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidPrompt,
    RequestRejected,
    StepFailed,
)
from stallfree.engine.kv_cache import BlockAllocator, KVCache
from stallfree.engine.model import LlamaModel
from stallfree.engine.outputs import RequestOutput
from stallfree.engine.sampling import SamplingParams, sample_tokens
from stallfree.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from stallfree.engine.weights import load_checkpoint

__all__ = ["LLMEngine", "RequestOutput", "resolve_device", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# KV memory when kv_tokens is not given: 2 GiB on CPU; half the free memory on a GPU.
_CPU_KV_BYTES = 2 * 1024**3
_GPU_KV_FRACTION = 0.5


class _Seq:
    """The engine's record of one live request: its tokens, text and sampler. Engine-owned."""

    __slots__ = ("rid", "params", "token_ids", "num_prompt", "num_generated", "detok", "text",
                 "emitted", "hold", "cut", "generator", "aborted")

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
        self.generator = generator
        self.aborted = False


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


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype used when none is given: bfloat16 on a GPU, float32 elsewhere (see from_pretrained)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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


class LLMEngine:
    """Runs requests through a scheduler and a Llama-family model, one forward pass per step.

    It owns the scheduler, the model, the KV cache and the requests' tokens; the scheduler owns
    admission and the order of the batch. KV blocks: with the reservation Scheduler the engine
    allocates blocks as tokens are computed (within each request's reservation, so the pool never
    runs dry); with a scheduler that has `block_table(rid)` (the paged scheduler) the engine writes
    where that table says, and a preempted request is recomputed from its kept token ids.

    Args:
        model: the decoder.
        tokenizer: its tokenizer.
        model_name: the name reported to clients.
        token_budget: the most tokens in one step (>= 1).
        max_seqs: the most running requests (>= 1).
        kv_tokens: KV capacity in tokens; None = min(max_model_len * max_seqs, 2 GiB of KV on
            CPU or half the free GPU memory), at least max_model_len.
        block_size: tokens per KV block.
        scheduler: a scheduler to use instead of Scheduler(token_budget, max_seqs, kv_tokens).

    Raises:
        InvalidConfig (a ValueError): token_budget, max_seqs or kv_tokens is not an integer >= 1.
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        model_name: str = "model",
        token_budget: int = 512,
        max_seqs: int = 64,
        kv_tokens: int | None = None,
        block_size: int = 16,
        scheduler: Any = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        cfg = model.config
        self.max_model_len = cfg.max_model_len
        self.eos_token_ids = tokenizer.eos_token_ids
        elem = torch.tensor([], dtype=model.dtype).element_size()
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
        if scheduler is None:
            if kv_tokens is None:
                kv_tokens = self._default_kv_tokens(per_token, max_seqs)
            scheduler = Scheduler(token_budget, max_seqs, kv_tokens)
        self.scheduler = scheduler
        self._paged_table = getattr(scheduler, "block_table", None)
        if self._paged_table is not None:
            block_size = int(scheduler.block_size)
            num_blocks = int(scheduler.num_blocks)
            self._alloc: BlockAllocator | None = None
        else:
            num_blocks = -(-scheduler.kv_total // block_size) + scheduler.max_seqs
            self._alloc = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                          model.dtype, model.device)
        self._builder = BatchBuilder(block_size, self.max_model_len, self.kv.pad_block,
                                     self._table_for, model.device)
        self._aborted: set[Hashable] = set()  # aborted while in the plan in flight
        self._seqs: dict[Hashable, _Seq] = {}
        self._pending: StepPlan | None = None
        self.last_plan: StepPlan | None = None

    def _default_kv_tokens(self, per_token_bytes: int, max_seqs: int) -> int:
        dev = self.model.device
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            budget = int(free * _GPU_KV_FRACTION)
        else:
            budget = _CPU_KV_BYTES
        fit = budget // per_token_bytes
        return min(self.max_model_len * max_seqs, max(self.max_model_len, fit))

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
    ) -> LLMEngine:
        """Load a checkpoint and build an engine around it.

        Args:
            path: None for the bundled SmolLM2-135M-Instruct; a .gguf file; or a Hugging Face
                directory (config.json, *.safetensors, tokenizer.json).
            device: "cpu", "cuda", "cuda:N", or None (cuda when present, else cpu).
            dtype: "float32", "bfloat16" ("bf16") or "float16" ("fp16"); None (the default) picks
                float32 on a CPU (CPUs without bf16 matrix units run 16-bit matmuls several times
                slower than float32, and greedy outputs then equal transformers' in float32) and
                bfloat16 on a GPU (tensor cores, half the bytes per weight and KV token, and
                float32's exponent range, so no fp16 overflow). Weights are dequantized to
                float32 first.
            Others: as in LLMEngine.

        Raises:
            ModelLoadError: the checkpoint cannot be found or read (see load_checkpoint).
            EngineError: an unknown device or dtype, or cuda without a GPU.
            InvalidConfig: a scheduler argument out of range.
        """
        # Check the scheduler's numbers before the (slow) checkpoint load.
        check_positive_int("token_budget", token_budget)
        check_positive_int("max_seqs", max_seqs)
        if kv_tokens is not None:
            check_positive_int("kv_tokens", kv_tokens)
        check_positive_int("block_size", block_size)
        dev = resolve_device(device)
        dt = default_dtype(dev) if dtype is None else resolve_dtype(dtype)
        ckpt = load_checkpoint(path)
        model = LlamaModel(ckpt.config, ckpt.tensors, dtype=dt, device=dev)
        return cls(model, ckpt.tokenizer, ckpt.name, token_budget, max_seqs, kv_tokens,
                   block_size, scheduler)

    # ------------------------------------------------------------------ requests

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str:
        """Render chat messages as a prompt, ending with the assistant turn's opening.

        Raises:
            ModelLoadError: the model has no chat template.
            ValueError: a malformed message (the message says which).
        """
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def add_request(
        self, rid: Hashable, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request.

        Args:
            rid: a hashable id, unique among live requests.
            prompt: text (tokenized here; no chat template is applied) or token ids.
            params: sampling parameters (default SamplingParams()).

        Raises:
            InvalidPrompt: the prompt is empty, not text or ids, holds an id outside the
                vocabulary, or rid is live.
            ContextLengthExceeded: prompt tokens + max_tokens > max_model_len.
            RequestRejected: the KV cache can never hold prompt + max_tokens tokens.
            Nothing is queued when any of these is raised.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidPrompt(f"params must be a SamplingParams, got {type(params).__name__}")
        if rid in self._seqs:
            raise InvalidPrompt(f"rid {rid!r} is already live")
        ids = self._prompt_ids(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(len(ids), params.max_tokens, self.max_model_len)
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
        try:
            self.scheduler.add(Request(rid, len(ids), params.max_tokens, priority=params.priority,
                                       arrival=time.monotonic()))
        except CoreRequestRejected as exc:
            raise RequestRejected(str(exc)) from None
        self._seqs[rid] = seq

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except (TypeError, ValueError, UnicodeError) as exc:  # e.g. a lone surrogate
                raise InvalidPrompt(f"prompt cannot be tokenized ({exc}): {prompt!r:.80}") from None
        elif isinstance(prompt, Sequence) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt
        ):
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise InvalidPrompt(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        else:
            raise InvalidPrompt(f"prompt must be a string or a list of token ids, got {prompt!r:.80}")
        if not ids:
            raise InvalidPrompt("prompt is empty (0 tokens); it needs at least 1 token")
        return ids

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
        self._seqs.pop(rid, None)
        self._aborted.discard(rid)
        self._builder.release(rid)
        if self._alloc is not None:
            self._alloc.free(rid)

    def _table_for(self, rid: Hashable, num_tokens: int) -> Sequence[int]:
        """The block table of `rid` covering `num_tokens` tokens (grown by the engine's allocator
        under the reservation scheduler; the scheduler's own table under the paged one)."""
        if self._alloc is not None:
            return self._alloc.ensure(rid, num_tokens)
        assert self._paged_table is not None
        return self._paged_table(rid)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule, one forward pass, sample, complete.

        Returns:
            One RequestOutput per request that emitted a token this step, in batch order
            (aborted requests emit nothing).

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
        stopped = [seq.rid for seq, tok in zip(samplers, tokens, strict=True)
                   if self._append(seq, tok)]
        self.scheduler.complete(plan, stopped)
        finished = self.scheduler.last_finished
        outputs = []
        for seq, tok in zip(samplers, tokens, strict=True):
            reason = finished.get(seq.rid)
            if reason is FinishReason.ABORT:
                continue
            outputs.append(self._output(seq, tok, reason))
        for rid in finished:
            self._release(rid)
        return outputs

    def _execute(self, plan: StepPlan, samplers: list[_Seq]) -> list[int]:
        """Build the flat batch of `plan`, run the model and sample; changes no request state
        (the builder's copy of each sampler's last token aside)."""
        built = self._builder.build(plan, lambda rid: self._seqs[rid].token_ids,
                                    frozenset(self._aborted))
        if built is None:
            return []
        batch, rids, rows = built
        samplers.extend(self._seqs[rid] for rid in rids)
        logits = self.model.forward(batch, self.kv)
        tokens = sample_tokens(logits, [s.params for s in samplers],
                               [s.generator for s in samplers]).cpu()  # the step's one copy back
        self._builder.record(rows, tokens)
        return tokens.tolist()  # type: ignore[no-any-return]

    def _append(self, seq: _Seq, tok: int) -> bool:
        """Record a sampled token and its text; return True when it ends the request (stop)."""
        seq.token_ids.append(tok)
        seq.num_generated += 1
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return True
        seq.text += seq.detok.push(tok)
        if p.stop:
            cut = min((i for i in (seq.text.find(s, seq.emitted) for s in p.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                seq.text = seq.text[:cut]
                seq.cut = True
                return True
        return False

    def _output(self, seq: _Seq, tok: int, reason: FinishReason | None) -> RequestOutput:
        if reason is not None and not seq.cut:
            seq.text += seq.detok.flush()
            if seq.params.stop:
                cut = min((i for i in (seq.text.find(s, seq.emitted) for s in seq.params.stop)
                           if i >= 0), default=len(seq.text))
                seq.text = seq.text[:cut]
        end = len(seq.text) if reason is not None else max(seq.emitted, len(seq.text) - seq.hold)
        text = seq.text[seq.emitted:end]
        seq.emitted = end
        return RequestOutput(seq.rid, [tok], text, reason is not None,
                             None if reason is None else str(reason), seq.num_prompt,
                             seq.num_generated)
