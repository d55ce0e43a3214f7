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
from stallfree.core.lifecycle import RequestLifecycle, end_reason
from stallfree.core.live import DecodeSet, LiveRequest
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.queries import SchedulerStats
from stallfree.core.request import Request, RequestState, RequestStatus

__all__ = ["NoChunkScheduler", "PrefillFirstScheduler"]


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
        self._waiting: deque[LiveRequest] = deque()
        # The decode set's clock is the count of decode steps completed (`_due` is keyed by decode
        # step here, not by step): a decode's KV length before decode step T is its offset + T.
        self._decodes = DecodeSet()
        self._due = self._decodes.due

    @property
    def kv_free(self) -> int:
        """Unreserved KV capacity, tokens."""
        return self._kv_free

    def stats(self) -> SchedulerStats:
        """The queues and KV figures as a stallfree.core SchedulerStats (no preemption, no caching here)."""
        return SchedulerStats(self.num_waiting, self.num_running, self.kv_total, self._kv_free)

    def cached_prefix_len(self, request: Request) -> int:
        """0: the baselines keep no prefix cache."""
        return 0

    def request_state(self, rid: Hashable) -> RequestState:
        """A snapshot of a live request.

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live[rid]
        decoding = obj.status is RequestStatus.DECODING
        generated = obj.num_output_tokens if decoding else 0
        return RequestState(rid, obj.status, obj.num_prompt_tokens if decoding else 0, generated, None, None)

    def schedule(self) -> StepPlan:
        """Plan the next step (decodes and/or whole prompts, by the baseline's policy).

        Raises:
            SchedulerStateError: the previous plan has not been completed.
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"schedule() called twice: step {self._inflight.step} not completed")
        dec = self._decodes
        step, tick = self._step, dec.clock
        prefills: list[ScheduledChunk] = []
        n_dec = len(dec)
        if self._prefill_only_steps:
            admitted = self._admit(self.token_budget, prefills)
            if prefills:
                n_dec = 0
        else:
            admitted = self._admit(self.token_budget - n_dec, prefills)
        if n_dec:
            rids = dec.tuples()[0]
            offsets, ctx = dec.shifted_offsets(tick - step), dec.context_sum(tick)
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
            n = obj.num_prompt_tokens
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

    def _new_live(self, req: Request, need: int) -> LiveRequest:
        return LiveRequest(req, need, 0, self._step, self._decodes)

    def _decoded_in(self, obj: LiveRequest, plan: StepPlan) -> bool:
        # Every decoding request runs in a step that has decodes (they are bounded by max_seqs only).
        return obj.status is RequestStatus.DECODING and plan.num_decodes > 0

    def _before_apply(self, plan: StepPlan, accepted: list[tuple[Any, int]]) -> int | None:
        """Count decode steps apart from steps: decodes finish by the decode step they are due."""
        if not plan.num_decodes:
            return None
        self._decodes.clock += 1
        return self._decodes.clock - 1

    def _first_token(self, obj: LiveRequest, step: int) -> None:
        obj.status = RequestStatus.DECODING
        if obj.limit == 1:
            self._finish(obj, end_reason(obj))
            return
        join = self._decodes.clock  # its first decode is the next decode step
        self._decodes.join(obj, obj.num_prompt_tokens - join, join + obj.limit - 2)

    def _leave_running(self, obj: LiveRequest) -> None:
        if obj.status is RequestStatus.DECODING and obj.finish_step >= 0:
            self._decodes.leave(obj)
        self._num_running -= 1
        self._kv_free += obj.kv


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
