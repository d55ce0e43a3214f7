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
from collections.abc import Hashable, Iterable

from stallfree.core.errors import RequestRejected, SchedulerStateError, check_positive_int
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.request import FinishReason, Request, RequestState, RequestStatus

__all__ = ["NoChunkScheduler", "PrefillFirstScheduler"]


class _Req:
    """A live request; `base` = prompt_len - (decode steps completed before its first decode), so
    its KV length before the decode of decode step T is base + T."""

    __slots__ = ("req", "rid", "prompt_len", "max_new", "kv", "status", "base", "last_tick")

    def __init__(self, req: Request, kv: int) -> None:
        self.req, self.rid, self.kv = req, req.rid, kv
        self.prompt_len, self.max_new = req.prompt_len, req.max_new
        self.status = RequestStatus.WAITING
        self.base = 0
        self.last_tick = -1


class _WholePromptScheduler:
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
        self._live: dict[Hashable, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._num_running = 0
        self._dec: list[_Req] = []
        self._dec_rids: tuple[Hashable, ...] = ()
        self._dec_offsets: tuple[int, ...] = ()
        self._offsets_shift: int | None = None
        self._dec_dirty = False
        self._base_sum = 0
        self._due: dict[int, list[_Req]] = {}
        self._tick = 0  # decode steps completed
        self._step = 0
        self._inflight: StepPlan | None = None
        self._inflight_aborts: set[Hashable] = set()
        self.last_finished: dict[Hashable, FinishReason] = {}

    @property
    def kv_free(self) -> int:
        """Unreserved KV capacity, tokens."""
        return self._kv_free

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests that have not finished."""
        return self._num_running

    @property
    def step(self) -> int:
        """The number of the next step to be scheduled."""
        return self._step

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._live)

    def request_state(self, rid: Hashable) -> RequestState:
        """A snapshot of a live request.

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live[rid]
        decoding = obj.status is RequestStatus.DECODING
        generated = 1 + self._tick - (obj.prompt_len - obj.base) if decoding else 0
        return RequestState(rid, obj.status, obj.prompt_len if decoding else 0, generated, None, None)

    def add(self, req: Request) -> None:
        """Queue a request at the back of the waiting queue.

        Raises:
            RequestRejected: not a Request, a live rid, or prompt_len + max_new > kv_tokens.
        """
        if not isinstance(req, Request):
            raise RequestRejected(f"add() takes a Request, got {type(req).__name__}: {req!r}")
        if req.rid in self._live:
            raise RequestRejected(f"rid {req.rid!r} is already live (waiting or running)")
        need = req.prompt_len + req.max_new
        if need > self.kv_total:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {need} tokens of KV > "
                f"kv_tokens = {self.kv_total}"
            )
        obj = _Req(req, need)
        self._live[req.rid] = obj
        self._waiting.append(obj)

    def abort(self, rid: Hashable) -> None:
        """Remove a waiting or running request (deferred to complete() if it is in the plan in flight).

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live.get(rid)
        if obj is None:
            raise KeyError(f"abort(): unknown rid {rid!r}")
        plan = self._inflight
        if plan is not None and (
            (obj.status is RequestStatus.DECODING and plan.num_decodes)
            or any(c.rid == rid for c in plan.prefills)
        ):
            self._inflight_aborts.add(rid)
        elif obj.status is RequestStatus.WAITING:
            self._waiting.remove(obj)
            del self._live[rid]
        else:
            self._finish(obj, FinishReason.ABORT)

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

    def complete(self, plan: StepPlan, stopped: Iterable[Hashable] = ()) -> tuple[Hashable, ...]:
        """Apply an executed step; returns the rids that emitted a token, in batch order.

        Raises:
            SchedulerStateError: `plan` is not the plan in flight, or a `stopped` rid did not
                sample a token in it; nothing changes.
        """
        if plan is not self._inflight:
            raise SchedulerStateError(f"complete() of step {plan.step}, which is not the plan in flight")
        stopped = tuple(stopped)
        sampled = set(plan.decode_rids) | {c.rid for c in plan.prefills} if stopped else set()
        for rid in stopped:
            if rid not in sampled or rid not in self._live:
                raise SchedulerStateError(
                    f"stopped names rid {rid!r}, which did not sample in step {plan.step}"
                )
        self._inflight = None
        self._step += 1
        self.last_finished = {}
        tick = self._tick
        if plan.num_decodes:
            self._tick += 1
        for chunk in plan.prefills:
            self._first_token(self._live[chunk.rid])
        for rid in stopped:
            obj = self._live.get(rid)
            if obj is not None:
                self._finish(obj, FinishReason.STOP)
        if plan.num_decodes:
            for obj in self._due.pop(tick, ()):
                if obj.status is RequestStatus.DECODING and obj.last_tick == tick:
                    self._finish(obj, FinishReason.LENGTH)
        emitted = plan.decode_rids + tuple(c.rid for c in plan.prefills)
        if self._inflight_aborts:
            aborts, self._inflight_aborts = self._inflight_aborts, set()
            for rid in aborts:
                obj = self._live.get(rid)
                if obj is not None:
                    self._finish(obj, FinishReason.ABORT)
            emitted = tuple(r for r in emitted if r not in aborts)
        return emitted

    def _first_token(self, obj: _Req) -> None:
        obj.status = RequestStatus.DECODING
        if obj.max_new == 1:
            self._finish(obj, FinishReason.LENGTH)
            return
        join = self._tick  # its first decode is the next decode step
        obj.base = obj.prompt_len - join
        obj.last_tick = join + obj.max_new - 2
        self._due.setdefault(obj.last_tick, []).append(obj)
        self._dec.append(obj)
        self._base_sum += obj.base
        self._decodes_changed()

    def _finish(self, obj: _Req, reason: FinishReason) -> None:
        if obj.status is RequestStatus.DECODING and obj.last_tick >= 0:
            self._dec.remove(obj)
            self._base_sum -= obj.base
            obj.last_tick = -1
            self._decodes_changed()
        obj.status = RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED
        self._num_running -= 1
        self._kv_free += obj.kv
        del self._live[obj.rid]
        self.last_finished[obj.rid] = reason

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
