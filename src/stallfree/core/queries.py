"""The scheduler's read-only queries about its KV memory and its configuration, answered by its KV manager.

Imports allowed: the standard library and stallfree.core only.

Scheduler (core/scheduler.py) inherits these; none of them changes scheduling state (reading a block
table gives a decode the ids already promised to it, which counts nothing). They are apart from the
scheduler so that it plans steps without naming a KV policy or prefix caching: every figure here comes
from the KVManager (core/kv/) or the SchedulerConfig (core/config.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from stallfree.core.errors import RequestRejected
from stallfree.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from stallfree.core.config import SchedulerConfig
    from stallfree.core.decode import PlainDecodes
    from stallfree.core.kv import KVManager, PrefixCacheView
    from stallfree.core.live import LiveRequest
    from stallfree.core.plan import StepPlan

__all__ = ["AdmissionQueries", "KVQueries", "SchedulerHeadroom", "SchedulerStats", "peek_block_table",
           "peek_free_block_ids"]


class KVQueries:
    """The KV and prefix-cache figures of a scheduler (a mixin of Scheduler: it reads `config`, `_kv` and
    `_live`, and for the tokens a table must cover the plan in flight, `_inflight`, the decode phase's
    skipped decodes and `_step`)."""

    config: SchedulerConfig
    _kv: KVManager
    _live: dict[Hashable, LiveRequest]
    _inflight: StepPlan | None
    _decode: PlainDecodes
    _step: int

    _live_request: Callable[[Hashable], LiveRequest]  # RequestLifecycle's (an annotation: no attribute here)

    # ------------------------------------------------------------------ KV figures

    @property
    def kv_free(self) -> int:
        """Free (unreserved, or in free blocks) KV capacity, in tokens."""
        return self._kv.kv_free

    @property
    def block_table(self) -> Callable[[Hashable], tuple[int, ...]] | None:
        """A function rid -> the block ids of a live request, in token order, covering the tokens in
        its KV plus those of the plan in flight (empty while it waits; KeyError if `rid` is not
        live). Under both KV policies when the scheduler has a block_size ("reserve" hands the ids
        out of each request's reservation when its table is read); None under "reserve" without a
        block_size, which counts tokens, not blocks."""
        return self._block_table if self._kv.has_block_ids else None

    def _block_table(self, rid: Hashable) -> tuple[int, ...]:
        obj = self._live_request(rid)
        return self._kv.block_table(obj, self._table_tokens(obj))

    def _table_tokens(self, obj: LiveRequest) -> int:
        """The tokens `obj`'s table must hold: those in its KV, plus those of the plan in flight (a
        decode's 1, or its speculative tokens; a chunk's). O(1) for a decode without speculation,
        else O(prefills in the plan), or O(decodes) for a decode under speculation."""
        plan = self._inflight
        if obj.finish_step >= 0:  # decoding: its entry of this step starts at offset + step
            tokens = obj.offset + self._step
            if plan is not None and obj not in self._decode.skipped:
                costs = plan._decode_tokens
                tokens += 1 if costs is None else costs[plan.decode_rids.index(obj.rid)]
            return tokens
        if plan is not None:
            for c in plan.prefills:
                if c.rid == obj.rid:
                    return c.start + c.num_tokens
        return obj.num_prefilled

    def free_block_ids(self) -> tuple[int, ...]:
        """The ids of the blocks in no table, after giving every table its promised blocks (under
        "reserve", the unclaimed parts of reservations are listed too). O(num_blocks + live
        requests); meant for checkers and tests."""
        for rid in self._live:
            self._block_table(rid)
        return self._kv.free_block_ids()

    # ------------------------------------------------------------------ prefix caching

    @property
    def prefix_cache(self) -> PrefixCacheView | None:
        """A read-only view of the prefix cache (block hashes, reference counts, the eviction order),
        for checkers and tests; None without caching."""
        return self._kv.cache_view()

    def cached_prefix_len(self, request: Request) -> int:
        """Prefix caching: tokens of `request`'s prompt whose KV blocks are cached now, capped as admission
        caps a hit (at most prompt_len - 1 tokens, in whole blocks); 0 without caching or block_hashes.

        A pure query, O(blocks of the prompt): nothing is pinned and no block's recency changes, so a
        router may ask every replica (stallfree.sim.run.cluster's prefix-affinity router does; the simulator's
        baselines answer it too, stallfree.sim.run.result.SchedulerLike).
        """
        return self._kv.cached_prefix_len(request)

    def num_cached_tokens(self, rid: Hashable) -> int:
        """Prefix caching: prompt tokens of live request `rid` found cached at its first admission
        (0 before it, or without caching); what the OpenAI API reports as cached_tokens.

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live_request(rid)
        return obj.num_cached_tokens


#: The per-tenant figures of a scheduler without tenants (fairness="fcfs"): empty, shared, read-only.
_NO_TENANTS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of a scheduler's queues, KV memory and counters (Scheduler.stats()).

    Attributes (counts of requests, tokens or blocks as named; counters are totals since construction):
        num_waiting, num_running: requests waiting (never admitted, or preempted) and running.
        kv_total, kv_free: KV capacity and free KV, tokens.
        num_used_blocks, num_free_blocks, num_evictable_blocks: blocks held, free (evictable cached ones
            included) and cached-but-unheld ("reserve": reservation units; 0 evictable).
        num_preemptions: preemptions so far; num_recomputed_tokens: prefill tokens recomputed after them.
        enable_prefix_caching, block_size: the configuration the counters are read under.
        prefix_cache_queries, prefix_cache_hits: tokens looked up at admissions and found cached (vLLM's
            meanings); prefix_cache_first_queries, prefix_cache_first_hits: first admissions only.
        num_evictions: cached blocks evicted so far.
        num_blocks: KV blocks in the cache, kv_total // block_size (tokens without a block_size).
        watermark_blocks: "paged": floor(watermark x num_blocks), the blocks admission keeps free; 0 under
            "reserve".
        now: the clock's reading for the step planned last, seconds; 0.0 without a clock.
        tenant_served_tokens: fairness="vtc": tenant -> tokens planned for its requests so far (prefill
            chunks and decodes, recomputed ones included; unweighted); empty under "fcfs".
        tenant_counters: fairness="vtc": tenant -> its virtual token counter (weighted service with lifts,
            what admission compares; stallfree.core.fairness); empty under "fcfs".
    """

    num_waiting: int
    num_running: int
    kv_total: int
    kv_free: int
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_evictable_blocks: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    enable_prefix_caching: bool = False
    block_size: int | None = None
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_first_queries: int = 0
    prefix_cache_first_hits: int = 0
    num_evictions: int = 0
    num_blocks: int = 0
    watermark_blocks: int = 0
    now: float = 0.0
    tenant_served_tokens: Mapping[str, int] = field(default_factory=lambda: _NO_TENANTS)
    tenant_counters: Mapping[str, float] = field(default_factory=lambda: _NO_TENANTS)


@dataclass(frozen=True, slots=True)
class SchedulerHeadroom:
    """What a scheduler's next step leaves (Scheduler.headroom()): found by planning that step on a copy.

    Attributes:
        will_wait: requests still waiting after it (those added, and those passed to headroom()).
        slots: max_seqs - running after it.
        kv_free: free KV after it, tokens; num_free_blocks: the same in blocks (or reservation units).
        budget_tokens: tokens of its budget it leaves unspent.
        num_tokens: tokens it schedules; num_admitted: requests it admits.
    """

    will_wait: int
    slots: int
    kv_free: int
    num_free_blocks: int
    budget_tokens: int
    num_tokens: int
    num_admitted: int


def _tenant_figures(fair: Any) -> tuple[Mapping[str, int], Mapping[str, float]]:
    """A VTC queue's (served tokens, counters) by tenant, copied; the shared empty mapping without one."""
    if fair is None:
        return _NO_TENANTS, _NO_TENANTS
    return MappingProxyType(dict(fair.served_tokens)), MappingProxyType(dict(fair.service))


class AdmissionQueries:
    """stats(), headroom() and would_wait() of a scheduler (a mixin of Scheduler). headroom and would_wait
    plan the next step on a copy of the scheduler (`snapshot`), so they walk the real admission rule:
    the KV manager's answers, priority order, cached prefixes, partial prefills, preemption."""

    def stats(self) -> SchedulerStats:
        """The queues, KV figures and counters now, as a frozen SchedulerStats; O(1) (O(tenants) under
        fairness="vtc", whose per-tenant figures it copies). The one place a scheduler's figures are read
        (the former properties of the same names are deprecated aliases)."""
        s: Any = self
        kv = s._kv
        ps = kv.prefix_stats
        cfg = s.config
        num_blocks = kv.kv_total // (cfg.block_size or 1)
        wm_blocks = math.floor(float(cfg.watermark) * num_blocks) if cfg.kv_policy == "paged" else 0
        return SchedulerStats(
            s.num_waiting, s.num_running, kv.kv_total, kv.kv_free, kv.num_used_blocks, kv.num_free_blocks,
            kv.num_evictable_blocks, s._num_preemptions, s._num_recomputed_tokens, cfg.enable_prefix_caching,
            cfg.block_size, ps.queries, ps.hits, ps.first_queries, ps.first_hits, kv.num_evictions, num_blocks,
            wm_blocks, s._now, *_tenant_figures(getattr(s, "_fair", None)))

    def snapshot(self) -> Any:
        """A detached copy of the scheduler (its KV manager included), which may be queried or stepped from
        any thread while the original runs; O(live requests + blocks handed out). The remembered finished
        rids are not copied (abort() of one on the copy raises KeyError). Taken while a plan is in flight,
        the copy holds its own copy of that plan in flight, which only it can complete and which is not
        handed out: such a copy answers queries (stats(), request_state(), ...); to step a copy, take it
        between steps (headroom() and would_wait() complete the plan on their own copy first).

        Raises:
            TypeError: the KV manager (one given as kv_manager=) cannot be copied (copy.deepcopy).
        """
        s: Any = self
        return copy.deepcopy(self, {id(s._recent_finished): {}, id(s.last_finished): {}})

    def _next_step(self, requests: Iterable[Request]) -> tuple[Any, StepPlan, list[Hashable]]:
        twin = self.snapshot()
        if twin._inflight is not None:  # the step in flight completes first, as if nothing stopped early
            twin.complete(twin._inflight)
        added = []
        for req in requests:
            try:
                twin.add(req)
            except RequestRejected:
                continue
            added.append(req.rid)
        return twin, twin.schedule(), added

    def headroom(self, requests: Iterable[Request] = ()) -> SchedulerHeadroom:
        """What the next step leaves if `requests` (not yet added) were added now, in this order.

        The step in flight, if any, is taken to complete with no early stop; the clock (policy
        "priority" with clock=) is read once. Requests that add() would refuse are left out.
        Cost: one snapshot and one schedule() on it.

        Raises:
            TypeError: as snapshot().
        """
        twin, plan, _ = self._next_step(requests)
        return SchedulerHeadroom(
            twin.num_waiting, twin.config.max_seqs - twin.num_running, twin.kv_free, twin._kv.num_free_blocks,
            plan.token_budget - plan.num_tokens, plan.num_tokens, len(plan.admitted))

    def would_wait(self, requests: Iterable[Request]) -> int:
        """How many of `requests` (not yet added), added now in this order, would still wait after the next
        step: exact, since the step is planned on a copy by the scheduler's own rules (both KV policies,
        priority, cached prefixes, partial prefills). Requests that add() would refuse are not counted; see
        headroom() for the step in flight and the clock.

        Raises:
            TypeError: as snapshot().
        """
        twin, _, added = self._next_step(requests)
        live = twin._live
        return sum(1 for rid in added if live[rid].status is RequestStatus.WAITING)


# Pure reads of the block tables, for checkers: functions of the scheduler rather than methods, so that
# the Scheduler's face stays the contract's (docs/DESIGN.md section 4), as core/plain_steps.py does.


def peek_block_table(s: KVQueries, rid: Hashable) -> tuple[tuple[int, ...], int]:
    """A pure read of live `rid`'s block table: the ids it holds now, and the blocks it is owed (promised to
    it, ids not handed out yet; under "reserve" negative for the blocks past its tokens, which a read of
    `block_table` would give back). Unlike `s.block_table` it hands out no ids, so a checker that reads
    tables this way leaves every later id, eviction and figure as a run that reads none. A KV manager
    without `peek_table` answers with its block_table and 0.

    Raises:
        KeyError: `rid` is not live.
    """
    obj = s._live_request(rid)
    peek = getattr(s._kv, "peek_table", None)
    if peek is None:
        return s._kv.block_table(obj, s._table_tokens(obj)), 0
    return peek(obj, s._table_tokens(obj))  # type: ignore[no-any-return]


def peek_free_block_ids(s: KVQueries) -> tuple[int, ...]:
    """A pure read of the ids in no table: free-and-empty blocks (those promised to tables and not handed
    out among them) and evictable cached ones. Unlike `s.free_block_ids()` it gives no table its promised
    ids. O(num_blocks)."""
    return s._kv.free_block_ids()
