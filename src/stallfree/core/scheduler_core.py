"""The step of the continuous batching scheduler (SchedulerCore, the base of core/scheduler.py's Scheduler): a
token budget spent on decodes, then the partial prefill, then strict admission in queue order; its KV memory
is a collaborator behind the KVManager protocol.

Imports allowed: the standard library and stallfree.core only.

The options are a SchedulerConfig (core/config.py); the KV manager is built by kv_manager_for
(core/kv/factory.py; or given), and the scheduler only asks it (core/kv/protocol.py, docs/DESIGN.md "The KV
manager's contract"). The decode phase is a strategy in core/decode.py and the prefill phases strategies in
core/prefill.py, each acting through a narrow view made once; the decode bookkeeping is in core/live.py, the
option hooks in core/policies.py and add/abort/complete in core/lifecycle.py. What is here is the order of a
step, the one victim rule and preemption, the draft-token verbs and the complete() hooks, which read best
together. The figures (stats(), the KV queries) and the former spellings are mixins of Scheduler
(core/queries.py, core/aliases.py), kept apart so that this class compiles (setup.py's NATIVE_MODULES: a
compiled class has one base).

Source: stall-free batching with chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24);
iteration-level scheduling (Orca, Yu et al., OSDI'22); preemption by recompute (vLLM, Kwon et al.,
SOSP'23).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.config import as_config
from stallfree.core.decode import DecodeHost, PlainDecodes, SpeculativeDecodes
from stallfree.core.errors import InvalidConfig, RequestRejected, SchedulerStateError, check_positive_int
from stallfree.core.fairness import FairOnePartialPrefill, VTCQueue, queue_limit_of
from stallfree.core.kv import NO_TRANSFERS, KVManager
from stallfree.core.kv.factory import kv_manager_for
from stallfree.core.lifecycle import RequestLifecycle, end_reason
from stallfree.core.live import DecodeSet, LiveRequest
from stallfree.core.lora import LoraSlots
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.policies import FCFSQueue, PriorityQueue, build_policies
from stallfree.core.prefill import (
    NO_LIMITS,
    OnePartialPrefill,
    PartialPrefills,
    PrefillHost,
    PrefillRule,
    StepBudget,
    StepLimits,
)
from stallfree.core.request import FinishReason, Request, RequestStatus

__all__ = ["SchedulerCore"]

_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_PREEMPTED = RequestStatus.PREEMPTED
#: The fields SchedulerCore._wire makes (a copy makes its own).
_VIEWS = ("_kv_transfers", "_decode_host", "_host")


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class SchedulerCore(RequestLifecycle):
    """The step of Scheduler (its base): schedule(), the draft-token verbs and the complete() hooks over the
    state its constructor builds. Use Scheduler (core/scheduler.py), which adds stats(), the KV queries and
    the former spellings; this class's constructor, methods and errors are Scheduler's, documented there.
    """

    _live: dict[Hashable, LiveRequest]
    _kv: KVManager

    # The arguments a caller hands in to be checked are read as `object` (a compiled build would convert or
    # refuse a bool, a float or a string before the check that names the field): Scheduler's docstring gives
    # their types.
    def __init__(
        self, config: object = None, max_seqs: object = None, kv_tokens: object = None, *,
        kv_manager: KVManager | None = None, **options: Any,
    ) -> None:
        cfg = self.config = as_config(cast(Any, config), cast(Any, max_seqs), cast(Any, kv_tokens), options)
        # The options the step reads, resolved once (config's chunks_aligned and partial_prefill_limits
        # recompute their checks on each read).
        self._token_budget, self._max_seqs, self._block_size = cfg.token_budget, cfg.max_seqs, cfg.block_size
        self._align_chunks = cfg.chunks_aligned
        self._aging_interval, self._clock = cfg.aging_interval, cfg.clock
        self._num_spec_tokens = cfg.num_spec_tokens
        self._ties_by_arrival = cfg.priority_ties == "arrival"
        self._chunking, self._policy, self._selection = build_policies(
            cfg.chunk_alignment, cfg.policy, cfg.aging_interval, cfg.clock, cfg.decode_overflow, cfg.num_spec_tokens,
            clock_needed=cfg.max_queue_time_s is not None)
        k, lng, thr = cfg.partial_prefill_limits
        self._multi = k > 1
        self._prefill: PrefillRule = PartialPrefills(k, lng, thr) if thr is not None else OnePartialPrefill()
        if cfg.fairness == "vtc" and thr is None and not cfg.cpu_kv_tokens:
            self._prefill = FairOnePartialPrefill(cfg.tenant_chunk_tokens)
        self._kv = kv_manager_for(cfg) if kv_manager is None else kv_manager
        # LoRA adapters (core/lora.py): None without max_loras, so admission is the contract's.
        self._lora = LoraSlots(cfg.max_loras, cfg.max_lora_passes) if cfg.max_loras is not None else None
        self._init_lifecycle()
        self._now = 0.0  # the clock's reading for the step being planned, seconds
        self._decodes = DecodeSet()
        self._due = self._decodes.due
        self._fair: VTCQueue | None = (
            VTCQueue(cfg.tenant_weights, cfg.tenant_burst_tokens) if cfg.fairness == "vtc" else None)
        self._waiting = (
            self._fair if self._fair is not None
            else FCFSQueue() if self._policy == "fcfs" else PriorityQueue(self._priority_key))
        self._queue_limit = queue_limit_of(cfg.max_queue_time_s)
        self._has_queue_limits = cfg.max_queue_time_s is not None
        self._seq = 0
        self._front_seq = -1  # add order of the next add(front=True): counts down
        self._admit_seq = 0
        self._decode: PlainDecodes = SpeculativeDecodes(cfg.num_spec_tokens) if cfg.num_spec_tokens else PlainDecodes()
        self._limits = NO_LIMITS  # what this step's schedule() asks of the prefill phase beyond its budget
        self._partials: list[LiveRequest] = []  # the prompts admitted and still in prefill, admission order
        self._wire()
        # Counters reported by stats(): preemptions so far, and prefill tokens scheduled in episodes after
        # a preemption (prompt + generated, recomputed).
        self._num_preemptions = 0
        self._num_recomputed_tokens = 0

    def _wire(self) -> None:
        """Make the views that call back into this scheduler: the decode and prefill hosts (core/decode.py,
        core/prefill.py), the priority queue's key and the KV manager's step transfers. Each holds bound
        methods, so a copy makes its own (__deepcopy__)."""
        self._kv_transfers = self._kv.step_transfers
        if isinstance(self._waiting, PriorityQueue):
            self._waiting.key = self._priority_key
        self._decode_host = DecodeHost(
            self._decodes, self._kv, self._live, self._grow, self._selection,
            self._priority_key if self._policy == "priority" else None, self._multi)
        self._host = PrefillHost(
            self, chunking=self._chunking, kv=self._kv, waiting=self._waiting, live=self._live,
            partials=self._partials, max_seqs=self._max_seqs, policy=self._policy, priority_key=self._priority_key,
            grow=self._grow, can_admit=self._kv_admits, admit=self._take_in, preempt=self._preempt,
            victim=self._victim, recomputed=self._recomputed, lora=self._lora,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> SchedulerCore:
        """A detached copy (copy.deepcopy; Scheduler.snapshot): every field copied, then the views that call
        back into the scheduler made afresh on the copy. Why not the default copy: in the compiled build a
        bound method of a compiled object copies as itself (copy treats a built-in method as atomic), so
        the copy's views would step the original."""
        cls = self.__class__
        twin = cls.__new__(cls)
        memo[id(self)] = twin
        fields: Any = self.__getstate__()  # the compiled class's fields, or the pure one's __dict__
        state: dict[str, Any] = dict(fields)
        state.update(getattr(self, "__dict__", {}))
        for view in _VIEWS:
            del state[view]
        for name, value in copy.deepcopy(state, memo).items():
            setattr(twin, name, value)
        twin._wire()
        return twin

    # ------------------------------------------------------------------ public state

    @property
    def partial_prefills(self) -> tuple[Hashable, ...]:
        """The rids of the prompts admitted whose prefill is not done, in admission order (those of the
        plan in flight included); at most max_num_partial_prefills once it completes."""
        return tuple(o.rid for o in self._partials)

    @property
    def kv_manager(self) -> KVManager:
        """The KV manager this scheduler asks (its own, or the one given as kv_manager=); for
        checkers, reports and the engine, which read a manager's own extras (a CPU tier's)."""
        return self._kv

    @property
    def decode_load(self) -> tuple[int, int]:
        """(ready decodes, sum of their context lengths in tokens) for the step schedule() plans next.

        A decode's context is the tokens already in its KV (its entry's `start`). Without
        decode overflow or preemption, the next plan's num_decodes and decode_context_sum equal
        these. O(1) unless some decodes moved irregularly in the last step (then O(decodes), the
        work the next schedule() would do anyway).
        """
        dec = self._decodes
        return len(dec), dec.context_sum(self._step)

    def _runs_in_flight(self, obj: LiveRequest) -> bool:
        """A plan is in flight and `obj` is not a decode it skipped (whose KV does not grow in it)."""
        return self._inflight is not None and obj not in self._decode.skipped

    def _priority_key(self, obj: LiveRequest) -> tuple[float, ...]:
        """(effective priority, add order) of a live request, or (effective priority, arrival, add order)
        with priority_ties="arrival"; lower runs first under policy="priority"."""
        prio = obj.req.priority
        if self._aging_interval is not None:
            waited = self._now - obj.req.arrival if self._clock is not None else self._step - obj.arrival_step
            prio = prio - math.floor(waited / self._aging_interval)
        if self._ties_by_arrival:
            return (prio, obj.req.arrival, obj.seq)
        return (prio, obj.seq)

    # ------------------------------------------------------------------ draft tokens (speculative decoding)

    def set_draft_tokens(self, rid: Hashable, num_drafts: object) -> None:
        """Give decode `rid` `num_drafts` draft tokens (a drafter's proposals) to verify in the next step.

        The next schedule() runs each decode's one token first (for every decode, as always), then
        its drafts, decodes in batch order, from the budget left: min(num_drafts, budget left,
        limit - generated - 1) of them (a decode never verifies past its last token), fewer when the
        KV manager cannot hold them without a preemption; then the partial prefills and admissions
        (docs/scheduling.md, "Draft tokens"). The plan's `decode_tokens` gives each decode's 1 +
        drafts. The count is for that one schedule(), which consumes it; a later call before it
        replaces it, 0 clears it. A request that is not decoding (waiting, prefilling) ignores it,
        as vLLM ignores drafts for a prefill.

        After the step: complete(plan, num_accepted={rid: tokens emitted}) gives the verdict at once;
        a decode with drafts that num_accepted does not name counts all of them provisionally (its
        computed tokens and output advance by 1 + drafts, as vLLM counts them when it schedules), and
        take_back(rid, n) later settles them.

        Args:
            rid: a live request.
            num_drafts: draft tokens, an integer >= 0.

        Raises:
            KeyError: `rid` is not live.
            SchedulerStateError: num_drafts is not an integer >= 0, or the scheduler prices every
                decode with num_spec_tokens (the two do not mix); nothing changes.
        """
        obj = self._find(rid)
        if obj is None:
            raise KeyError(f"set_draft_tokens(): unknown rid {rid!r}")
        if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or num_drafts < 0:
            raise SchedulerStateError(f"set_draft_tokens(): num_drafts must be an integer >= 0, got {num_drafts!r}")
        if self._num_spec_tokens:
            raise SchedulerStateError(
                f"set_draft_tokens(): this scheduler prices every decode with num_spec_tokens = "
                f"{self._num_spec_tokens}; per-request draft tokens need num_spec_tokens = 0"
            )
        if obj.status is not _DECODING or obj.finish_step < 0:
            return
        self._speculative().set_drafts(obj, num_drafts)

    def take_back(self, rid: Hashable, num_rejected: object) -> FinishReason | None:
        """Settle the oldest provisional draft step of decode `rid`: `num_rejected` of its drafts were
        rejected after all.

        The rejected tokens are taken back: the request's computed tokens and output go back by
        num_rejected (its last token is due that many steps later); the KV manager keeps only the KV
        of the tokens left (`trim`; vLLM's keeps the blocks it gave, the core's own frees those past
        them). A decode whose provisional count reached its last token waits, unscheduled, for its
        verdicts; when the last one takes nothing back it finishes here (reason "length", or "stop"
        after stop_after()), listed in last_finished.

        Call it between steps (after complete(), before the next schedule()), once per step in which
        `rid` ran drafts without a verdict, in step order (unsettled_drafts(rid) lists them).

        Args:
            rid: a live decode with unsettled drafts; a request that finished recently is a no-op.
            num_rejected: an integer from 0 to that step's drafts.

        Returns:
            The FinishReason when it finished here, else None.

        Raises:
            KeyError: `rid` was never added (or finished too long ago to be remembered).
            SchedulerStateError: a plan is in flight, `rid` has no unsettled drafts, or num_rejected is
                out of range; nothing changes.
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"take_back() between steps only: step {self._inflight.step} is in flight")
        obj = self._find(rid)
        if obj is None:
            if self._finished_recently(rid):
                return None
            raise KeyError(f"take_back(): unknown rid {rid!r}")
        if not obj.unsettled:
            raise SchedulerStateError(f"take_back(): rid {rid!r} has no unsettled draft tokens")
        d = obj.unsettled[0]
        if isinstance(num_rejected, bool) or not isinstance(num_rejected, int) or not 0 <= num_rejected <= d:
            raise SchedulerStateError(f"take_back(): num_rejected for rid {rid!r} must be an integer from 0 to {d} "
                                      f"(the drafts of its oldest unsettled step), got {num_rejected!r}")
        obj.unsettled = obj.unsettled[1:]
        spec = self._speculative()
        held = spec.is_held(obj)
        if num_rejected:
            # The blocks promised to it for the tokens it had get their ids first, so that trim() gives back
            # those past its tokens now (else a promise no table is owed would stay counted as used).
            self._kv.moved(obj, self._step)
            self._decodes.shift(obj, -num_rejected)
            self._kv.moved(obj, self._step)
            self._kv.trim(obj, obj.offset + self._step)
        if held and (num_rejected or not obj.unsettled):
            spec.release(obj)
            if not num_rejected:
                reason = end_reason(obj)
                self._finish(obj, reason)
                return reason
        return None

    def unsettled_drafts(self, rid: Hashable) -> tuple[int, ...]:
        """Per step whose drafts live request `rid` counted provisionally, oldest first, the number of
        drafts take_back() is still to settle; () when none.

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live_request(rid)
        return obj.unsettled

    def _speculative(self) -> SpeculativeDecodes:
        """The decode phase as SpeculativeDecodes: a plain one becomes one (its skipped decodes kept) the
        first time a decode is given draft tokens, so a scheduler that never drafts never pays for them."""
        dec = self._decode
        if not isinstance(dec, SpeculativeDecodes):
            spec = SpeculativeDecodes(self._num_spec_tokens)
            spec.skipped = dec.skipped
            self._decode = dec = spec
        return dec

    # ------------------------------------------------------------------ the step

    def schedule(
        self, token_budget: object = None, *, admit: object = True, chunk_cap: object = None,
    ) -> StepPlan:
        """Plan the next step: decodes, then the partial prefill, then admissions.

        Args:
            token_budget: spend at most this many tokens in this step only (1 to the configured
                budget; raised to block_size when chunks are aligned); None: the configured budget.
            admit: False: this step admits no waiting request (running requests go on as usual; an
                engine pausing new work, or holding prefill back for a step). Or an admission filter,
                `admit(rid) -> bool`: it is asked once for each waiting request, in queue order, before
                anything changes; the requests it refuses (False) are passed over in this step's
                admission and keep their places in the queue, and the others are admitted by the usual
                rules in queue order among themselves. This is the one place the core admits out of
                queue order, and only when the engine asks (vLLM's PAUSED_NEW, which admits only the
                waiting requests that already hold KV, docs/vllm.md). True (the default) and a filter
                that refuses nothing plan the same step.
            chunk_cap: an engine's per-request limit on prompt chunks in this step, or None.
                `chunk_cap(rid, start, n)` is called for each prompt chunk the budget has sized, `n`
                tokens (>= 1) from token `start` of request `rid`, in the order the budget is spent and
                before the KV manager is asked for it; it returns the most tokens the chunk may take,
                an integer from 0 to n. The chunk takes that many (rounded down to a block boundary
                when chunks are block-aligned and it is short of n); 0: the request takes no chunk in
                this step, which then goes on as for a prompt that does not fit (a partial prefill
                keeps the rest of the budget; a queue head stops admission). A top-up of the budget
                left (max_num_partial_prefills > 1) asks again with the chunk's longer length. For an
                engine whose chunks must stop at an input it cannot process this step (a multimodal
                encoder's budget, docs/vllm.md).

        Returns:
            The StepPlan of step `self.step`; `plan.preempted` lists the requests preempted in it
            (in arrival order). Empty when nothing can run.

        Raises:
            SchedulerStateError: the previous plan has not been completed, or `clock` returned
                something other than a finite number (nothing changes); chunk_cap returned something
                other than an integer from 0 to n (the message names the call and the value; the
                step is then lost and the scheduler must not be used further).
            InvalidConfig: token_budget is not an integer from 1 to the configured budget, admit is
                neither a bool nor callable, the filter returned something other than a bool (the
                message names the rid and the value), or chunk_cap is neither None nor callable
                (nothing changes).
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"schedule() called twice: step {self._inflight.step} was not completed")
        budget = self._token_budget if token_budget is None else self._step_budget(token_budget)
        refused: frozenset[int] | None = None
        if admit is not True and admit is not False:
            if not callable(admit):
                raise InvalidConfig(f"schedule(): admit must be a bool or callable, got {admit!r}")
            refused = self._refused_by(admit)
            admit = True
        if chunk_cap is not None and not callable(chunk_cap):
            raise InvalidConfig(f"schedule(): chunk_cap must be None or callable, got {chunk_cap!r}")
        if self._clock is not None:
            # One reading per step, checked before anything changes.
            now = self._clock()
            if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
                raise SchedulerStateError(f"clock() must return a finite number of seconds, got {now!r}")
            self._now = float(now)
        timed_out = self._expire_waiting() if self._has_queue_limits else ()
        step = self._step
        victims: list[LiveRequest] = []
        decode_rids, decode_offsets, decode_tokens, used = self._decode.plan(self._decode_host, budget, step, victims)
        if self._fair is not None:
            self._charge(self._fair, decode_rids, decode_tokens or (1,) * len(decode_rids))
        prefills: list[ScheduledChunk] = []
        if admit and chunk_cap is None and not refused:
            self._limits = NO_LIMITS
        else:
            self._limits = StepLimits(admit, chunk_cap, refused or None)
        admitted = self._prefill.plan(self._host, StepBudget(budget - used, used), prefills, victims, used > 0)
        if victims:
            # Passing over a request (a filter's refusal or an adapter that cannot join) may let a
            # newer request be admitted, and preempted, ahead of it.
            self._requeue(victims, bool(refused) or self._lora is not None)
        fair = self._fair
        if fair is not None:
            # The continuing partial prefill; the decodes were charged before admission, each admission's
            # first chunk when admitted.
            if prefills:
                cont = [c for c in prefills if c.rid not in admitted]
                self._charge(fair, [c.rid for c in cont], [c.num_tokens for c in cont])
        dec = self._decodes
        # The shared tuple is fresh (tuples() ran in this step), so its sum is kept incrementally.
        fresh = decode_offsets is dec._offsets_t
        ctx = dec._offset_sum if fresh else sum(decode_offsets)
        plan = StepPlan(
            step,
            decode_rids,
            decode_offsets,
            tuple(prefills),
            used + sum(c.num_tokens for c in prefills) if prefills else used,
            ctx + len(decode_rids) * step,
            budget,
            admitted,
            tuple(v.rid for v in sorted(victims, key=_by_seq)) if victims else (),
            decode_tokens,
            decode_offsets_sorted=dec.sorted_offsets() if fresh and decode_offsets else None,
        )
        # A manager with a second KV tier (core/kv_tier.py) hands over each step's copies.
        transfers = self._kv_transfers()
        if transfers is not NO_TRANSFERS:
            plan.kv_offloads, plan.kv_loads = transfers
        if timed_out:
            plan.timed_out = timed_out
        self._inflight = plan
        return plan

    def _charge(self, fair: VTCQueue, rids: Sequence[Hashable], tokens: Sequence[int]) -> None:
        """fairness="vtc": count the planned tokens of `rids` against their tenants."""
        live = self._live
        for rid, n in zip(rids, tokens, strict=True):
            fair.charge(live[rid].req.tenant_name, n)

    def _expire_waiting(self) -> tuple[Hashable, ...]:
        """Finish, with reason "timeout", every never-admitted waiting request that has waited longer than
        its tenant's max_queue_time_s (now minus its arrival, seconds); their places are freed. O(waiting)."""
        now, limit_of = self._now, self._queue_limit
        expired = []
        for obj in self._waiting.in_order():
            if obj.status is not RequestStatus.WAITING:
                continue  # a preempted request has produced tokens: it is never shed
            limit = limit_of(obj.req.tenant_name)
            if limit is not None and now - obj.req.arrival > limit:
                expired.append(obj)
        for obj in expired:
            self._waiting.remove(obj)
            self._forget(obj, RequestStatus.FINISHED)
        return tuple(o.rid for o in expired)

    def _refused_by(self, admit: Callable[[Hashable], object]) -> frozenset[int]:
        """The ids of the waiting records that the admission filter `admit` refuses, asked once each in queue
        order; raises InvalidConfig (before anything changes) for an answer that is not a bool."""
        refused = []
        for obj in self._waiting.in_order():
            ok = admit(obj.rid)
            if ok is not True and ok is not False:
                raise InvalidConfig(f"schedule(): admit({obj.rid!r}) must return a bool, got {ok!r}")
            if not ok:
                refused.append(id(obj))
        return frozenset(refused)

    def _step_budget(self, given: object) -> int:
        token_budget = check_positive_int("token_budget", given)
        if token_budget > self._token_budget:
            raise InvalidConfig(
                f"token_budget for one step ({token_budget}) exceeds the configured token_budget ({self._token_budget})"
            )
        return max(token_budget, self._block_size or 1) if self._align_chunks else token_budget

    def _grow(self, obj: LiveRequest, tokens: int, step: int, victims: list[LiveRequest]) -> bool:
        """Give a running request the blocks for `tokens` tokens, preempting others (or, when none
        may be preempted for it, itself) while the pool has too few; True if it got them."""
        kv = self._kv
        while not kv.grow(obj, tokens, step):
            victim = self._victim_for(obj)
            self._preempt(victim, step, victims)
            if victim is obj:
                return False
        return True

    def _victim_for(self, obj: LiveRequest) -> LiveRequest:
        """The running request preempted so that `obj` gets a block (the victim rule over every running
        request: the decodes and the partial prefills)."""
        return self._victim(obj, self._decodes.recs + self._partials)

    def _victim(self, obj: LiveRequest, running: list[LiveRequest]) -> LiveRequest:
        """The one victim rule: among `running` those admitted after `obj`, the newest (fcfs) or the
        least urgent, newest first among equals (priority); `obj` itself when there is none. So the
        oldest running request is never a victim and every run ends."""
        later = [o for o in running if o.admit_seq > obj.admit_seq]
        if not later:
            return obj
        if self._policy != "priority":
            return max(later, key=_by_admission)
        return max(later, key=lambda o: (self._priority_key(o)[0], o.admit_seq))

    def _kv_admits(self, obj: LiveRequest, first_chunk: int, hits: Sequence[int]) -> bool:
        """Whether the KV manager admits `obj` with a first chunk of `first_chunk` tokens (`hits`: the
        handle of its lookup)."""
        return self._kv.can_admit(obj, first_chunk, self._num_running, hits)

    def _take_in(self, obj: LiveRequest, first_chunk: int, hits: Sequence[int], start: int) -> None:
        """Admit `obj` (already out of the queue): its KV (`hits`: the handle of its lookup; the
        prefill starts at token `start`), its status and admission order; it joins the partial prefills."""
        self._kv.admit(obj, first_chunk, hits)
        if self._lora is not None:
            self._lora.join(obj.req.lora)
        if self._fair is not None:  # charged now, so that the next pick of this step sees it
            self._fair.charge(obj.req.tenant_name, first_chunk)
            self._fair.started(obj.req.tenant_name)
        self._partials.append(obj)
        obj.num_prefilled = start
        self._num_running += 1
        obj.status = _PREFILLING
        obj.admit_seq = self._admit_seq
        self._admit_seq += 1
        if obj.admitted_step is None:
            obj.admitted_step = self._step

    def _recomputed(self, tokens: int) -> None:
        """Count prefill tokens scheduled in a recompute episode (after a preemption)."""
        self._num_recomputed_tokens += tokens

    def _preempt(self, obj: LiveRequest, step: int, victims: list[LiveRequest]) -> None:
        """Preempt a running request by recompute: free its KV, queue it to prefill prompt + generated."""
        gen = obj.num_output_tokens
        self._leave_running(obj)
        obj.status = _PREEMPTED
        obj.gen0 = gen
        obj.target = obj.num_prompt_tokens + gen
        obj.num_prefilled = 0
        obj.decode_step = -1
        obj.admit_seq = -1
        obj.num_preemptions += 1
        self._num_preemptions += 1
        victims.append(obj)
        skipped = self._decode.skipped
        if obj in skipped:
            skipped.remove(obj)

    def _requeue(self, victims: list[LiveRequest], filtered: bool = False) -> None:
        """Victims go back to the queue: FCFS, in front of every never-started request, oldest first
        (requests queued with add(front=True), whose add order counts down from -1, are ordered with
        them by add order, so those still waiting at the head stay there). `filtered`: the step's
        admission filter may have passed over preempted requests at the head, so the victims are
        ordered by add order with every preempted or front-added request leading the queue."""
        if isinstance(self._waiting, FCFSQueue):
            queue = self._waiting
            if filtered:
                lead = list(victims)
                head = queue.head()
                while head is not None and (head.seq < 0 or head.status is _PREEMPTED):
                    lead.append(queue.pop_head())
                    head = queue.head()
                queue.push_front(sorted(lead, key=_by_seq))
                return
            if self._front_seq < -1:
                lead = list(victims)
                head = queue.head()
                while head is not None and head.seq < 0:
                    lead.append(queue.pop_head())
                    head = queue.head()
                queue.push_front(sorted(lead, key=_by_seq))
                return
            queue.push_front(sorted(victims, key=_by_seq))
        else:
            for obj in victims:
                self._waiting.append(obj)

    def _before_apply(self, plan: StepPlan, accepted: list[tuple[LiveRequest, int]]) -> int:
        """Tell the KV manager which prompt tokens the step computed, then let the decode phase move the
        progress of skipped decodes back a step and of multi-token decodes forward."""
        self._decodes.clock = self._step
        kv = self._kv
        live = self._live
        # The manager learns which tokens are computed as soon as the chunk that computes them completes.
        for chunk in plan.prefills:
            kv.filled(live[chunk.rid], chunk.start, chunk.start + chunk.num_tokens)
        self._decode.after_step(self._decode_host, plan, accepted, self._step)
        return plan.step

    # ------------------------------------------------------------------ lifecycle hooks

    def _check_front(self, front: object) -> None:
        if not isinstance(front, bool):
            raise RequestRejected(f"add(): front must be a bool, got {front!r}")
        if self._policy != "fcfs":
            raise RequestRejected(f"add(): front=True needs policy='fcfs', the policy is {self._policy!r}")
        if self._fair is not None:
            raise RequestRejected("add(): front=True needs fairness='fcfs' (one queue); under 'vtc' a request "
                                  "goes to its tenant's queue")

    def _queue_front(self, obj: LiveRequest) -> None:
        """Queue `obj` at the head: its add order (`seq`) is the next of a count down from -1, so it sorts
        before every request added before it, as the victims of a step are sorted."""
        obj.seq = self._front_seq
        self._front_seq -= 1
        fcfs = self._waiting
        assert isinstance(fcfs, FCFSQueue)
        fcfs.push_front([obj])

    def _check_fits(self, req: Request) -> int:
        return self._kv.check_fits(req)

    def _new_live(self, req: Request, need: int) -> LiveRequest:
        obj = LiveRequest(req, need, self._seq, self._step, self._decodes)
        self._seq += 1
        return obj

    def _num_generated(self, obj: LiveRequest) -> int:
        return obj.num_output_tokens

    def _leave_running(self, obj: LiveRequest) -> None:
        """Drop a running request from the decodes (or the partial prefill) and free its KV."""
        self._kv.free(obj, self._step, self._runs_in_flight(obj))
        if self._lora is not None:
            self._lora.leave(obj.req.lora)
        if obj.drafts or obj.unsettled:
            self._decode.forget(obj)
        if obj.finish_step >= 0:
            self._decodes.leave(obj)
        elif obj in self._partials:
            self._partials.remove(obj)
        if self._fair is not None:
            self._fair.stopped(obj.req.tenant_name)
        self._num_running -= 1

    def _hold(self, obj: LiveRequest) -> None:
        """`obj` reached its last token with drafts unsettled: it stays, unscheduled, until take_back()."""
        self._speculative().hold(obj)

    def _validate_accepted(
        self, plan: StepPlan, num_accepted: Mapping[Hashable, int]
    ) -> list[tuple[LiveRequest, int]]:
        return self._decode.validate_accepted(plan, num_accepted, self._live)

    def _decoded_in(self, obj: LiveRequest, plan: StepPlan) -> bool:
        return (
            obj.status is _DECODING
            and 0 <= obj.decode_step < plan.step
            and obj not in self._decode.skipped
        )

    def _first_token(self, obj: LiveRequest, step: int) -> None:
        """The last chunk of an episode sampled token gen0 + 1: finish, or start decoding."""
        if obj.first_token_step is None:
            obj.first_token_step = step
        self._partials.remove(obj)
        obj.status = _DECODING
        obj.decode_step = step
        if obj.gen0 + 1 == obj.limit:
            self._finish(obj, end_reason(obj))
            return
        self._decodes.join(obj, obj.num_prompt_tokens + obj.gen0 - step - 1, step - 1 - obj.gen0 + obj.limit)
        self._kv.start_decode(obj)


def _by_seq(obj: LiveRequest) -> int:
    return obj.seq


def _by_admission(obj: LiveRequest) -> int:
    return obj.admit_seq

