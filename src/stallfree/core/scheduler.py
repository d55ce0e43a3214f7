"""The continuous batching scheduler: a token budget spent on decodes, then the partial prefill,
then strict first-come-first-served admission with KV reserved for prompt_len + max_new.

Imports allowed: the standard library and stallfree.core only.

Source: stall-free batching with chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24);
iteration-level scheduling (Orca, Yu et al., OSDI'22).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping

from stallfree.core.errors import (
    InvalidConfig,
    RequestRejected,
    SchedulerStateError,
    check_positive_int,
)
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.policies import FCFSQueue, PriorityQueue, WaitingQueue, build_policies
from stallfree.core.request import FinishReason, Request, RequestState, RequestStatus

__all__ = ["Scheduler"]

_WAITING = RequestStatus.WAITING
_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_FINISHED = RequestStatus.FINISHED
_ABORTED = RequestStatus.ABORTED

# How many finished rids are remembered so that abort() of a request that just finished is a no-op
# rather than a KeyError; bounded so that a long-running server does not grow.
_RECENT_FINISHED = 4096


class _Live:
    """The scheduler's own record of one live request. Mutated by the Scheduler only.

    Progress of a decoding request is derived from step numbers rather than counted every step:
    after step k completes it has generated k - base tokens, so its last token is due at step
    base + max_new, and the decode it runs at step k starts at offset + k = prompt_len + k - base - 2.
    """

    __slots__ = (
        "req",
        "rid",
        "seq",
        "arrival_step",
        "prompt_len",
        "max_new",
        "kv",
        "status",
        "num_prefilled",
        "admitted_step",
        "first_token_step",
        "base",
        "finish_step",
    )

    def __init__(self, req: Request, kv: int, seq: int, arrival_step: int) -> None:
        self.req = req
        self.rid = req.rid
        self.seq = seq
        self.arrival_step = arrival_step
        self.prompt_len = req.prompt_len
        self.max_new = req.max_new
        self.kv = kv
        self.status = _WAITING
        self.num_prefilled = 0
        self.admitted_step: int | None = None
        self.first_token_step: int | None = None
        self.base = 0
        self.finish_step = -1

    @property
    def offset(self) -> int:
        return self.prompt_len - self.base - 2


class Scheduler:
    """A continuous batching scheduler with a token budget and chunked prefill (DESIGN.md section 1).

    It owns the waiting queue, the running set and the KV reservation counter; it never sees token
    ids or tensors. Each step is one `schedule()` (which returns a StepPlan) followed by one
    `complete(plan)` (which applies the executed step). The budget is spent in a fixed order:

    1. decodes: one token for every running request whose prompt is fully prefilled, oldest
       admitted first;
    2. the partial prefill: the rest of a prompt started in an earlier step, up to what is left;
    3. admission: waiting requests strictly first come, first served (add() order); the head needs a
       free slot (running < max_seqs), KV for prompt_len + max_new tokens (reserved now, returned
       when it finishes) and budget left; the first head that does not fit stops admission.

    Invariants (checked by stallfree.core.invariants.InvariantChecker): scheduled tokens <=
    token_budget; running <= max_seqs; free KV >= 0; every prompt gets exactly prompt_len prefill
    tokens; every request gets exactly max_new - 1 decodes unless stopped or aborted; admission
    order equals add() order; the decodes of a step are the oldest ready ones; all KV is returned.

    Example (the hand trace): budget 8, one decode running, a 20-token prompt arrives::

        step 0: decode + chunk of 7     step 1: decode + chunk of 7
        step 2: decode + chunk of 6 -> the prompt's first token comes out of this (third) step

    Options (each off by default; docs/scheduling.md says what each trades):

    - block_size=B: every non-final chunk is a multiple of B tokens, and KV is reserved in whole blocks;
      token_budget must be >= B and a per-step budget is never taken below B.
    - policy="priority" (aging_interval=, clock=): admission and overflowing decodes are ordered by
      (effective priority, arrival), effective = priority - floor(waited / aging_interval), waited in
      steps, or in seconds when `clock` (a callable returning seconds) is given. Admission still never
      skips the head of that order; there is no preemption.
    - decode_overflow="oldest" | "rotate": when ready decodes do not fit the budget (a smaller per-step
      budget, or speculative tokens), the oldest run, or the start index rotates each step.
    - num_spec_tokens=k: a decode costs 1 + min(k, max_new - generated - 1, budget - 1) tokens (the
      verification pass never goes past max_new) and complete(num_accepted=) says how many it emitted.

    Args:
        token_budget: the most tokens in one step (vLLM's max_num_batched_tokens), >= 1.
        max_seqs: the most running (admitted, unfinished) requests, >= 1.
        kv_tokens: KV cache capacity in tokens, >= 1.

    Raises:
        InvalidConfig: an argument is not an integer >= 1 (bools excluded), or an option is out of range
            (see stallfree.core.policies.build_policies); the message names it and its value.
    """

    def __init__(
        self,
        token_budget: int,
        max_seqs: int,
        kv_tokens: int,
        *,
        block_size: int | None = None,
        policy: str = "fcfs",
        aging_interval: float | None = None,
        clock: Callable[[], float] | None = None,
        decode_overflow: str = "oldest",
        num_spec_tokens: int = 0,
    ) -> None:
        self.token_budget = check_positive_int("token_budget", token_budget)
        self.max_seqs = check_positive_int("max_seqs", max_seqs)
        check_positive_int("kv_tokens", kv_tokens)
        self._chunking, self.policy, self._selection = build_policies(
            block_size, policy, aging_interval, clock, decode_overflow, num_spec_tokens
        )
        self.block_size = block_size
        if block_size is not None and (token_budget < block_size or kv_tokens < block_size):
            raise InvalidConfig(
                f"token_budget ({token_budget}) and kv_tokens ({kv_tokens}) must be >= block_size ({block_size})"
            )
        self.aging_interval = aging_interval
        self.clock = clock
        self.decode_overflow = decode_overflow
        self.num_spec_tokens = num_spec_tokens
        self.kv_total = self._chunking.capacity(kv_tokens)
        self._kv_free = self.kv_total
        self._live: dict[Hashable, _Live] = {}
        self._waiting: WaitingQueue = FCFSQueue() if policy == "fcfs" else PriorityQueue(self.priority_key)
        self._seq = 0
        self._skipped: list[_Live] = []
        self._offsets_stale = False
        self._num_running = 0
        self._prefilling: _Live | None = None
        # Decodes in batch order (admission order), as three aligned lists plus cached tuples that
        # plans share while the set does not change.
        self._dec: list[_Live] = []
        self._dec_rids: list[Hashable] = []
        self._dec_offsets: list[int] = []
        self._dec_rids_t: tuple[Hashable, ...] = ()
        self._dec_offsets_t: tuple[int, ...] = ()
        self._dec_dirty = False
        self._dec_offset_sum = 0
        self._due: dict[int, list[_Live]] = {}
        self._step = 0
        self._inflight: StepPlan | None = None
        self._inflight_aborts: set[Hashable] = set()
        self._recent_finished: dict[Hashable, None] = {}
        self.last_finished: dict[Hashable, FinishReason] = {}

    # ------------------------------------------------------------------ public state

    @property
    def kv_free(self) -> int:
        """Unreserved KV capacity, in tokens."""
        return self._kv_free

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests that have not finished (prefilling or decoding)."""
        return self._num_running

    @property
    def step(self) -> int:
        """The number of the next step to be scheduled (steps count from 0)."""
        return self._step

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._live)

    def request_state(self, rid: Hashable) -> RequestState:
        """Return a snapshot of a live (waiting or running) request.

        Raises:
            KeyError: `rid` is not live (never added, or already reported finished).
        """
        obj = self._live.get(rid)
        if obj is None:
            raise KeyError(f"no live request with rid {rid!r}")
        generated = self._step - 1 - obj.base if obj.status is _DECODING else 0
        return RequestState(
            rid=rid,
            status=obj.status,
            num_prefilled=obj.num_prefilled,
            num_generated=generated,
            admitted_step=obj.admitted_step,
            first_token_step=obj.first_token_step,
        )

    # ------------------------------------------------------------------ add / abort

    def kv_needed(self, req: Request) -> int:
        """KV reserved for `req` at admission, in tokens: prompt_len + max_new (in whole blocks with block_size)."""
        return self._chunking.kv_needed(req.prompt_len, req.max_new)

    def priority_key(self, obj: _Live) -> tuple[float, int]:
        """(effective priority, add order) of a live request; lower runs first under policy="priority"."""
        prio = obj.req.priority
        if self.aging_interval is None:
            return (prio, obj.seq)
        waited = self.clock() - obj.req.arrival if self.clock is not None else self._step - obj.arrival_step
        return (prio - math.floor(waited / self.aging_interval), obj.seq)

    def add(self, req: Request) -> None:
        """Queue a request at the back of the waiting queue.

        Raises:
            RequestRejected: `req` is not a Request, its rid is already live, or it can never fit
                (its KV need exceeds kv_tokens); nothing is queued.
        """
        if not isinstance(req, Request):
            raise RequestRejected(f"add() takes a Request, got {type(req).__name__}: {req!r}")
        if req.rid in self._live:
            raise RequestRejected(f"rid {req.rid!r} is already live (waiting or running)")
        need = self.kv_needed(req)
        if need > self.kv_total:
            blocks = f" in whole blocks of {self.block_size}" if self.block_size else ""
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {req.prompt_len} + "
                f"{req.max_new} = {req.prompt_len + req.max_new}, {need} tokens of KV{blocks} "
                f"> kv_tokens = {self.kv_total}"
            )
        obj = _Live(req, need, self._seq, self._step)
        self._seq += 1
        self._recent_finished.pop(req.rid, None)
        self._live[req.rid] = obj
        self._waiting.append(obj)

    def abort(self, rid: Hashable) -> None:
        """Remove a waiting or running request and release its KV.

        A request in the plan handed out and not yet completed is removed at that complete() (the
        engine may still be writing its KV) and emits nothing more. A request that already
        finished is a no-op.

        Raises:
            KeyError: `rid` was never added (or finished too long ago to be remembered).
        """
        obj = self._live.get(rid)
        if obj is None:
            if rid in self._recent_finished:
                return
            raise KeyError(f"abort(): unknown rid {rid!r}")
        plan = self._inflight
        if plan is not None and self._in_plan(obj, plan):
            self._inflight_aborts.add(rid)
            return
        if obj.status is _WAITING:
            self._waiting.remove(obj)
            self._forget(obj, _ABORTED)
        else:
            self._finish(obj, FinishReason.ABORT, report=False)

    # ------------------------------------------------------------------ the step

    def schedule(self, token_budget: int | None = None) -> StepPlan:
        """Plan the next step: decodes, then the partial prefill, then admissions.

        Args:
            token_budget: spend at most this many tokens in this step only (1 to the configured
                budget; raised to block_size when that is set); None uses the configured budget.

        Returns:
            The StepPlan of step `self.step`; empty when nothing can run.

        Raises:
            SchedulerStateError: the previous plan has not been completed.
            InvalidConfig: token_budget is not an integer from 1 to the configured budget.
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"schedule() called twice: step {self._inflight.step} was not completed")
        budget = self.token_budget if token_budget is None else self._step_budget(token_budget)
        step = self._step
        decode_rids, decode_offsets, decode_tokens, used = self._schedule_decodes(budget, step)
        prefills: list[ScheduledChunk] = []
        left = self._schedule_partial_prefill(budget - used, prefills)
        admitted = self._admit(left, prefills)
        n_dec = len(decode_rids)
        ctx = self._dec_offset_sum if decode_offsets is self._dec_offsets_t else sum(decode_offsets)
        plan = StepPlan(
            step=step,
            decode_rids=decode_rids,
            decode_offsets=decode_offsets,
            prefills=tuple(prefills),
            num_tokens=used + sum(c.num_tokens for c in prefills),
            decode_context_sum=ctx + n_dec * step,
            token_budget=budget,
            admitted=admitted,
            decode_tokens=decode_tokens,
        )
        self._inflight = plan
        return plan

    def _step_budget(self, token_budget: int) -> int:
        check_positive_int("token_budget", token_budget)
        if token_budget > self.token_budget:
            raise InvalidConfig(
                f"token_budget for one step ({token_budget}) exceeds the configured token_budget ({self.token_budget})"
            )
        return max(token_budget, self.block_size or 1)

    def _schedule_decodes(
        self, budget: int, step: int
    ) -> tuple[tuple[Hashable, ...], tuple[int, ...], tuple[int, ...] | None, int]:
        """Contract step 1: one entry per ready decode, oldest admitted first, up to the budget.

        Returns (rids, offsets, per-decode tokens or None when all cost 1, tokens used).
        """
        if self._offsets_stale:
            self._dec_offsets = [o.prompt_len - o.base - 2 for o in self._dec]
            self._dec_offset_sum = sum(self._dec_offsets)
            self._offsets_stale = False
            self._dec_dirty = True
        if self._dec_dirty:
            self._dec_rids_t = tuple(self._dec_rids)
            self._dec_offsets_t = tuple(self._dec_offsets)
            self._dec_dirty = False
        self._skipped = []
        n = len(self._dec_rids_t)
        k = self.num_spec_tokens
        if k:
            # The verification pass never goes past max_new (finish_step - step tokens are still due
            # after this one), and a decode never costs more than the whole step's budget.
            spec = min(k, budget - 1)
            costs = tuple(1 + min(spec, o.finish_step - step) for o in self._dec)
            total = sum(costs)
            if total <= budget:
                return self._dec_rids_t, self._dec_offsets_t, costs, total
            return self._overflow(costs, budget)
        if n <= budget:
            return self._dec_rids_t, self._dec_offsets_t, None, n
        return self._overflow((1,) * n, budget)

    def _overflow(
        self, costs: tuple[int, ...], budget: int
    ) -> tuple[tuple[Hashable, ...], tuple[int, ...], tuple[int, ...] | None, int]:
        """Ready decodes exceed the budget: the selection hook picks who runs; the rest skip a step."""
        order = None
        if self.policy == "priority":
            order = sorted(range(len(costs)), key=lambda i: self.priority_key(self._dec[i]))
        chosen = self._selection.select(costs, budget, order)
        picked = set(chosen)
        self._skipped = [o for i, o in enumerate(self._dec) if i not in picked]
        rids = tuple(self._dec_rids[i] for i in chosen)
        offsets = tuple(self._dec_offsets[i] for i in chosen)
        tokens = tuple(costs[i] for i in chosen)
        return rids, offsets, tokens if self.num_spec_tokens else None, sum(tokens)

    def _schedule_partial_prefill(self, left: int, out: list[ScheduledChunk]) -> int:
        """Contract step 2: the rest of the prompt started in an earlier step, up to `left` tokens."""
        obj = self._prefilling
        if obj is None or left <= 0:
            return left
        done = obj.num_prefilled
        rest = obj.prompt_len - done
        n = self._chunking.chunk(rest, left)
        if n:
            out.append(ScheduledChunk(obj.rid, n, True, done, n == rest))
        # A prompt that does not finish this step keeps what is left (less than a block when chunks are
        # block-aligned): admitting behind it would let a newer prompt reach its first token first.
        return left - n if n == rest else 0

    def _admit(self, left: int, out: list[ScheduledChunk]) -> tuple[Hashable, ...]:
        """Contract step 3: admission in queue order; the first head that does not fit stops it."""
        waiting = self._waiting
        admitted: list[Hashable] = []
        step = self._step
        while left > 0 and len(waiting):
            obj: _Live | None = waiting.head()
            if obj is None or self._num_running >= self.max_seqs or obj.kv > self._kv_free:
                break
            n = self._chunking.chunk(obj.prompt_len, left)
            if n == 0:  # never admit with a 0-token first chunk
                break
            waiting.pop_head()
            self._num_running += 1
            self._kv_free -= obj.kv
            obj.status = _PREFILLING
            obj.admitted_step = step
            out.append(ScheduledChunk(obj.rid, n, True, 0, n == obj.prompt_len))
            admitted.append(obj.rid)
            left = left - n if n == obj.prompt_len else 0  # as for the partial prefill above
        return tuple(admitted)

    def complete(
        self,
        plan: StepPlan,
        stopped: Iterable[Hashable] = (),
        num_accepted: Mapping[Hashable, int] | None = None,
    ) -> tuple[Hashable, ...]:
        """Apply an executed step: advance prefills, emit tokens, finish and release requests.

        Args:
            plan: the plan returned by the last schedule().
            stopped: rids that sampled a token in `plan` and whose token ended them (EOS, a stop
                string); they finish now with reason "stop" and their KV is released.
            num_accepted: with num_spec_tokens, tokens each decode emitted (1 to its entry's tokens);
                a decode not named emitted 1.

        Returns:
            The rids that emitted a token this step, in batch order (requests aborted while the
            plan was in flight emit nothing). Which of them finished, and why, is in
            `self.last_finished` until the next complete().

        Raises:
            SchedulerStateError: `plan` is not the plan in flight (stale, foreign or completed
                twice), a rid in `stopped` did not sample a token in `plan`, or num_accepted names a
                rid that did not decode in `plan` or a count outside 1..its tokens; nothing changes.
        """
        if plan is not self._inflight:
            raise SchedulerStateError(
                f"complete() of step {plan.step}, but the plan in flight is "
                f"{'none' if self._inflight is None else self._inflight.step}"
            )
        stopped_objs = self._validate_stopped(plan, stopped)
        accepted = self._validate_accepted(plan, num_accepted) if num_accepted else ()
        step = plan.step
        self._inflight = None
        self._step = step + 1
        self.last_finished = {}
        if self._skipped or accepted:
            self._shift_progress(accepted)
        last_rids: list[Hashable] = []
        for chunk in plan.prefills:
            obj = self._live[chunk.rid]
            obj.num_prefilled += chunk.num_tokens
            if not chunk.is_last:
                self._prefilling = obj
                continue
            if self._prefilling is obj:
                self._prefilling = None
            last_rids.append(chunk.rid)
            self._first_token(obj, step)
        for obj in stopped_objs:
            if obj.status is not _FINISHED:
                self._finish(obj, FinishReason.STOP)
        due = self._due.pop(step, None)
        if due:
            for obj in due:
                if obj.status is _DECODING and obj.finish_step == step:
                    self._finish(obj, FinishReason.LENGTH)
        emitted = plan.decode_rids + tuple(last_rids) if last_rids else plan.decode_rids
        aborts = self._inflight_aborts
        if aborts:
            for rid in aborts:
                aborted = self._live.get(rid)
                if aborted is not None:
                    self._finish(aborted, FinishReason.ABORT)
                else:
                    self.last_finished[rid] = FinishReason.ABORT
            emitted = tuple(r for r in emitted if r not in aborts)
            self._inflight_aborts = set()
        return emitted

    def _shift_progress(self, accepted: Iterable[tuple[_Live, int]]) -> None:
        """Move the derived progress of skipped decodes back a step and of multi-token decodes forward."""
        for obj, shift in [(o, 1) for o in self._skipped] + [(o, 1 - n) for o, n in accepted]:
            obj.base += shift
            obj.finish_step += shift
            self._due.setdefault(obj.finish_step, []).append(obj)
        self._skipped = []
        self._offsets_stale = True

    # ------------------------------------------------------------------ internals

    def _validate_stopped(self, plan: StepPlan, stopped: Iterable[Hashable]) -> list[_Live]:
        if not stopped:
            return []
        objs = []
        for rid in stopped:
            obj = self._live.get(rid)
            if obj is None or not self._sampled_in(obj, plan):
                raise SchedulerStateError(
                    f"stopped names rid {rid!r}, which did not sample a token in step {plan.step}"
                )
            objs.append(obj)
        return objs

    def _validate_accepted(self, plan: StepPlan, num_accepted: Mapping[Hashable, int]) -> list[tuple[_Live, int]]:
        tokens = dict(zip(plan.decode_rids, plan._decode_tokens or (1,) * plan.num_decodes, strict=True))
        out = []
        for rid, n in num_accepted.items():
            cost = tokens.get(rid)
            if cost is None:
                raise SchedulerStateError(f"num_accepted names rid {rid!r}, which did not decode in step {plan.step}")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cost:
                raise SchedulerStateError(f"num_accepted[{rid!r}] = {n!r}, must be an integer from 1 to {cost}")
            if n > 1:
                out.append((self._live[rid], n))
        return out

    def _decoded_in(self, obj: _Live, plan: StepPlan) -> bool:
        return (
            obj.status is _DECODING
            and obj.first_token_step is not None
            and obj.first_token_step < plan.step
            and obj not in self._skipped
        )

    def _sampled_in(self, obj: _Live, plan: StepPlan) -> bool:
        return self._decoded_in(obj, plan) or any(c.rid == obj.rid and c.is_last for c in plan.prefills)

    def _in_plan(self, obj: _Live, plan: StepPlan) -> bool:
        return self._decoded_in(obj, plan) or any(c.rid == obj.rid for c in plan.prefills)

    def _first_token(self, obj: _Live, step: int) -> None:
        obj.first_token_step = step
        obj.status = _DECODING
        if obj.max_new == 1:
            self._finish(obj, FinishReason.LENGTH)
            return
        obj.base = step - 1
        obj.finish_step = step - 1 + obj.max_new
        self._due.setdefault(obj.finish_step, []).append(obj)
        self._dec.append(obj)
        self._dec_rids.append(obj.rid)
        off = obj.offset
        self._dec_offsets.append(off)
        self._dec_offset_sum += off
        self._dec_dirty = True

    def _finish(self, obj: _Live, reason: FinishReason, report: bool = True) -> None:
        """Release a running request's KV and slot and forget it; `report` lists it in last_finished."""
        if obj.status is _DECODING and obj.max_new > 1:
            i = self._dec.index(obj)
            del self._dec[i], self._dec_rids[i]
            self._dec_offset_sum -= self._dec_offsets.pop(i)
            self._dec_dirty = True
        elif self._prefilling is obj:
            self._prefilling = None
        self._num_running -= 1
        self._kv_free += obj.kv
        self._forget(obj, _ABORTED if reason is FinishReason.ABORT else _FINISHED)
        if report:
            self.last_finished[obj.rid] = reason

    def _forget(self, obj: _Live, status: RequestStatus) -> None:
        obj.status = status
        del self._live[obj.rid]
        recent = self._recent_finished
        recent[obj.rid] = None
        if len(recent) > _RECENT_FINISHED:
            del recent[next(iter(recent))]
