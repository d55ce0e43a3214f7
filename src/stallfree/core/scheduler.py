"""The continuous batching scheduler: a token budget spent on decodes, then the partial prefill,
then strict first-come-first-served admission with KV reserved for prompt_len + max_new.

Imports allowed: the standard library and stallfree.core only.

Source: stall-free batching with chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24);
iteration-level scheduling (Orca, Yu et al., OSDI'22).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping

from stallfree.core.errors import (
    InvalidConfig,
    RequestRejected,
    SchedulerStateError,
    check_positive_int,
)
from stallfree.core.lifecycle import RequestLifecycle, position_of
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.policies import FCFSQueue, PriorityQueue, WaitingQueue, build_policies
from stallfree.core.request import FinishReason, Request, RequestStatus

__all__ = ["Scheduler"]

_WAITING = RequestStatus.WAITING
_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING


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


class Scheduler(RequestLifecycle):
    """A continuous batching scheduler with a token budget and chunked prefill (docs/DESIGN.md section 1).

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

    _live: dict[Hashable, _Live]
    _prefilling: _Live | None
    _due: dict[int, list[_Live]]

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
        self._now = 0.0  # the clock's reading for the step being planned, seconds
        self.decode_overflow = decode_overflow
        self.num_spec_tokens = num_spec_tokens
        self.kv_total = self._chunking.capacity(kv_tokens)
        self._kv_free = self.kv_total
        self._init_lifecycle()
        self._waiting: WaitingQueue = FCFSQueue() if policy == "fcfs" else PriorityQueue(self.priority_key)
        self._seq = 0
        self._skipped: list[_Live] = []
        self._offsets_stale = False
        # Decodes in batch order (admission order), as three aligned lists plus cached tuples that
        # plans share while the set does not change.
        self._dec: list[_Live] = []
        self._dec_rids: list[Hashable] = []
        self._dec_offsets: list[int] = []
        self._dec_rids_t: tuple[Hashable, ...] = ()
        self._dec_offsets_t: tuple[int, ...] = ()
        self._dec_dirty = False
        self._dec_offset_sum = 0

    # ------------------------------------------------------------------ public state

    @property
    def kv_free(self) -> int:
        """Unreserved KV capacity, in tokens."""
        return self._kv_free

    @property
    def decode_load(self) -> tuple[int, int]:
        """(ready decodes, sum of their context lengths in tokens) for the step schedule() plans next.

        Ready decodes are the running requests whose prompt is fully prefilled; a decode's context
        is the tokens already in its KV cache (its entry's `start`). Without decode overflow, the
        next plan's num_decodes and decode_context_sum equal these. O(1): the scheduler keeps the
        sum of the decodes' offsets, and a decode's context at step k is its offset + k. After a
        step that skipped some decodes or gave some several tokens, the offsets are refreshed first
        (O(decodes), the work the next schedule() would otherwise do).
        """
        if self._offsets_stale:
            self._refresh_offsets()
        n = len(self._dec)
        return n, self._dec_offset_sum + n * self._step

    # ------------------------------------------------------------------ add / abort

    def kv_needed(self, req: Request) -> int:
        """KV reserved for `req` at admission, in tokens: prompt_len + max_new (in whole blocks with block_size)."""
        return self._chunking.kv_needed(req.prompt_len, req.max_new)

    def priority_key(self, obj: _Live) -> tuple[float, int]:
        """(effective priority, add order) of a live request; lower runs first under policy="priority"."""
        prio = obj.req.priority
        if self.aging_interval is None:
            return (prio, obj.seq)
        waited = self._now - obj.req.arrival if self.clock is not None else self._step - obj.arrival_step
        return (prio - math.floor(waited / self.aging_interval), obj.seq)

    # ------------------------------------------------------------------ the step

    def schedule(self, token_budget: int | None = None) -> StepPlan:
        """Plan the next step: decodes, then the partial prefill, then admissions.

        Args:
            token_budget: spend at most this many tokens in this step only (1 to the configured
                budget; raised to block_size when that is set); None uses the configured budget.

        Returns:
            The StepPlan of step `self.step`; empty when nothing can run.

        Raises:
            SchedulerStateError: the previous plan has not been completed, or `clock` returned
                something other than a finite number (nothing changes).
            InvalidConfig: token_budget is not an integer from 1 to the configured budget.
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"schedule() called twice: step {self._inflight.step} was not completed")
        budget = self.token_budget if token_budget is None else self._step_budget(token_budget)
        if self.clock is not None:
            # One reading per step, checked before anything changes: every priority of the step is
            # computed against the same time.
            now = self.clock()
            if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
                raise SchedulerStateError(f"clock() must return a finite number of seconds, got {now!r}")
            self._now = float(now)
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
            self._refresh_offsets()
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
            costs, total = self._spec_costs(min(k, budget - 1), step)
            if total <= budget:
                return self._dec_rids_t, self._dec_offsets_t, costs, total
            return self._overflow(costs, budget)
        if n <= budget:
            return self._dec_rids_t, self._dec_offsets_t, None, n
        return self._overflow((1,) * n, budget)

    def _spec_costs(self, spec: int, step: int) -> tuple[tuple[int, ...], int]:
        """Per-decode tokens with speculation: 1 + min(spec, finish_step - step).

        Only decodes due to finish within `spec` steps cost less than 1 + spec; they are found through
        the finish-step index, so this is a C-speed copy plus a lookup per such decode, not a Python
        loop over every decode.
        """
        n = len(self._dec)
        short: dict[int, tuple[_Live, int]] = {}
        for d in range(spec):
            for obj in self._due.get(step + d, ()):
                if obj.status is _DECODING and obj.finish_step == step + d:
                    short[id(obj)] = (obj, d)
        full = (1 + spec,) * n
        if not short:
            return full, n * (1 + spec)
        costs = list(full)
        total = n * (1 + spec)
        for obj, d in short.values():
            costs[position_of(self._dec, obj)] = 1 + d
            total -= spec - d
        return tuple(costs), total

    def _refresh_offsets(self) -> None:
        """Recompute the decodes' offsets after a step that moved some decodes' progress (skips,
        speculative tokens); O(decodes), once per such step."""
        self._dec_offsets = [o.prompt_len - o.base - 2 for o in self._dec]
        self._dec_offset_sum = sum(self._dec_offsets)
        self._offsets_stale = False
        self._dec_dirty = True

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

    def _before_apply(self, plan: StepPlan, accepted: list[tuple[_Live, int]]) -> int:
        """Move the derived progress of skipped decodes back a step and of multi-token decodes forward."""
        if self._skipped or accepted:
            self._shift_progress(accepted)
        return plan.step

    def _shift_progress(self, accepted: list[tuple[_Live, int]]) -> None:
        for obj, shift in [(o, 1) for o in self._skipped] + [(o, 1 - n) for o, n in accepted]:
            obj.base += shift
            obj.finish_step += shift
            self._due.setdefault(obj.finish_step, []).append(obj)
        self._skipped = []
        self._offsets_stale = True

    # ------------------------------------------------------------------ lifecycle hooks

    def _check_fits(self, req: Request) -> int:
        need = self.kv_needed(req)
        if need > self.kv_total:
            blocks = f" in whole blocks of {self.block_size}" if self.block_size else ""
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {req.prompt_len} + "
                f"{req.max_new} = {req.prompt_len + req.max_new}, {need} tokens of KV{blocks} "
                f"> kv_tokens = {self.kv_total}"
            )
        return need

    def _new_live(self, req: Request, need: int) -> _Live:
        obj = _Live(req, need, self._seq, self._step)
        self._seq += 1
        return obj

    def _num_generated(self, obj: _Live) -> int:
        return self._step - 1 - obj.base if obj.status is _DECODING else 0

    def _leave_running(self, obj: _Live) -> None:
        """Drop a running request from the decodes (or the partial prefill) and return its reservation."""
        if obj.status is _DECODING and obj.max_new > 1:
            i = position_of(self._dec, obj)
            del self._dec[i], self._dec_rids[i]
            self._dec_offset_sum -= self._dec_offsets.pop(i)
            self._dec_dirty = True
        elif self._prefilling is obj:
            self._prefilling = None
        self._num_running -= 1
        self._kv_free += obj.kv

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
