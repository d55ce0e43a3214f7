"""The invariant checker's rules for a CPU KV tier (stallfree.core.kv_tier.TieredKV): a hash is in at
most one tier; each step's loads are the CPU-tier hits of its admissions (the longest prefix across both
tiers, worked out by the checker's own model of both tiers), never more than the free GPU blocks, and
never of a block that is not cached; each step's offloads are the GPU blocks it evicted, in eviction
order, the CPU tier dropping its least recently stored block when full; counts per tier add up.

Imports allowed: the standard library and stallfree.core only.

The model of the step: the CPU tier as it was before schedule() (its hashes, least recently stored
first), into which the GPU blocks the checker's eviction model (core/invariants_cache.py) evicts are
stored, and out of which the CPU hits of each admission are taken. Checked with one partial prefill
(max_num_partial_prefills=1); under several the rules of a step without admissions still hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from stallfree.core.invariants import InvariantChecker
from stallfree.core.invariants_cache import CacheRules, peek_table
from stallfree.core.invariants_fair import FairRules
from stallfree.core.invariants_state import _Shadow
from stallfree.core.kv.tier import TieredBlockPool, TieredKV
from stallfree.core.plan import StepPlan

__all__ = ["TieredInvariantChecker"]


@dataclass(slots=True)
class _TierModel:
    """The CPU tier through the step being planned, in the checker's own terms."""

    lru: OrderedDict[Hashable, int | None] = field(default_factory=OrderedDict)  # hash -> CPU id (None: stored now)
    busy: int = 0  # CPU blocks read by the loads of this step
    synced: int = 0  # positions of the evictable queue already stored
    offloads: list[int] = field(default_factory=list)  # GPU blocks stored, in order
    evicted_hash: dict[int, Hashable] = field(default_factory=dict)  # GPU block -> the hash it evicted now
    loads: list[tuple[Hashable, int | None, int]] = field(default_factory=list)  # (hash, CPU id, table pos)
    load_rids: list[Hashable] = field(default_factory=list)
    loaded: set[Hashable] = field(default_factory=set)
    decode_blocks: dict[Hashable, int] = field(default_factory=dict)  # decodes' blocks before the step
    pre_cpu: dict[Hashable, int] = field(default_factory=dict)


@dataclass(slots=True)
class TieredInvariantChecker(InvariantChecker):
    """InvariantChecker for a Scheduler whose kv_manager is a TieredKV, with the tier's rules (module
    docstring) after every call.

    Raises:
        InvariantViolation: from any call, when the scheduler broke a rule; the message names it.
        TypeError: the scheduler's kv_manager is not a TieredKV.
    """

    _tier: _TierModel = field(default_factory=_TierModel)

    def __post_init__(self) -> None:
        if not isinstance(self.scheduler.kv_manager, TieredKV):
            raise TypeError(f"TieredInvariantChecker needs a TieredKV manager, got "
                            f"{type(self.scheduler.kv_manager).__name__}")
        if self.scheduler.config.max_num_partial_prefills != 1:
            raise ValueError(f"TieredInvariantChecker models one partial prefill, got max_num_partial_prefills="
                             f"{self.scheduler.config.max_num_partial_prefills}")

    @property
    def _kv(self) -> TieredKV:
        kv = self.scheduler.kv_manager
        assert isinstance(kv, TieredKV)
        return kv

    # ------------------------------------------------------------------ the step

    def schedule(
        self, token_budget: int | None = None, *, admit: bool | Callable[[Hashable], bool] = True,
        chunk_cap: Callable[[Hashable, int, int], int] | None = None,
    ) -> StepPlan:
        """Snapshot the CPU tier, forward schedule() (the base checker's rules) and check the tier's."""
        cpu = self._kv.tier_view().block_of
        self._tier = _TierModel(lru=OrderedDict(cpu.items()), pre_cpu=dict(cpu))
        self._tier.decode_blocks = {rid: self._reqs[rid].blocks for rid in self._ready}
        plan = super(TieredInvariantChecker, self).schedule(token_budget, admit=admit, chunk_cap=chunk_cap)
        self._check_transfers(plan)
        return plan

    def _store(self, gpu_block: int, block_hash: Hashable) -> None:
        """The model's offload of an evicted GPU block (CpuTier.store's rule)."""
        m = self._tier
        nb = self._kv.cpu_blocks
        m.evicted_hash[gpu_block] = block_hash
        if len(m.lru) + m.busy < nb:
            m.lru[block_hash] = None
        elif m.lru:
            m.lru.popitem(last=False)
            m.lru[block_hash] = None
        else:
            return
        m.offloads.append(gpu_block)

    def _sync(self) -> None:
        """Store the blocks the eviction model evicted since the last call, in eviction order."""
        m = self._tier
        for pos in range(m.synced, self._evq_pos):
            b = self._evq[pos]
            if b in self._evicted:
                self._store(b, self._evq_hashes[pos])
        m.synced = self._evq_pos

    def _tier_hits(self, sh: _Shadow) -> list[tuple[bool, int, Hashable]]:
        """(on the GPU, block, hash) of each block of the longest prefix cached across both tiers at
        this point of the step, in the model's terms; a block loaded earlier in the step is ~block
        (held, so pinning it takes nothing from the free count)."""
        s = self.scheduler
        cache = s.prefix_cache
        assert cache is not None and self._plan is not None
        m = self._tier
        if self._view is None:
            lost = CacheRules.lost(self)
            self._view = dict(zip(map(self._evq_hashes.__getitem__, lost), map(self._evq.__getitem__, lost),
                                  strict=True))
        # Hashes the plan says it loads: on the GPU after the step, not yet before their load.
        later = {cache.hash_of.get(g) for _, g in self._plan.kv_loads} - m.loaded
        hashes = sh.req.block_hashes or ()
        bs = s.config.block_size or 1
        out: list[tuple[bool, int, Hashable]] = []
        for i in range(min(len(hashes), (sh.req.prompt_len - 1) // bs)):
            h = hashes[i]
            if h in m.loaded:  # loaded earlier in this step: held by its loader, so still there
                g = cache.cached_block(h)
                if g is None:
                    self._fail("a loaded block stays cached in the step", f"hash {h!r} loaded, not on the GPU")
                out.append((True, ~(g or 0), h))
                continue
            b = None if h in later else cache.cached_block(h)
            if b is None:
                b = self._view.get(h)
            if b is not None and b not in self._evicted:
                out.append((True, b, h))
            elif h in m.lru:
                out.append((False, -1, h))
            else:
                break
        return out

    def _admissions(self, left: int, free: int, chunks: list[tuple[Hashable, int, int, bool]]) -> list[Hashable]:
        """InvariantChecker._admissions with hits across both tiers, then the evictions that cover the
        decodes' promised blocks (TieredKV.step_transfers)."""
        s = self.scheduler
        admitted: list[Hashable] = []
        fair = self.scheduler.config.fairness == "vtc"
        for rid in self._admission_order():
            self._sync()
            sh = self._reqs[rid]
            hits = self._tier_hits(sh)
            start = len(hits) * (s.config.block_size or 1)
            n = self._chunk(sh.target - start, left)
            if left <= 0 or len(self._running) >= s.config.max_seqs or n == 0:
                break
            fits, free = self._admit_tiered(rid, sh, hits, start, n, free)
            if not fits:
                break
            chunks.append((rid, n, start, n == sh.target - start))
            admitted.append(rid)
            if fair:
                FairRules.charge(self, rid, n)
            left = left - n if n == sh.target - start else 0
        self._sync()
        return admitted

    def _admit_tiered(
        self, rid: Hashable, sh: _Shadow, hits: list[tuple[bool, int, Hashable]], start: int, n: int, free: int,
    ) -> tuple[bool, int]:
        s = self.scheduler
        gpu = [b if b >= 0 else ~b for on_gpu, b, _ in hits if on_gpu]
        pin = sum(1 for on_gpu, b, _ in hits if on_gpu and b >= 0 and b in self._pre_evictable
                  and b not in self._pinned)
        want = (self._blocks(sh.target) if sh.preemptions else self._blocks(start + n)) - len(gpu) + pin
        if want > free or (self._running and free - want < s.stats().watermark_blocks):
            return False, free
        free -= self._blocks(start + n) - len(gpu) + pin
        sh.blocks = self._blocks(start + n)
        sh.hit = len(hits)
        sh.prefilled = start
        self._pinned.update(gpu)
        m = self._tier
        for i, (on_gpu, _, h) in enumerate(hits):
            if not on_gpu:
                m.loads.append((h, m.lru.pop(h), i))
                m.load_rids.append(rid)
                m.loaded.add(h)
                m.busy += 1
        CacheRules.take(self, sh.blocks - len(gpu))
        self._waiting.remove(rid)
        self._running.append(rid)
        sh.running = True
        return True, free

    def _check_transfers(self, plan: StepPlan) -> None:
        """The step's loads and offloads against the model, and the rules that hold in every step."""
        s = self.scheduler
        cache = s.prefix_cache
        assert cache is not None
        m = self._tier
        offloaded = {c for _, c in plan.kv_offloads}
        if len(plan.kv_loads) > self._pre_free:
            self._fail("loads never exceed the free GPU blocks",
                       f"{len(plan.kv_loads)} loads, {self._pre_free} free GPU blocks before the step")
        for c, g in plan.kv_loads:
            if c not in m.pre_cpu.values() and c not in offloaded:
                self._fail("nothing loaded that is not cached", f"CPU block {c} held no hash (load into {g})")
            if cache.hash_of.get(g) is None:
                self._fail("a loaded block is cached on the GPU", f"GPU block {g} (loaded from {c}) has no hash")
        if plan.preempted:
            return  # victims' blocks return mid-step; the model is not followed through a preempting step
        got_off = [g for g, _ in plan.kv_offloads]
        if got_off != m.offloads:
            self._fail("offloads are the evicted GPU blocks, in eviction order",
                       f"got {got_off}, the model evicted {m.offloads}")
        cpu_of = {m.evicted_hash[g]: c for g, c in plan.kv_offloads}
        expected = []
        for (h, cpu, pos), rid in zip(m.loads, m.load_rids, strict=True):
            table = peek_table(s, rid)[0] if s.block_table is not None else ()
            expected.append((cpu_of.get(h, -1) if cpu is None else cpu, table[pos]))
        if list(plan.kv_loads) != expected:
            self._fail("loads are the CPU-tier hits of the admissions",
                       f"got {list(plan.kv_loads)}, the model's {expected}")
        actual = list(self._kv.tier_view().block_of)
        if actual != list(m.lru):
            self._fail("CPU tier LRU (stored in eviction order, least recent dropped)",
                       f"tier holds {actual}, the model {list(m.lru)}")

    def _check_state(self, scheduled: StepPlan | None = None) -> None:
        """The base checker's state rules, then the tier's: one tier per hash, counts per tier."""
        super(TieredInvariantChecker, self)._check_state(scheduled)
        kv = self._kv
        s = self.scheduler
        cache = s.prefix_cache
        assert cache is not None
        view = kv.tier_view()
        cpu = view.block_of
        both = set(cpu).intersection(cache.block_of)
        if both:
            self._fail("a hash in at most one tier", f"hashes {sorted(map(repr, both))} in both")
        free = view.free_ids()
        ids = list(cpu.values()) + list(free)
        if len(ids) != view.num_blocks or set(ids) != set(range(view.num_blocks)):
            self._fail("CPU tier counts: cached + free == cpu_blocks, each block once",
                       f"{len(cpu)} cached, {len(free)} free, {view.num_blocks} blocks")
        st = kv.tier_stats
        ss = s.stats()
        if st.gpu_hits + st.cpu_hits != ss.prefix_cache_hits or (
                st.first_gpu_hits + st.first_cpu_hits != ss.prefix_cache_first_hits):
            self._fail("hits per tier add up", f"GPU {st.gpu_hits} + CPU {st.cpu_hits} != {ss.prefix_cache_hits}")
        pool = kv.cache
        assert isinstance(pool, TieredBlockPool)
        if pool.offloads:
            self._fail("every eviction is in a plan", f"offloads outside schedule(): {pool.offloads}")
