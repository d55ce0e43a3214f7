"""The KV manager is the scheduler's one seam to KV memory: a manager that delegates to an outside block
allocator (as another engine's block manager would) runs the seeded randomized runs under the checker."""

from __future__ import annotations

import ast
import inspect
import random
from collections import deque
from collections.abc import Sequence

import pytest

from factories import RandomWorkload, drive_randomly
from stallfree import Request, RequestRejected, Scheduler
from stallfree.core import scheduler as scheduler_module
from stallfree.core import scheduler_core as scheduler_core_module
from stallfree.core.invariants import InvariantChecker
from stallfree.core.kv import NO_HIT, NO_TRANSFERS, KVManager, PrefixCacheStats, PrefixCacheView, Transfers
from stallfree.core.live import LiveRequest


class ForeignAllocator:
    """A block allocator the core does not own: first in, first out ids, and its own names."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} blocks asked, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)

    def free_ids(self) -> tuple[int, ...]:
        return tuple(self._free)


class DelegatingKV:
    """A KVManager with the paged rules (blocks on demand, a free-block watermark at admission, a
    preempted request readmitted only with its whole recompute) whose blocks come from a ForeignAllocator.
    No promises, no caching: each decode that needs a block is grown by the scheduler."""

    has_block_ids = True

    def __init__(self, num_blocks: int, block_size: int, watermark: float) -> None:
        self.alloc = ForeignAllocator(num_blocks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)
        self.kv_total = num_blocks * block_size
        self.prefix_stats = PrefixCacheStats()
        self.decodes: dict[object, LiveRequest] = {}

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def kv_free(self) -> int:
        return self.alloc.num_free_blocks() * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.alloc.num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.alloc.num_free_blocks()

    num_evictable_blocks = 0
    num_evictions = 0

    def check_fits(self, req: Request) -> int:
        if req.block_hashes is not None:
            raise RequestRejected(f"request {req.rid!r}: block_hashes, but this manager caches nothing")
        if self.blocks_needed(req) > self.num_blocks:
            raise RequestRejected(f"request {req.rid!r} can never fit: {self.blocks_needed(req)} blocks")
        return 0

    def kv_needed_for(self, req: Request) -> int:
        return self.blocks_needed(req) * self.block_size

    def blocks_needed(self, req: Request) -> int:
        return self._blocks(req.prompt_len + req.max_new - 1)

    def cached_prefix_len(self, req: Request) -> int:
        return 0

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        return NO_HIT

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int]) -> bool:
        want = self._blocks(rec.target if rec.num_preemptions else first_chunk)
        free = self.alloc.num_free_blocks()
        return want <= free and not (num_running and free - want < self.watermark_blocks)

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int]) -> None:
        rec.block_table.extend(self.alloc.allocate(self._blocks(first_chunk)))

    def step_transfers(self) -> Transfers:
        return NO_TRANSFERS

    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        return [r for r in self.decodes.values() if self._blocks(r.offset + step + 1) > len(r.block_table)]

    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        need = self._blocks(tokens) - len(rec.block_table)
        if need > self.alloc.num_free_blocks():
            return False
        if need > 0:
            rec.block_table.extend(self.alloc.allocate(need))
        return True

    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        pass

    def moved(self, rec: LiveRequest, step: int) -> None:
        pass

    def start_decode(self, rec: LiveRequest) -> None:
        self.decodes[rec.rid] = rec

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        keep = self._blocks(tokens)
        self.alloc.release(rec.block_table[keep:])
        del rec.block_table[keep:]

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        self.decodes.pop(rec.rid, None)
        self.alloc.release(rec.block_table)
        rec.block_table.clear()

    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        return tuple(rec.block_table)

    def free_block_ids(self) -> tuple[int, ...]:
        return self.alloc.free_ids()

    def cache_view(self) -> PrefixCacheView | None:
        return None


def delegating(budget: int, max_seqs: int, kv: int, block_size: int = 16, watermark: float = 0.01,
               **options: object) -> Scheduler:
    """A Scheduler following the paged rules whose KV manager delegates to a ForeignAllocator."""
    num_blocks = kv // block_size
    manager = DelegatingKV(num_blocks, block_size, watermark)
    return Scheduler(budget, max_seqs, num_blocks * block_size, kv_policy="paged", block_size=block_size,
                     watermark=watermark, kv_manager=manager, **options)  # type: ignore[arg-type]


def test_the_delegating_manager_is_a_kv_manager():
    """The test manager satisfies the protocol the scheduler types its collaborator with."""
    manager: KVManager = DelegatingKV(8, 4, 0.0)
    assert manager.kv_total == 32 and manager.lookup is not None


def _tight_run(seed: int) -> InvariantChecker:
    """One seeded run on a tight pool with aborts and early stops, as the paged randomized runs."""
    rng = random.Random(seed)
    budget = rng.choice([1, 2, 3, rng.randint(1, 16), rng.randint(1, 256)])
    bs = rng.choice([1, 2, 3, 4, 16])
    reqs = [Request(i, rng.randint(1, 120), rng.randint(1, 48)) for i in range(25)]
    largest = max(-(-(r.prompt_len + r.max_new - 1) // bs) for r in reqs)
    blocks = rng.choice([largest, largest + rng.randint(0, largest // 4 + 1), largest * 3])
    s = delegating(budget, rng.randint(1, 11), blocks * bs, bs, rng.choice([0.0, 0.01, 0.1, 0.3]))
    chk = InvariantChecker(s, table_every=rng.choice([1, 2, 5]))
    arrive = sorted(rng.randint(0, 100) for _ in reqs)
    p_abort, p_stop = rng.choice([0.0, 0.1]), rng.choice([0.0, 0.05])
    drive_randomly(chk, s, reqs, arrive, rng, p_abort, p_stop, abort_in_flight=True)
    return chk


def test_randomized_runs_with_a_delegating_manager_hold_every_invariant():
    """16 seeded tight-pool runs with the delegating manager keep every paged invariant, and preempt."""
    preemptions = sum(_tight_run(seed).num_preemptions for seed in range(16))
    assert preemptions > 0


OPTIONS = {
    "plain": {},
    "priority": {"policy": "priority", "aging_interval": 3},
    "spec": {"num_spec_tokens": 2},
    "partial-prefills": {"max_num_partial_prefills": 3, "long_prefill_token_threshold": 40},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_randomized_workloads_with_a_delegating_manager_hold_every_invariant(name):
    """Seeded random workloads under each scheduler option run to the end under the checker with the
    delegating manager, every request served."""
    for seed in range(6):
        chk = RandomWorkload(seed, options={"block_size": 4, **OPTIONS[name]}).run(make=delegating)
        assert chk.num_requests == 40


@pytest.mark.pure_python  # reads the sources
def test_the_scheduler_has_no_branch_on_the_kv_policy_or_caching():
    """No Scheduler method, its constructor included, names the KV policy, prefix caching, a pool or a
    cache: the config chooses the manager (kv_manager_for) and every KV question goes through it."""
    tree = ast.Module([*ast.parse(inspect.getsource(scheduler_module)).body,
                       *ast.parse(inspect.getsource(scheduler_core_module)).body], [])
    banned = {"kv_policy", "enable_prefix_caching", "_paged", "_pkv", "_rkv", "pool", "cache", "buckets",
              "PagedKV", "ReservationKV", "CachingBlockPool", "BlockPool", "build_kv_manager", "watermark"}
    found = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
                if name in banned:
                    found.append(f"{cls.name}.{fn.name}: {name}")
    assert found == []


@pytest.mark.pure_python  # reads the sources
def test_the_scheduler_module_does_not_mention_kv_policies_or_caching():
    """core/scheduler.py and its step (core/scheduler_core.py) plan steps without a word of the KV policies
    or of prefix caching (they are SchedulerConfig's, core/kv/'s and core/queries.py's)."""
    text = (inspect.getsource(scheduler_module) + inspect.getsource(scheduler_core_module)).lower()
    assert [w for w in ("paged", "reserve", "caching", "cached", "prefix", "watermark", "kv_policy") if w in text] == []
