"""A fake LLMEngine for server tests: the real stallfree Scheduler with deterministic fake tokens.

It implements the engine's typed view (stallfree.engine.outputs.EngineClient: info, stats, headroom,
encode, apply_chat_template, add_request, abort, has_unfinished, step), as LLMEngine does, so the server
is tested against the scheduler contract without a model; the server reads nothing else of it.
Tokens are characters: the tokenizer maps each character to its code point, and the "model" writes the characters of
`FakeEngine.TEXT` in a cycle, starting at an offset derived from the prompt, so outputs are
deterministic and easy to check by hand.

Imports allowed: the standard library, stallfree.core and the torch-free stallfree.engine.errors and .outputs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from stallfree.core import FinishReason, PagedScheduler, Request, Scheduler, StepPlan
from stallfree.engine.errors import ContextLengthExceeded, InvalidLoraAdapter, InvalidPrompt, StepFailed, UnknownLora
from stallfree.engine.outputs import Admission, EngineInfo, EngineStats, Headroom, LoraInfo, RequestOutput

EOS_ID = 3  # a control code point, decoded as "" like a special token


class FakeStepError(StepFailed):
    """An injected failure inside step(), a StepFailed as the engine raises; `rids` names its requests.

    As with the engine's StepFailed, the plan stays in flight and no request advanced: the next
    step() retries it without the requests aborted in between.
    """

    def __init__(self, rids: Sequence[Hashable]) -> None:
        super().__init__(f"injected step failure for {list(rids)}", tuple(rids))


@dataclass(frozen=True, slots=True)
class FakeSamplingParams:
    """The fields of stallfree.engine.SamplingParams, validated the same way (ValueError naming the field)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


class FakeTokenizer:
    """One token per character (its code point); EOS decodes to nothing."""

    def encode(self, text: str) -> list[int]:
        """Return the code points of `text`."""
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Return the characters of `ids`, dropping EOS."""
        return "".join(chr(i) for i in ids if i != EOS_ID)


@dataclass(slots=True)
class _Seq:
    rid: Hashable
    prompt: list[int]
    params: FakeSamplingParams
    generated: list[int] = field(default_factory=list)
    emitted_chars: int = 0  # characters of the generated text already sent (stop-string holdback)


class FakeEngine:
    """A deterministic stand-in for LLMEngine that drives the real Scheduler.

    Args:
        token_budget, max_seqs, kv_tokens: passed to Scheduler (tokens, sequences, tokens).
        max_model_len: the context length in tokens.
        step_time_s: a sleep inside step() (seconds), or a function of the plan giving one; lets
            tests keep requests in flight and benchmarks model a step's cost.
        eos_after: when set, every request samples EOS as its eos_after-th generated token
            (unless ignore_eos).
        kv_policy: "reserve" (Scheduler) or "paged" (PagedScheduler, kv_tokens // block_size blocks).
        scheduling_policy: "fcfs" or "priority" (reserve only), as LLMEngine.
        block_size: tokens per KV block under "paged".
        lora_modules: name -> folder of LoRA adapters served from the start (with `enable_lora`); the fake
            checks a folder as the engine does for its files (adapter_config.json, adapter_model.safetensors)
            and counts each adapter in the scheduler (max_loras in scheduler_options), but its tokens do not
            depend on the adapter.
    """

    TEXT = "the quick brown fox jumps over the lazy dog. "

    def __init__(
        self,
        token_budget: int = 64,
        max_seqs: int = 8,
        kv_tokens: int = 4096,
        max_model_len: int = 512,
        step_time_s: float | Callable[[StepPlan], float] = 0.0,
        eos_after: int | None = None,
        kv_policy: str = "reserve",
        scheduling_policy: str = "fcfs",
        block_size: int = 16,
        enable_lora: bool = False,
        lora_modules: dict[str, str] | None = None,
        **scheduler_options: object,
    ) -> None:
        self.scheduler: Scheduler | PagedScheduler
        if kv_policy == "paged":
            self.scheduler = PagedScheduler(token_budget, max_seqs, kv_tokens // block_size, block_size, 0.01,
                                            policy=scheduling_policy, **scheduler_options)
        else:
            self.scheduler = Scheduler(token_budget=token_budget, max_seqs=max_seqs, kv_tokens=kv_tokens,
                                       policy=scheduling_policy, **scheduler_options)
            block_size = 1
        self.kv_policy = kv_policy
        self.block_size = block_size
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.eos_token_ids = (EOS_ID,)
        self.last_plan: StepPlan | None = None
        self.step_time_s = step_time_s
        self.eos_after = eos_after
        self.fail_next_steps = 0  # set by tests: the next N steps raise FakeStepError
        # Set by tests: a request whose params this is true of fails its own sampling (as LLMEngine ends a
        # request whose logits are not finite: aborted, one output with finish_reason "error").
        self.fail_sampling: Callable[[FakeSamplingParams], bool] | None = None
        self.added: list[Hashable] = []
        self.priorities: dict[Hashable, int] = {}
        self.params: dict[Hashable, FakeSamplingParams] = {}
        self.salts: dict[Hashable, str] = {}
        self.tenants: dict[Hashable, str | None] = {}
        self.aborted: list[Hashable] = []
        self.num_steps = 0
        self._seqs: dict[Hashable, _Seq] = {}
        self._pending: StepPlan | None = None  # a failed step's plan, retried by the next step()
        self._lock = threading.Lock()  # detects calls that overlap step(), which the server must never make
        self.enable_lora = bool(enable_lora or lora_modules)
        self.loras: dict[str, str] = {}
        self.lora_requests: dict[str, int] = {}
        self.lora_of: dict[Hashable, str] = {}
        for name, path in (lora_modules or {}).items():
            self.load_lora_adapter(name, path)
        self._info = EngineInfo(
            model_name="fake-model", vocab_size=0x110000, max_model_len=max_model_len, max_token_chars=4,
            max_token_bytes=4,
            token_budget=token_budget, max_seqs=max_seqs, kv_total_tokens=self.scheduler.stats().kv_total,
            num_blocks=self.scheduler.stats().kv_total // block_size, block_size=block_size, kv_policy=kv_policy,
            scheduling_policy=scheduling_policy, enable_lora=self.enable_lora,
            max_loras=scheduler_options.get("max_loras") if self.enable_lora else None,  # type: ignore[arg-type]
            max_lora_rank=16 if self.enable_lora else None,
        )

    # ------------------------------------------------------------------ the typed view (EngineClient)

    @property
    def info(self) -> EngineInfo:
        """Fixed facts: the vocabulary is every code point (one character per token; max_token_chars 4
        is a loose bound, so that the exact token count decides most length errors)."""
        return self._info

    def stats(self) -> EngineStats:
        """The scheduler's stats() as an EngineStats."""
        with self._guard():
            st = self.scheduler.stats()
            return EngineStats(
                num_running=st.num_running, num_waiting=st.num_waiting,
                num_will_wait=self._headroom().will_wait, kv_free_tokens=st.kv_free, kv_total_tokens=st.kv_total,
                num_preemptions=st.num_preemptions,
                last_step_tokens=0 if self.last_plan is None else self.last_plan.num_tokens,
            )

    def headroom(self) -> Headroom:
        """What the next step leaves, from the scheduler's own plan of it, as LLMEngine.headroom."""
        with self._guard():
            return self._headroom()

    def _headroom(self) -> Headroom:
        s = self.scheduler
        h = s.headroom()
        reserve = self.kv_policy != "paged"
        kv = h.kv_free if reserve else (h.num_free_blocks - s.stats().watermark_blocks) * self.block_size
        return Headroom(h.will_wait, h.slots, kv, h.budget_tokens, reserve, self.block_size)

    def admission(self) -> Admission:
        """A detached copy of the scheduler and the fake's request builder, as LLMEngine.admission."""
        with self._guard():
            return Admission(self.scheduler.snapshot(), self._core_request)

    def _core_request(self, rid: Hashable, prompt: str | list[int], params: FakeSamplingParams, priority: int,
                      cache_salt: str | None, tenant: str | None = None, lora: str | None = None) -> Request | None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return Request(rid, len(ids), params.max_tokens, priority=priority, tenant=tenant, lora=lora) if ids else None

    # ------------------------------------------------------------------ LoRA adapters (names only)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve `name` from `path`: InvalidLoraAdapter when LoRA is off, the name is served or a file is missing."""
        from pathlib import Path

        if not self.enable_lora:
            raise InvalidLoraAdapter("LoRA is not enabled on this engine")
        if name in self.loras:
            raise InvalidLoraAdapter(f"LoRA adapter {name!r} is already served (from {self.loras[name]})")
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not (Path(path) / f).is_file():
                raise InvalidLoraAdapter(f"LoRA adapter {name!r}: {str(path)!r} has no {f}")
        self.loras[name] = str(path)
        self.lora_requests.setdefault(name, 0)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name`; InvalidLoraAdapter when it is not served."""
        if self.loras.pop(name, None) is None:
            raise InvalidLoraAdapter(f"LoRA adapter {name!r} is not served")

    def lora_adapters(self) -> list[LoraInfo]:
        """The served adapters by name."""
        return [LoraInfo(n, p, 8, i + 1, self.lora_requests.get(n, 0), 0)
                for i, (n, p) in enumerate(sorted(self.loras.items()))]

    def encode(self, text: str) -> list[int]:
        """Tokenize with the fake tokenizer (thread-safe: no engine state)."""
        return list(self.tokenizer.encode(text))

    # ------------------------------------------------------------------ requests

    def add_request(
        self, rid: Hashable, prompt: str | list[int], params: FakeSamplingParams, *, priority: int = 0,
        cache_salt: str | None = None, tenant: str | None = None, lora: str | None = None,
    ) -> None:
        """Queue a request; raises ContextLengthExceeded, UnknownLora, or RequestRejected if it can never fit.
        `cache_salt` is recorded in `salts` (the fake has no prefix cache), `tenant` in `tenants`."""
        with self._guard():
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise InvalidPrompt("prompt must not be empty")
            if len(ids) + params.max_tokens > self.max_model_len:
                raise ContextLengthExceeded(len(ids), params.max_tokens, self.max_model_len)
            if lora is not None and lora not in self.loras:
                raise UnknownLora(lora, tuple(self.loras))
            self.scheduler.add(Request(rid, len(ids), params.max_tokens, priority=priority,
                                       arrival=time.monotonic(), tenant=tenant, lora=lora))
            if lora is not None:
                self.lora_requests[lora] += 1
                self.lora_of[rid] = lora
            self._seqs[rid] = _Seq(rid, ids, params)
            self.tenants[rid] = tenant
            self.added.append(rid)
            self.priorities[rid] = priority
            self.params[rid] = params
            if cache_salt is not None:
                self.salts[rid] = cache_salt

    def abort(self, rid: Hashable) -> None:
        """Abort a request; its KV is released now, or at the end of the step in flight."""
        with self._guard():
            self.scheduler.abort(rid)
            if self._seqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (or a failed plan awaits its retry)."""
        return self.scheduler.has_unfinished() or self._pending is not None

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """Render messages as `<role>content` lines and open the assistant's turn."""
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and sample one fake token for each request that samples."""
        with self._guard():
            plan = self._pending if self._pending is not None else self.scheduler.schedule()
            self._pending = plan
            self.last_plan = plan
            self.num_steps += 1
            delay = self.step_time_s(plan) if callable(self.step_time_s) else self.step_time_s
            if delay > 0:
                time.sleep(delay)
            if self.fail_next_steps > 0:
                self.fail_next_steps -= 1
                raise FakeStepError([c.rid for c in plan])
            self._pending = None
            # Requests aborted while the plan was in flight are still in it; they sample nothing.
            sampled = {r: self._next_token(self._seqs[r]) for r in plan.sampled_rids if r in self._seqs}
            failed = [r for r in sampled if self.fail_sampling is not None and self.fail_sampling(self._seqs[r].params)]
            for rid in failed:
                del sampled[rid]
                self.scheduler.abort(rid)  # takes effect at complete(), as in LLMEngine
            stopped = [rid for rid, tok in sampled.items() if self._is_stop_token(self._seqs[rid], tok)]
            for rid, tok in sampled.items():
                self._seqs[rid].generated.append(tok)
            stopped += [r for r in sampled if r not in stopped and self._hit_stop_string(self._seqs[r])]
            emitted = self.scheduler.complete(plan, stopped)
            errors = [RequestOutput(rid, [], "", True, "error", len(self._seqs[rid].prompt),
                                    len(self._seqs.pop(rid).generated), error="injected sampling failure")
                      for rid in failed]
            # Shed by the queue time limit (SchedulerConfig.max_queue_time_s): no token, as LLMEngine.
            errors += [RequestOutput(rid, [], "", True, "timeout", len(self._seqs.pop(rid).prompt), 0)
                       for rid in plan.timed_out if rid in self._seqs]
            return errors + self._outputs(emitted, set(stopped))

    def _outputs(self, emitted: Sequence[Hashable], stopped: set[Hashable]) -> list[RequestOutput]:
        finished = self.scheduler.last_finished
        outs = []
        for rid in emitted:
            seq = self._seqs[rid]
            reason = finished.get(rid)
            if reason is not None and rid in stopped:
                reason = FinishReason.STOP  # as LLMEngine: a stop on the last allowed token is "stop"
            text = self._new_text(seq, reason is not None)
            outs.append(
                RequestOutput(
                    rid, [seq.generated[-1]], text, reason is not None,
                    None if reason is None else str(reason), len(seq.prompt), len(seq.generated),
                )
            )
            if reason is not None:
                del self._seqs[rid]
        return outs

    def _next_token(self, seq: _Seq) -> int:
        n = len(seq.generated)
        if self.eos_after is not None and n + 1 == self.eos_after:
            return EOS_ID
        return ord(self.TEXT[(sum(seq.prompt) + n) % len(self.TEXT)])

    def _is_stop_token(self, seq: _Seq, tok: int) -> bool:
        if tok in seq.params.stop_token_ids:
            return True
        return tok == EOS_ID and not seq.params.ignore_eos

    def _text(self, seq: _Seq) -> str:
        return self.tokenizer.decode(seq.generated)

    def _hit_stop_string(self, seq: _Seq) -> bool:
        text = self._text(seq)
        return any(s in text for s in seq.params.stop)

    def _new_text(self, seq: _Seq, finished: bool) -> str:
        """The text not yet sent; held back while it could be the start of a stop string."""
        text = self._text(seq)
        cut = len(text)
        for s in seq.params.stop:
            pos = text.find(s)
            if pos >= 0:
                cut = min(cut, pos)
            elif not finished:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        cut = min(cut, len(text) - k)
                        break
        new = text[seq.emitted_chars : cut] if cut > seq.emitted_chars else ""
        seq.emitted_chars = max(seq.emitted_chars, cut)
        return new

    def _guard(self) -> _Guard:
        return _Guard(self._lock)


class _Guard:
    """Fails loudly if two engine calls overlap (the server must serialize them)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise AssertionError("engine called concurrently with another engine call")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
