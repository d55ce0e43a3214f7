"""The continuous batching scheduler: a token budget spent on decodes, then the partial prefill,
then strict admission in queue order; its KV policy (reservation or paged blocks) is a collaborator.

Imports allowed: the standard library and stallfree.core only.

Longer than the ~400-line guide (about 700 lines, a third of them docstrings): the decode phase, the one
victim rule and preemption, and the complete() hooks read best together. The KV policies are behind the
KVManager protocol in core/kv.py, the prefill phases are strategies in core/prefill.py, the decode
bookkeeping is in core/live.py, the option hooks in core/policies.py and the shared add/abort/complete
in core/lifecycle.py.

Source: stall-free batching with chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24);
iteration-level scheduling (Orca, Yu et al., OSDI'22); paged KV and preemption by recompute
(PagedAttention / vLLM, Kwon et al., SOSP'23).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence

from stallfree.core.errors import InvalidConfig, SchedulerStateError, check_positive_int
from stallfree.core.kv import KV_POLICIES, KVManager, PrefixCacheView, build_kv_manager, check_kv_options
from stallfree.core.lifecycle import RequestLifecycle, end_reason
from stallfree.core.live import DecodeSet, LiveRequest, position_of
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.policies import (
    FCFSQueue,
    PriorityQueue,
    WaitingQueue,
    build_policies,
    check_partial_prefills,
)
from stallfree.core.prefill import OnePartialPrefill, PartialPrefills, PrefillRule, StepBudget
from stallfree.core.request import Request, RequestStatus

__all__ = ["KV_POLICIES", "PagedScheduler", "Scheduler"]

_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_PREEMPTED = RequestStatus.PREEMPTED

_Decodes = tuple[tuple[Hashable, ...], tuple[int, ...], tuple[int, ...] | None, int]


class Scheduler(RequestLifecycle):
    """A continuous batching scheduler with a token budget and chunked prefill (docs/DESIGN.md section 1).

    It owns the waiting queue, the running set (through a DecodeSet and the partial prefill) and its
    KV policy; it never sees token ids or tensors. Each step is one `schedule()` (a StepPlan) and one
    `complete(plan)`. The budget is spent in a fixed order:

    1. decodes: one token for every running request whose prefill is done, oldest admitted first;
    2. the partial prefill: the rest of a prompt started in an earlier step, up to what is left;
    3. admission: waiting requests strictly in queue order (add() order, or priority order); the head
       needs a free slot (running < max_seqs), budget left and its KV (below); the first head that
       does not fit stops admission.

    KV policies (kv_policy=):

    - "reserve" (the contract): prompt_len + max_new tokens reserved at admission, returned when it
      finishes; nothing is ever preempted.
    - "paged": kv_tokens // block_size blocks (rounded down); a request takes blocks as its tokens
      are scheduled; admission needs the blocks of the first chunk while floor(watermark x blocks)
      stay free (waived when nothing runs; a preempted head needs its whole recompute). A decode or
      the partial prefill that cannot get its block preempts by recompute (`_preempt`): under
      policy="fcfs" the most recently admitted running request; under "priority" the least urgent
      among those admitted after it (newest first among equals); itself when there is none. So the
      oldest running request is never a victim and every run ends. A victim frees its blocks,
      returns to the queue (FCFS: at its front, in arrival order; priority: by its unchanged
      priority and aging clock) and, readmitted, prefills prompt + generated tokens; a step that
      preempted admits nothing.

    Invariants (checked by stallfree.core.invariants.InvariantChecker): scheduled tokens <=
    budget; running <= max_seqs; KV accounting exact; every prompt (episode) gets exactly its
    prefill tokens; every request gets exactly max_new tokens unless stopped or aborted; admission
    in queue order; the decodes of a step are the oldest ready ones; all KV returned at the end.

    Example (the hand trace): budget 8, one decode running, a 20-token prompt arrives::

        step 0: decode + chunk of 7     step 1: decode + chunk of 7
        step 2: decode + chunk of 6 -> the prompt's first token comes out of this (third) step

    Options (each off by default, each under both KV policies; docs/scheduling.md):

    - align_chunks: every non-final chunk is a multiple of block_size. None: on for "reserve" with a
      block_size (which also reserves whole blocks), off for "paged".
    - policy="priority" (aging_interval=, clock=): admission, overflowing decodes and victims are
      ordered by (effective priority, arrival), effective = priority - floor(waited /
      aging_interval), waited in steps, or seconds when `clock` is given.
    - decode_overflow="oldest" | "rotate": when ready decodes do not fit the budget.
    - num_spec_tokens=k: a decode costs 1 + min(k, max_new - generated - 1, budget - 1) tokens;
      complete(num_accepted=) says how many it emitted.
    - max_num_partial_prefills=K > 1, max_long_partial_prefills=L, long_prefill_token_threshold=T:
      up to K prompts partially prefilled at once, at most L of them long (tokens still to compute
      > T). The step: decodes; the partial prefills in admission (or priority) order, a long one
      taking at most T tokens; admissions in queue order, a long head taking at most T and passed
      by shorter ones only while L long prompts are partially prefilled; then the budget left goes
      back to the partial prefills in order, but in a step with decodes only to the short ones, so
      a long prompt's chunk is then at most T tokens (its attention over a long prefix would slow
      the step every decode waits for). The j-th partial prefill in order (j = 0 first) gains at
      least min(T, rest, left - j x T) tokens a step, left = budget after decodes (rounded down to
      block_size when chunks are aligned). Under "paged" a partial prefill that lacks blocks
      preempts only newer partial prefills, else waits a step.

    Args:
        token_budget: the most tokens in one step (vLLM's max_num_batched_tokens), >= 1.
        max_seqs: the most running requests, >= 1.
        kv_tokens: KV cache capacity in tokens, >= 1.
        kv_policy: "reserve" or "paged".
        block_size: tokens per KV block; required under "paged".
        watermark: fraction of blocks kept free at admission ("paged"), 0 <= watermark < 1.
        enable_prefix_caching: "paged" only: keep computed prompt blocks for reuse; requests carry
            Request(block_hashes=...) and admission starts each prefill after its longest cached
            prefix (docs/prefix_caching.md). Counters: prefix_cache_queries and prefix_cache_hits
            (tokens, vLLM's meanings), the same for first admissions only
            (prefix_cache_first_queries, prefix_cache_first_hits), num_evictions, num_evictable_blocks.
        kv_manager: None (build the manager kv_policy names), or a stallfree.core.kv.KVManager to ask
            instead, e.g. one delegating to another engine's block allocator (docs/DESIGN.md, "The KV
            manager's contract"); kv_policy and the KV arguments then describe the rules it follows
            (the invariant checker models those), and its kv_total is the scheduler's.

    Raises:
        InvalidConfig: an unknown kv_policy, "paged" without block_size, a watermark out of range, an
            argument that is not an integer >= 1, or an option out of range; the message names it.
    """

    _live: dict[Hashable, LiveRequest]
    _prefilling: LiveRequest | None
    _kv: KVManager

    def __init__(
        self,
        token_budget: int,
        max_seqs: int,
        kv_tokens: int,
        *,
        kv_policy: str = "reserve",
        block_size: int | None = None,
        watermark: float = 0.01,
        align_chunks: bool | None = None,
        policy: str = "fcfs",
        aging_interval: float | None = None,
        clock: Callable[[], float] | None = None,
        decode_overflow: str = "oldest",
        num_spec_tokens: int = 0,
        enable_prefix_caching: bool = False,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int | None = None,
        long_prefill_token_threshold: int | None = None,
        kv_manager: KVManager | None = None,
    ) -> None:
        self.token_budget = check_positive_int("token_budget", token_budget)
        self.max_seqs = check_positive_int("max_seqs", max_seqs)
        check_positive_int("kv_tokens", kv_tokens)
        self.align_chunks, self.watermark = check_kv_options(
            kv_policy, block_size, align_chunks, watermark, enable_prefix_caching)
        self.kv_policy = kv_policy
        self.enable_prefix_caching = enable_prefix_caching
        self._chunking, self.policy, self._selection = build_policies(
            block_size if self.align_chunks else None, policy, aging_interval, clock, decode_overflow, num_spec_tokens
        )
        self.block_size = block_size
        self.max_num_partial_prefills, self.max_long_partial_prefills, self.long_prefill_token_threshold = (
            check_partial_prefills(
                max_num_partial_prefills, max_long_partial_prefills, long_prefill_token_threshold,
                block_size if self.align_chunks else None,
            )
        )
        self._multi = self.max_num_partial_prefills > 1
        self._prefill: PrefillRule = OnePartialPrefill()
        if self._multi:
            assert self.long_prefill_token_threshold is not None
            self._prefill = PartialPrefills(
                self.max_num_partial_prefills, self.max_long_partial_prefills, self.long_prefill_token_threshold)
        self._partials: list[LiveRequest] = []  # K > 1: the prompts in prefill, admission order
        if block_size is not None and (
            kv_tokens < block_size or (self.align_chunks and token_budget < block_size)
        ):
            raise InvalidConfig(
                f"token_budget ({token_budget}) and kv_tokens ({kv_tokens}) must be >= block_size ({block_size})"
            )
        self.aging_interval = aging_interval
        self.clock = clock
        self._now = 0.0  # the clock's reading for the step being planned, seconds
        self.decode_overflow = decode_overflow
        self.num_spec_tokens = num_spec_tokens
        kv = build_kv_manager(kv_policy, kv_tokens, block_size, watermark, enable_prefix_caching)
        if kv_policy == "paged":
            self.num_blocks = kv_tokens // block_size  # type: ignore[operator]
            self.watermark_blocks = math.floor(self.watermark * self.num_blocks)
        self._kv = kv if kv_manager is None else kv_manager
        self.kv_total = self._kv.kv_total
        # A manager with a second KV tier (core/kv_tier.py) hands over each step's copies.
        self._kv_transfers = getattr(self._kv, "step_transfers", None)
        self._init_lifecycle()
        self._decodes = DecodeSet()
        self._due = self._decodes.due
        self._waiting: WaitingQueue = FCFSQueue() if policy == "fcfs" else PriorityQueue(self.priority_key)
        self._seq = 0
        self._admit_seq = 0
        self._skipped: list[LiveRequest] = []
        #: Preemptions so far, over all requests (always 0 under "reserve").
        self.num_preemptions = 0
        #: Prefill tokens scheduled in episodes after a preemption (prompt + generated, recomputed).
        self.num_recomputed_tokens = 0

    @property
    def prefix_cache_queries(self) -> int:
        """Prefix caching: tokens looked up at admissions (each episode's prefill), as vLLM counts its
        prefix cache queries; 0 without caching."""
        return self._kv.prefix_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prefix caching: of prefix_cache_queries, the tokens found cached; 0 without caching."""
        return self._kv.prefix_stats.hits

    @property
    def prefix_cache_first_queries(self) -> int:
        """prefix_cache_queries at first admissions only (no recompute after a preemption)."""
        return self._kv.prefix_stats.first_queries

    @property
    def prefix_cache_first_hits(self) -> int:
        """prefix_cache_hits at first admissions only."""
        return self._kv.prefix_stats.first_hits

    # ------------------------------------------------------------------ public state

    @property
    def kv_free(self) -> int:
        """Free (unreserved, or in free blocks) KV capacity, in tokens."""
        return self._kv.kv_free

    @property
    def now(self) -> float:
        """The clock's reading for the step being planned (or last planned), seconds; 0.0 without a clock."""
        return self._now

    @property
    def kv_manager(self) -> KVManager:
        """The KV manager this scheduler asks (its own, or the one given as kv_manager=); for
        checkers, reports and the engine, which read a manager's own extras (a CPU tier's)."""
        return self._kv

    @property
    def prefix_cache(self) -> PrefixCacheView | None:
        """A read-only view of the prefix cache (block hashes, reference counts, the eviction order),
        for checkers and tests; None without caching."""
        return self._kv.cache_view()

    @property
    def decode_load(self) -> tuple[int, int]:
        """(ready decodes, sum of their context lengths in tokens) for the step schedule() plans next.

        A decode's context is the tokens already in its KV cache (its entry's `start`). Without
        decode overflow or preemption, the next plan's num_decodes and decode_context_sum equal
        these. O(1) unless some decodes moved irregularly in the last step (then O(decodes), the
        work the next schedule() would do anyway).
        """
        dec = self._decodes
        return len(dec), dec.context_sum(self._step)

    @property
    def num_free_blocks(self) -> int:
        """KV blocks free (paged), or free reservation units (reserve: tokens, or blocks of block_size)."""
        return self._kv.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held (paged), or reserved units (reserve); evictable cached blocks are not held."""
        return self._kv.num_used_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Prefix caching: cached blocks held by no request (counted in num_free_blocks); else 0."""
        return self._kv.num_evictable_blocks

    @property
    def num_evictions(self) -> int:
        """Prefix caching: cached blocks evicted (handed out again) so far; else 0."""
        return self._kv.num_evictions

    def cached_prefix_len(self, request: Request) -> int:
        """Prefix caching: tokens of `request`'s prompt whose KV blocks are cached now, capped as admission
        caps a hit (at most prompt_len - 1 tokens, in whole blocks); 0 without caching or block_hashes.

        A pure query, O(blocks of the prompt): nothing is pinned and no block's recency changes, so a
        router may ask every replica (stallfree.sim.cluster's prefix-affinity router does).
        """
        return self._kv.cached_prefix_len(request)

    def num_cached_tokens(self, rid: Hashable) -> int:
        """Prefix caching: prompt tokens of live request `rid` found cached at its first admission
        (0 before it, or without caching); what the OpenAI API reports as cached_tokens.

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live.get(rid)
        if obj is None:
            raise KeyError(f"no live request with rid {rid!r}")
        return obj.num_cached_tokens

    @property
    def block_table(self) -> Callable[[Hashable], tuple[int, ...]] | None:
        """A function rid -> the block ids of a live request, in token order, covering the tokens in
        its KV plus those of the plan in flight (empty while it waits; KeyError if `rid` is not
        live). Under both KV policies when the scheduler has a block_size ("reserve" hands the ids
        out of each request's reservation when its table is read); None under "reserve" without a
        block_size, which counts tokens, not blocks."""
        return self._block_table if self._kv.has_block_ids else None

    def _block_table(self, rid: Hashable) -> tuple[int, ...]:
        obj = self._live.get(rid)
        if obj is None:
            raise KeyError(f"no live request with rid {rid!r}")
        return self._kv.block_table(obj, self._table_tokens(obj))

    def _table_tokens(self, obj: LiveRequest) -> int:
        """The tokens `obj`'s table must hold: those in its KV, plus those of the plan in flight (a
        decode's 1, or its speculative tokens; a chunk's). O(1) for a decode without speculation,
        else O(prefills in the plan), or O(decodes) for a decode under speculation."""
        plan = self._inflight
        if obj.finish_step >= 0:  # decoding: its entry of this step starts at offset + step
            tokens = obj.offset + self._step
            if plan is not None and obj not in self._skipped:
                costs = plan._decode_tokens
                tokens += 1 if costs is None else costs[plan.decode_rids.index(obj.rid)]
            return tokens
        if plan is not None:
            for c in plan.prefills:
                if c.rid == obj.rid:
                    return c.start + c.num_tokens
        return obj.num_prefilled

    def _runs_in_flight(self, obj: LiveRequest) -> bool:
        """A plan is in flight and `obj` is not a decode it skipped (whose KV does not grow in it)."""
        return self._inflight is not None and obj not in self._skipped

    def free_block_ids(self) -> tuple[int, ...]:
        """The ids of the blocks in no table, after giving every table its promised blocks (under
        "reserve", the unclaimed parts of reservations are listed too). O(num_blocks + live
        requests); meant for checkers and tests."""
        for rid in self._live:
            self._block_table(rid)
        return self._kv.free_block_ids()

    def blocks_needed(self, req: Request) -> int:
        """The most blocks `req` ever holds: paged, ceil((prompt_len + max_new - 1) / block_size);
        reserve, the units of its reservation."""
        return self._kv.blocks_needed(req)

    def kv_needed(self, req: Request) -> int:
        """The most KV `req` holds, in tokens: reserve, its reservation (whole blocks with block_size);
        paged, blocks_needed x block_size."""
        return self._kv.kv_needed_for(req)

    def priority_key(self, obj: LiveRequest) -> tuple[float, int]:
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
                budget; raised to block_size when chunks are aligned); None: the configured budget.

        Returns:
            The StepPlan of step `self.step`; `plan.preempted` lists the requests preempted in it
            (in arrival order). Empty when nothing can run.

        Raises:
            SchedulerStateError: the previous plan has not been completed, or `clock` returned
                something other than a finite number (nothing changes).
            InvalidConfig: token_budget is not an integer from 1 to the configured budget.
        """
        if self._inflight is not None:
            raise SchedulerStateError(f"schedule() called twice: step {self._inflight.step} was not completed")
        budget = self.token_budget if token_budget is None else self._step_budget(token_budget)
        if self.clock is not None:
            # One reading per step, checked before anything changes.
            now = self.clock()
            if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
                raise SchedulerStateError(f"clock() must return a finite number of seconds, got {now!r}")
            self._now = float(now)
        step = self._step
        victims: list[LiveRequest] = []
        decode_rids, decode_offsets, decode_tokens, used = self._schedule_decodes(budget, step, victims)
        prefills: list[ScheduledChunk] = []
        admitted = self._prefill.plan(self, StepBudget(budget - used), prefills, victims, used > 0)
        if victims:
            self._requeue(victims)
        dec = self._decodes
        # The shared tuple is fresh (tuples() ran in this step), so its sum is kept incrementally.
        ctx = dec._offset_sum if decode_offsets is dec._offsets_t else sum(decode_offsets)
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
        )
        if self._kv_transfers is not None:
            plan.kv_offloads, plan.kv_loads = self._kv_transfers()
        self._inflight = plan
        return plan

    def _step_budget(self, token_budget: int) -> int:
        check_positive_int("token_budget", token_budget)
        if token_budget > self.token_budget:
            raise InvalidConfig(
                f"token_budget for one step ({token_budget}) exceeds the configured token_budget ({self.token_budget})"
            )
        return max(token_budget, self.block_size or 1) if self.align_chunks else token_budget

    def _schedule_decodes(self, budget: int, step: int, victims: list[LiveRequest]) -> _Decodes:
        """Contract step 1: one entry per ready decode, oldest admitted first, up to the budget;
        under "paged", each with the blocks of its tokens (preempting when there are none)."""
        dec = self._decodes
        if self._skipped:
            self._skipped = []
        k = self.num_spec_tokens
        if not k and len(dec.recs) <= budget:
            short = self._kv.promise_decode_blocks(step)
            if short:
                # In decode order, as _with_blocks and the checker: with K > 1 prompts may finish
                # out of admission order, so the decode list is then not in admission order.
                order: Callable[[LiveRequest], int] = _by_admission
                if self._multi:
                    pos = {id(o): i for i, o in enumerate(dec.recs)}
                    order = lambda o: pos[id(o)]  # noqa: E731
                for obj in sorted(short, key=order):
                    if obj.status is _DECODING:  # not a victim of an older decode in this loop
                        self._grow(obj, obj.offset + step + 1, step, victims)
        if dec._stale or dec._dirty:
            rids, offsets = dec.tuples()
        else:
            rids, offsets = dec._rids_t, dec._offsets_t
        n = len(rids)
        if k:
            # The verification pass never goes past max_new, and a decode never costs more than the budget.
            costs, total = self._spec_costs(min(k, budget - 1), step)
            if total > budget:
                return self._with_blocks(*self._overflow(costs, budget), step, victims)
            return self._with_blocks(rids, offsets, costs, total, step, victims)
        if n <= budget:
            return rids, offsets, None, n
        return self._with_blocks(*self._overflow((1,) * n, budget), step, victims)

    def _with_blocks(
        self, rids: tuple[Hashable, ...], offsets: tuple[int, ...], costs: tuple[int, ...] | None, total: int,
        step: int, victims: list[LiveRequest],
    ) -> _Decodes:
        """When decodes did not all get one token: each chosen decode, oldest first, gets the KV of its
        tokens, preempting as needed; victims leave the plan."""
        live = self._live
        tokens = costs or (1,) * len(rids)
        for rid, off, c in zip(rids, offsets, tokens, strict=True):
            obj = live[rid]
            if obj.status is _DECODING:
                self._grow(obj, off + step + c, step, victims)
        if not victims:
            return rids, offsets, costs, total
        keep = [i for i, rid in enumerate(rids) if live[rid].status is _DECODING]
        rids = tuple(rids[i] for i in keep)
        offsets = tuple(offsets[i] for i in keep)
        kept = tuple(tokens[i] for i in keep)
        return rids, offsets, kept if costs else None, sum(kept)

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
        running = self._decodes.recs + (
            self._partials if self._multi else [self._prefilling] if self._prefilling is not None else [])
        return self._victim(obj, running)

    def _victim(self, obj: LiveRequest, running: list[LiveRequest]) -> LiveRequest:
        """The one victim rule: among `running` those admitted after `obj`, the newest (fcfs) or the
        least urgent, newest first among equals (priority); `obj` itself when there is none. So the
        oldest running request is never a victim and every run ends."""
        later = [o for o in running if o.admit_seq > obj.admit_seq]
        if not later:
            return obj
        if self.policy != "priority":
            return max(later, key=_by_admission)
        return max(later, key=lambda o: (self.priority_key(o)[0], o.admit_seq))

    def _spec_costs(self, spec: int, step: int) -> tuple[tuple[int, ...], int]:
        """Per-decode tokens with speculation: 1 + min(spec, finish_step - step), found through the
        finish-step index (a copy plus a lookup per decode due within `spec` steps)."""
        dec = self._decodes
        n = len(dec)
        short: dict[int, tuple[LiveRequest, int]] = {}
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
            costs[position_of(dec.recs, obj)] = 1 + d
            total -= spec - d
        return tuple(costs), total

    def _overflow(
        self, costs: tuple[int, ...], budget: int
    ) -> tuple[tuple[Hashable, ...], tuple[int, ...], tuple[int, ...] | None, int]:
        """Ready decodes exceed the budget: the selection hook picks who runs; the rest skip a step."""
        recs = self._decodes.recs
        order = None
        if self.policy == "priority":
            order = sorted(range(len(costs)), key=lambda i: self.priority_key(recs[i]))
        chosen = self._selection.select(costs, budget, order)
        picked = set(chosen)
        self._skipped = [o for i, o in enumerate(recs) if i not in picked]
        rids, offsets = self._decodes.offsets_at(chosen)
        tokens = tuple(costs[i] for i in chosen)
        return rids, offsets, tokens if self.num_spec_tokens else None, sum(tokens)

    def _kv_admits(self, obj: LiveRequest, first_chunk: int, hits: Sequence[int]) -> bool:
        """Whether the KV manager admits `obj` with a first chunk of `first_chunk` tokens after its cached
        prefix `hits` (the handle of its lookup)."""
        return self._kv.can_admit(obj, first_chunk, self._num_running, hits)

    def _take_in(self, obj: LiveRequest, first_chunk: int, hits: Sequence[int], start: int) -> None:
        """Admit `obj` (already out of the queue): its KV (the cached prefix `hits` kept, the prefill
        starting at token `start`), its status and admission order."""
        self._kv.admit(obj, first_chunk, hits)
        obj.num_prefilled = start
        self._num_running += 1
        obj.status = _PREFILLING
        obj.admit_seq = self._admit_seq
        self._admit_seq += 1
        if obj.admitted_step is None:
            obj.admitted_step = self._step

    def _count_recomputed(self, out: list[ScheduledChunk]) -> None:
        """Count the chunks of requests in a recompute episode (after a preemption) as recomputed."""
        live = self._live
        for c in out:
            if live[c.rid].num_preemptions:
                self.num_recomputed_tokens += c.num_tokens

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
        self.num_preemptions += 1
        victims.append(obj)
        if obj in self._skipped:
            self._skipped.remove(obj)

    def _requeue(self, victims: list[LiveRequest]) -> None:
        """Victims go back to the queue: FCFS, in front of every never-started request, oldest first."""
        if isinstance(self._waiting, FCFSQueue):
            self._waiting.push_front(sorted(victims, key=_by_seq))
        else:
            for obj in victims:
                self._waiting.append(obj)

    def _before_apply(self, plan: StepPlan, accepted: list[tuple[LiveRequest, int]]) -> int:
        """Move the derived progress of skipped decodes back a step and of multi-token decodes forward."""
        self._decodes.clock = self._step
        kv = self._kv
        live = self._live
        # A block is reusable (prefix caching) as soon as the chunk that fills it completes.
        for chunk in plan.prefills:
            kv.filled(live[chunk.rid], chunk.start, chunk.start + chunk.num_tokens)
        if self._skipped or accepted:
            shifts = [(o, -1) for o in self._skipped] + [(o, n - 1) for o, n in accepted]
            for obj, delta in shifts:
                self._decodes.shift(obj, delta)
                kv.moved(obj, self._step)
            self._skipped = []
        if plan._decode_tokens:
            # Rejected speculative tokens: their KV goes back.
            for rid, c in zip(plan.decode_rids, plan._decode_tokens, strict=True):
                if c > 1:
                    obj = live[rid]
                    kv.trim(obj, obj.offset + self._step)
        return plan.step

    # ------------------------------------------------------------------ lifecycle hooks

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
        if obj.finish_step >= 0:
            self._decodes.leave(obj)
        elif self._prefilling is obj:
            self._prefilling = None
        if self._multi and obj in self._partials:
            self._partials.remove(obj)
        self._num_running -= 1

    def _validate_accepted(
        self, plan: StepPlan, num_accepted: Mapping[Hashable, int]
    ) -> list[tuple[LiveRequest, int]]:
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

    def _decoded_in(self, obj: LiveRequest, plan: StepPlan) -> bool:
        return (
            obj.status is _DECODING
            and 0 <= obj.decode_step < plan.step
            and obj not in self._skipped
        )

    def _first_token(self, obj: LiveRequest, step: int) -> None:
        """The last chunk of an episode sampled token gen0 + 1: finish, or start decoding."""
        if obj.first_token_step is None:
            obj.first_token_step = step
        if self._multi:
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


class PagedScheduler(Scheduler):
    """Scheduler(kv_policy="paged") built from a block count: the constructor kept from before the
    KV policy became an option of Scheduler; same class, same behaviour.

    Args:
        token_budget: the most tokens in one step, >= 1.
        max_seqs: the most running requests, >= 1.
        num_blocks: KV blocks in the cache, >= 1 (kv_tokens = num_blocks x block_size).
        block_size: tokens per KV block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.
        **options: any option keyword of Scheduler (policy=, num_spec_tokens=, align_chunks=, ...).

    Raises:
        InvalidConfig: an argument is out of range or of the wrong type; the message names it.
    """

    def __init__(
        self,
        token_budget: int,
        max_seqs: int,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        **options: object,
    ) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        super().__init__(
            token_budget, max_seqs, num_blocks * block_size, kv_policy="paged", block_size=block_size,
            watermark=watermark, **options,  # type: ignore[arg-type]
        )
