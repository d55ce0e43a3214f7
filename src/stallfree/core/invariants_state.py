"""The invariant checker's shadow state (CheckerState) and InvariantViolation. They sit below the
checker (core/invariants.py) and its rule families (core/invariants_kv.py, invariants_cache.py,
invariants_multi.py), which all work on this state, so that no rule module imports the checker.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from stallfree.core.errors import StallfreeError
from stallfree.core.plan import StepPlan
from stallfree.core.request import Request
from stallfree.core.scheduler import Scheduler

__all__ = ["CheckerState", "InvariantViolation"]


class InvariantViolation(StallfreeError, AssertionError):
    """The scheduler broke a contract invariant; the message names the step, rule and values."""


@dataclass(slots=True)
class _Shadow:
    req: Request
    order: int  # position in add() order
    add_step: int
    running: bool = False
    prefilled: int = 0  # in the current episode
    target: int = 0  # tokens the current episode prefills: prompt_len + tokens generated before it
    generated: int = 0  # over all episodes
    episode_decodes: int = 0
    blocks: int = 0  # paged
    hit: int = 0  # prefix caching: blocks of the current episode found cached at admission
    preemptions: int = 0
    emitted: int = 0  # times the rid appeared in complete()'s return value
    limit: int = 0  # tokens after which it ends: max_new, or what stop_after() said
    unsettled: list[int] = field(default_factory=list)  # drafts counted provisionally, per step, oldest first
    drafted: int = 0  # accepted draft tokens (provisional ones included), over all episodes
    episode_drafted: int = 0  # the same in the current episode
    lora_passes: int = 0  # steps a later request was admitted past it while its adapter could not join

    @property
    def held(self) -> bool:
        """At its last token through drafts still to settle: not scheduled until take_back()."""
        return bool(self.unsettled) and self.generated >= self.limit

    @property
    def computed(self) -> int:
        """Tokens whose KV is in the cache."""
        if self.prefilled < self.target:
            return self.prefilled
        return self.req.prompt_len + self.generated - 1


@dataclass(slots=True)
class CheckerState:
    """The invariant checker's shadow state and the helpers every rule family shares; InvariantChecker
    is its one subclass, and its docstring gives the fields."""


    scheduler: Scheduler
    table_every: int = 1
    num_steps: int = 0
    num_requests: int = 0
    num_preemptions: int = 0
    max_preemptions_of_one: int = 0
    num_recomputed_tokens: int = 0
    max_lora_passes_of_one: int = 0
    _reqs: dict[Hashable, _Shadow] = field(default_factory=dict)
    _waiting: list[Hashable] = field(default_factory=list)
    _running: list[Hashable] = field(default_factory=list)  # admission order of the current episodes
    _ready: list[Hashable] = field(default_factory=list)  # decodes in batch order
    _partial: Hashable | None = None
    _plan: StepPlan | None = None
    _aborted_in_flight: set[Hashable] = field(default_factory=set)
    _drafts: dict[Hashable, int] = field(default_factory=dict)  # draft tokens set for the next step, by decode
    _calls: int = 0
    # Prefix caching: the state before the step being planned (free blocks, evictable ids, tables).
    _pre_free: int = 0
    _pre_evictable: set[int] = field(default_factory=set)
    _pre_tables: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)
    # The checker's own view of the cache through the step: the evictable blocks before it in eviction
    # order (and their hashes), free-and-empty blocks left, the blocks its model evicted so far (and
    # hash -> block for them), and the blocks pinned so far.
    _view: dict[Hashable, int] | None = None
    _evq: list[int] = field(default_factory=list)
    _evq_hashes: list[Hashable] = field(default_factory=list)
    _evq_pos: int = 0
    _raw: int = 0
    _evicted: set[int] = field(default_factory=set)
    _pinned: set[int] = field(default_factory=set)
    # The step's options: whether it may admit, and the chunk cap's answers by (rid, start, n) (None: no cap).
    _admitting: bool = True
    # The rids the step's admission filter refused (schedule(admit=callable)); admission passes over them.
    _refused: frozenset[Hashable] = frozenset()
    _caps: dict[tuple[Hashable, int, int], int] | None = None
    _front_order: int = -1  # add order of the next add(front=True): counts down
    # fairness="vtc": the shadow's virtual token counters and tokens served, by tenant.
    _service: dict[str, float] = field(default_factory=dict)
    _served: dict[str, int] = field(default_factory=dict)
    _prefill_start: tuple[int, int] = (0, 0)  # this step's decode tokens and budget for prompt chunks
    # fairness="vtc" with tenant_chunk_tokens: a set-aside head took the step alone (the partial prefill waits).
    _partial_waits: bool = False

    def _fail(self, rule: str, detail: str) -> None:
        raise InvariantViolation(f"step {self.scheduler.step}: {rule}: {detail}")

    @property
    def _paged(self) -> bool:
        return self.scheduler.config.kv_policy == "paged"

    @property
    def _caching(self) -> bool:
        return self.scheduler.config.enable_prefix_caching

    def _blocks(self, tokens: int) -> int:
        bs = self.scheduler.config.block_size or 1
        return (tokens + bs - 1) // bs

    def _chunk(self, rest: int, left: int) -> int:
        if rest <= left:
            return rest
        s = self.scheduler
        b = s.config.block_size if s.config.chunks_aligned else None
        return max(left - left % b, 0) if b else max(left, 0)

    def _capped(self, rid: Hashable, start: int, n: int) -> int:
        """The chunk of `n` tokens (>= 1) from `start` under the step's cap: the answer the scheduler got for
        exactly this chunk (it must have asked), rounded down to a block boundary when chunks are aligned
        and the answer is short of n."""
        caps = self._caps
        if caps is None:
            return n
        m = caps.get((rid, start, n))
        if m is None:
            self._fail("chunk cap asked", f"rid {rid!r}: a chunk of {n} tokens from {start} was not offered to "
                       f"chunk_cap (asked: {sorted((k, v) for k, v in caps.items() if k[0] == rid)})")
            return n
        s = self.scheduler
        b = s.config.block_size if s.config.chunks_aligned else None
        if b and m < n:
            m = max(m - (start + m) % b, 0)
        return m

    def _key(self, rid: Hashable) -> tuple[float, ...]:
        s = self.scheduler
        sh = self._reqs[rid]
        if s.config.policy != "priority":
            return (0, sh.order)
        prio = sh.req.priority
        if s.config.aging_interval is not None:
            # The clock's reading for the step, as the scheduler's own priority key reads it.
            waited = s.stats().now - sh.req.arrival if s.config.clock is not None else s.step - sh.add_step
            prio = prio - math.floor(waited / s.config.aging_interval)
        return (prio, sh.req.arrival, sh.order) if s.config.priority_ties == "arrival" else (prio, sh.order)

    def _queue_order(self) -> list[Hashable]:
        """The waiting rids admission tries in this step, in queue order (those the filter refused left out).
        FCFS: preempted requests and those queued with add(front=True) first, then add order (under strict
        admission in queue order this is add order; an admission filter may let a request be admitted, and
        preempted, past an older one it refused)."""
        if self.scheduler.config.policy != "priority":
            reqs = self._reqs
            order = sorted(self._waiting, key=lambda r: (not (reqs[r].preemptions or reqs[r].order < 0), reqs[r].order))
        else:
            order = sorted(self._waiting, key=self._key)
        return [r for r in order if r not in self._refused] if self._refused else order

    def _lora_rule(self, rid: Hashable) -> str:
        """Admission's LoRA rule for waiting `rid` at its place in the step (core/lora.py): "join" (no
        adapter, its adapter running, or fewer than max_loras running: the usual checks follow), "pass"
        (passed over; it keeps its place) or "stop" (passed max_lora_passes times already: admission stops)."""
        cfg = self.scheduler.config
        sh = self._reqs[rid]
        lora = sh.req.lora
        if cfg.max_loras is None or lora is None:
            return "join"
        reqs = self._reqs
        running = {reqs[r].req.lora for r in self._running} - {None}
        if lora in running or len(running) < cfg.max_loras:
            return "join"
        return "pass" if sh.lora_passes < cfg.max_lora_passes else "stop"

    def _lora_passed(self, passed: list[Hashable]) -> list[Hashable]:
        """A request was admitted past the rids in `passed`: one pass each; returns a fresh empty list."""
        for rid in passed:
            sh = self._reqs[rid]
            sh.lora_passes += 1
            self.max_lora_passes_of_one = max(self.max_lora_passes_of_one, sh.lora_passes)
        return []

    def _admission_order(self) -> Iterator[Hashable]:
        """The waiting rids admission tries in this step, one at a time (InvariantChecker's: fairness="vtc"
        works each pick out when asked)."""
        return iter(self._queue_order())

    def _victim_for(self, rid: Hashable) -> Hashable:
        """Paged: the victim when `rid` needs a block and none is free."""
        later = self._running[self._running.index(rid) + 1:]
        if not later:
            return rid
        if self.scheduler.config.policy != "priority":
            return later[-1]
        return max(later, key=lambda r: (self._key(r)[0], self._running.index(r)))

    def _preempt(self, rid: Hashable, victims: list[Hashable]) -> None:
        """Preempt `rid` in the shadow, appending it to `victims` (InvariantChecker's)."""
        raise NotImplementedError

    def _admit_shadow(
        self, rid: Hashable, sh: _Shadow, hits: list[int], start: int, n: int, free: int, reserved: int,
        pinned: set[int],
    ) -> tuple[bool, int, int]:
        """Admit `rid` into the shadow if the KV allows (InvariantChecker's)."""
        raise NotImplementedError
