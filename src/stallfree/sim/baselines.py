"""Baseline schedulers without chunked prefill, to compare against the contract on the same workload.

Imports allowed: the standard library and stallfree.core.

Both keep the contract's KV reservation (prompt_len + max_new at admission), max_seqs and strict FCFS
admission, and emit StepPlans through the same add()/schedule()/complete()/abort() interface, so the
simulator and the cost model treat them exactly like stallfree.Scheduler. They differ from it only
in how a step is filled:

- PrefillFirstScheduler: when a waiting prompt can be admitted, the step is prefill-only: whole
  prompts, FCFS, as many as fit the token budget; running decodes wait for a step with no admission
  (the default of engines without chunked prefill, e.g. vLLM before chunked prefill; Orca, OSDI'22,
  and Sarathi-Serve, OSDI'24, section 2, describe the resulting generation stalls).
- NoChunkScheduler: decodes first, then only whole prompts that fit what is left of the budget.

Without chunking, the first prompt admitted in a step goes whole even when it exceeds what is left
of the budget (a prompt longer than the budget included), as in engines without chunked prefill,
whose budget must be at least the longest prompt; further prompts join the step only while they fit
what is left. Decodes are bounded by max_seqs, not by the budget. A step may therefore hold more
tokens than token_budget; the cost model prices what is scheduled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

from stallfree.core.errors import RequestRejected, SchedulerStateError, check_positive_int
from stallfree.core.lifecycle import RequestLifecycle
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.request import FinishReason, Request, RequestState, RequestStatus

__all__ = ["NoChunkScheduler", "PrefillFirstScheduler"]


class _Req:
    """A live request; `base` = prompt_len - (decode steps completed before its first decode), so
    its KV length before the decode of decode step T is base + T."""

    __slots__ = ("req", "rid", "prompt_len", "max_new", "kv", "status", "base", "finish_step", "num_prefilled")

    def __init__(self, req: Request, kv: int) -> None:
        self.req, self.rid, self.kv = req, req.rid, kv
        self.prompt_len, self.max_new = req.prompt_len, req.max_new
        self.status = RequestStatus.WAITING
        self.base = 0
        self.finish_step = -1  # the decode step (tick, not step) of its last token; -1 while not decoding
        self.num_prefilled = 0


class _WholePromptScheduler(RequestLifecycle):
    """Shared machinery of the baselines: whole-prompt admission and decode bookkeeping.

    Args:
        token_budget: tokens per step for prompts (see the module docstring for when it is exceeded), >= 1.
        max_seqs: the most running requests, >= 1.
        kv_tokens: KV cache capacity, tokens, >= 1.

    Raises:
        InvalidConfig: an argument is not an integer >= 1.
    """

    _prefill_only_steps = False

    def __init__(self, token_budget: int, max_seqs: int, kv_tokens: int) -> None:
        self.token_budget = check_positive_int("token_budget", token_budget)
        self.max_seqs = check_positive_int("max_seqs", max_seqs)
        self.kv_total = check_positive_int("kv_tokens", kv_tokens)
        self._kv_free = self.kv_total
        self._init_lifecycle()
        self._waiting: deque[_Req] = deque()
        self._dec: list[_Req] = []
        self._dec_rids: tuple[Hashable, ...] = ()
        self._dec_offsets: tuple[int, ...] = ()
        self._offsets_shift: int | None = None
        self._dec_dirty = False
        self._base_sum = 0
        self._tick = 0  # decode steps completed; `_due` is keyed by decode step here, not by step

    @property
    def kv_free(self) -> int:
        """Unreserved KV capacity, tokens."""
        return self._kv_free

    def request_state(self, rid: Hashable) -> RequestState:
        """A snapshot of a live request.

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live[rid]
        decoding = obj.status is RequestStatus.DECODING
        generated = 1 + self._tick - (obj.prompt_len - obj.base) if decoding else 0
        return RequestState(rid, obj.status, obj.prompt_len if decoding else 0, generated, None, None)

    def schedule(self) -> StepPlan:
        """Plan the next step (decodes and/or whole prompts, by the baseline's policy).

        Raises:
            SchedulerStateError: the previous plan has not been completed.
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"schedule() called twice: step {self._inflight.step} not completed")
        step, tick = self._step, self._tick
        prefills: list[ScheduledChunk] = []
        n_dec = len(self._dec)
        if self._prefill_only_steps:
            admitted = self._admit(self.token_budget, prefills)
            if prefills:
                n_dec = 0
        else:
            admitted = self._admit(self.token_budget - n_dec, prefills)
        if n_dec:
            if self._dec_dirty:
                self._dec_rids = tuple(o.rid for o in self._dec)
                self._dec_dirty = False
                self._offsets_shift = None
            if self._offsets_shift != tick - step:
                shift = tick - step
                self._dec_offsets = tuple(o.base + shift for o in self._dec)
                self._offsets_shift = shift
            rids, offsets, ctx = self._dec_rids, self._dec_offsets, self._base_sum + n_dec * tick
        else:
            rids, offsets, ctx = (), (), 0
        plan = StepPlan(
            step=step,
            decode_rids=rids,
            decode_offsets=offsets,
            prefills=tuple(prefills),
            num_tokens=n_dec + sum(c.num_tokens for c in prefills),
            decode_context_sum=ctx,
            token_budget=self.token_budget,
            admitted=admitted,
        )
        self._inflight = plan
        return plan

    def _admit(self, left: int, out: list[ScheduledChunk]) -> tuple[Hashable, ...]:
        """Whole prompts, strict FCFS; the step's first prompt goes whole even if it exceeds `left`."""
        waiting = self._waiting
        admitted: list[Hashable] = []
        while waiting:
            obj = waiting[0]
            n = obj.prompt_len
            fits = n <= left or not out
            if not fits or self._num_running >= self.max_seqs or obj.kv > self._kv_free:
                break
            waiting.popleft()
            self._num_running += 1
            self._kv_free -= obj.kv
            obj.status = RequestStatus.PREFILLING
            out.append(ScheduledChunk(obj.rid, n, True, 0, True))
            admitted.append(obj.rid)
            left -= n
        return tuple(admitted)

    # ------------------------------------------------------------------ lifecycle hooks

    def _check_fits(self, req: Request) -> int:
        need = req.prompt_len + req.max_new
        if need > self.kv_total:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {need} tokens of KV > "
                f"kv_tokens = {self.kv_total}"
            )
        return need

    def _new_live(self, req: Request, need: int) -> _Req:
        return _Req(req, need)

    def _decoded_in(self, obj: _Req, plan: StepPlan) -> bool:
        # Every decoding request runs in a step that has decodes (they are bounded by max_seqs only).
        return obj.status is RequestStatus.DECODING and plan.num_decodes > 0

    def _before_apply(self, plan: StepPlan, accepted: list[tuple[Any, int]]) -> int | None:
        """Count decode steps apart from steps: decodes finish by the decode step they are due."""
        if not plan.num_decodes:
            return None
        self._tick += 1
        return self._tick - 1

    def _first_token(self, obj: _Req, step: int) -> None:
        obj.status = RequestStatus.DECODING
        if obj.max_new == 1:
            self._finish(obj, FinishReason.LENGTH)
            return
        join = self._tick  # its first decode is the next decode step
        obj.base = obj.prompt_len - join
        obj.finish_step = join + obj.max_new - 2
        self._due.setdefault(obj.finish_step, []).append(obj)
        self._dec.append(obj)
        self._base_sum += obj.base
        self._decodes_changed()

    def _leave_running(self, obj: _Req) -> None:
        if obj.status is RequestStatus.DECODING and obj.finish_step >= 0:
            self._dec.remove(obj)
            self._base_sum -= obj.base
            obj.finish_step = -1
            self._decodes_changed()
        self._num_running -= 1
        self._kv_free += obj.kv

    def _decodes_changed(self) -> None:
        # Rebuilt lazily at the next schedule(), once however many joined or left.
        self._dec_dirty = True


class PrefillFirstScheduler(_WholePromptScheduler):
    """Prefill-first batching: a step admits and prefills whole prompts (FCFS, up to the budget)
    whenever one can be admitted; only otherwise do the running decodes get their token.

    Args and Raises: as stallfree.Scheduler (token_budget, max_seqs, kv_tokens).
    """

    _prefill_only_steps = True


class NoChunkScheduler(_WholePromptScheduler):
    """Decodes first, then whole prompts (FCFS) that fit what is left of the budget; no chunking.

    Args and Raises: as stallfree.Scheduler (token_budget, max_seqs, kv_tokens).
    """
