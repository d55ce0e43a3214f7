"""The paged-KV continuous batching scheduler: the reservation contract's step order, with KV blocks
allocated as tokens are scheduled, admission by a free-block watermark and preemption by recompute.

Imports allowed: the standard library and stallfree.core only.

Source: paged KV cache, block tables and preemption by recompute (PagedAttention / vLLM, Kwon et al.,
SOSP'23); the free-block watermark at admission (vLLM's and Sarathi-Serve's block managers); stall-free
batching with chunked prefill (Sarathi-Serve, Agrawal et al., OSDI'24).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

from stallfree.core.errors import InvalidConfig, RequestRejected, SchedulerStateError, check_positive_int
from stallfree.core.kv import BlockPool, blocks_for_tokens
from stallfree.core.lifecycle import RequestLifecycle, position_of
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.request import FinishReason, Request, RequestStatus

__all__ = ["PagedScheduler"]

_WAITING = RequestStatus.WAITING
_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_PREEMPTED = RequestStatus.PREEMPTED
_FINISHED = RequestStatus.FINISHED
_ABORTED = RequestStatus.ABORTED



class _Live:
    """The scheduler's record of one live request. Mutated by the PagedScheduler only.

    An admission starts an *episode*: the request prefills `target` = prompt_len + gen0 tokens (gen0 =
    tokens generated before it was last preempted; 0 on the first admission), and its last chunk
    samples token gen0 + 1. As in the reservation scheduler, a decode's progress is derived from step
    numbers: after step k it has generated k - base tokens, and its decode at step k starts at
    offset + k = prompt_len + k - base - 2, the number of tokens whose KV its table holds.
    """

    __slots__ = (
        "req", "rid", "prompt_len", "max_new", "status", "table", "gen0", "target", "num_prefilled",
        "admitted_step", "first_token_step", "decode_step", "base", "finish_step", "bucket",
        "num_preemptions",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.rid = req.rid
        self.prompt_len = req.prompt_len
        self.max_new = req.max_new
        self.status = _WAITING
        self.table: list[int] = []
        self.gen0 = 0
        self.target = req.prompt_len
        self.num_prefilled = 0
        self.admitted_step: int | None = None
        self.first_token_step: int | None = None
        self.decode_step = -1  # the step whose last chunk made it a decode in this episode
        self.base = 0
        self.finish_step = -1
        self.bucket = -1  # key of the boundary bucket it sits in while decoding; -1 when not
        self.num_preemptions = 0


def check_watermark(value: object) -> float:
    """Return `value` as a float if it is a real number with 0 <= value < 1 (bools excluded).

    Raises:
        InvalidConfig: otherwise; the message names `watermark` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfig(f"watermark must be a number in [0, 1), got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and 0 <= value < 1):
        raise InvalidConfig(f"watermark must be a number in [0, 1), got {value!r}")
    return float(value)


class PagedScheduler(RequestLifecycle):
    """A continuous batching scheduler whose KV cache is a pool of fixed-size blocks (docs/DESIGN.md section 1,
    paged variant). Same interface, step order and StepPlan as Scheduler; KV is taken as tokens are
    scheduled rather than reserved for prompt_len + max_new at admission.

    It owns the waiting queue, the running set, the block pool and one block table per running request;
    it never sees token ids or tensors. Each step (schedule(), then complete(plan)) spends the budget:

    1. decodes: one token for every running request whose prefill is done, oldest admitted first; a
       decode whose token starts a new block (start % block_size == 0) takes a block;
    2. the partial prefill, up to what is left; its chunk takes the blocks its tokens need;
    3. admission, strictly first come first served: the head needs a free slot, budget left, and the
       blocks of its first chunk while keeping watermark_blocks = floor(watermark * num_blocks) blocks
       free; a preempted head needs the blocks of its whole recompute (prompt_len + generated), so that
       it is not readmitted only to be preempted again. The watermark is waived when nothing is running
       (nobody to push into preemption; so any request that passes add() runs). A step that preempted
       admits nothing (its victims head the queue).

    Preemption by recompute: a scheduled request (a decode or the partial prefill) that cannot get its
    block preempts running requests from the most recently admitted backwards, never one admitted
    before it, until its blocks are free; when it is the newest itself, it is the one preempted. A
    victim releases all its blocks and goes to the front of the waiting queue (victims of one step in
    arrival order: the queue stays in add() order); readmitted, it prefills prompt_len + the tokens it
    had generated (recomputed tokens; nothing is emitted twice) and its last chunk samples its next
    token. The oldest running request is never a victim, so it progresses every step and every run
    ends.

    Invariants (checked by stallfree.core.paged_invariants.PagedInvariantChecker): free + used blocks
    == num_blocks; each running request holds exactly ceil(tokens in KV / block_size) blocks, no block
    in two tables; tokens <= token_budget; running <= max_seqs; exactly max_new tokens emitted per
    request (fewer only if stopped or aborted); each episode prefills exactly its target; admission
    order equals queue order; victims are the newest running; all blocks free at the end.

    Example (B30): budget 16, 16 blocks of 4 tokens; rid 1 (prompt 4, max_new 56) and rid 2 (prompt 4,
    max_new 4) are both admitted in step 0 (the reservation scheduler holds rid 2 back until rid 1 has
    released its 60 reserved tokens, 56 steps later).

    Args:
        token_budget: the most tokens in one step, >= 1.
        max_seqs: the most running requests, >= 1.
        num_blocks: KV blocks in the cache, >= 1.
        block_size: tokens per KV block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.

    Raises:
        InvalidConfig: an argument is out of range or of the wrong type; the message names it.
    """

    _live: dict[Hashable, _Live]
    _prefilling: _Live | None
    _due: dict[int, list[_Live]]

    def __init__(
        self, token_budget: int, max_seqs: int, num_blocks: int, block_size: int, watermark: float = 0.01
    ) -> None:
        self.token_budget = check_positive_int("token_budget", token_budget)
        self.max_seqs = check_positive_int("max_seqs", max_seqs)
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.watermark = check_watermark(watermark)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = math.floor(self.watermark * num_blocks)
        self._pool = BlockPool(num_blocks, block_size)
        self._init_lifecycle()
        self._waiting: deque[_Live] = deque()
        # Decodes in admission order, as three aligned lists plus cached tuples that plans share while
        # the set does not change (as in the reservation scheduler).
        self._dec: list[_Live] = []
        self._dec_rids: list[Hashable] = []
        self._dec_offsets: list[int] = []
        self._dec_rids_t: tuple[Hashable, ...] = ()
        self._dec_offsets_t: tuple[int, ...] = ()
        self._dec_dirty = False
        self._dec_offset_sum = 0
        # Decodes by the step residue at which their token starts a block: at step k the decodes
        # in bucket k % block_size (rid -> request, admission order) each need a new block. The
        # blocks are promised in one count and given ids when the table is materialized, so a step
        # costs O(1) for block accounting however many decodes cross a boundary.
        self._buckets: dict[int, dict[Hashable, _Live]] = {}
        self._num_preemptions = 0
        self._num_recomputed_tokens = 0

    # ------------------------------------------------------------------ public state

    @property
    def kv_total(self) -> int:
        """KV cache capacity in tokens: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    @property
    def kv_free(self) -> int:
        """Free KV capacity in tokens: num_free_blocks * block_size."""
        return self._pool.num_free * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """KV blocks in no block table."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by running requests."""
        return self._pool.num_used

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far, over all requests."""
        return self._num_preemptions

    @property
    def num_recomputed_tokens(self) -> int:
        """Prefill tokens scheduled in episodes after a preemption (prompt + generated, recomputed)."""
        return self._num_recomputed_tokens

    def block_table(self, rid: Hashable) -> tuple[int, ...]:
        """Return the block ids of a live request, in token order (empty while it waits).

        Raises:
            KeyError: `rid` is not live.
        """
        obj = self._live.get(rid)
        if obj is None:
            raise KeyError(f"no live request with rid {rid!r}")
        self._materialize(obj)
        return tuple(obj.table)

    def free_block_ids(self) -> tuple[int, ...]:
        """Return the ids of the free blocks, after giving every running table its promised blocks.

        O(num_blocks + running); meant for checkers and tests.
        """
        for obj in self._dec:
            self._materialize(obj)
        return self._pool.free_ids()

    def blocks_needed(self, req: Request) -> int:
        """The most blocks `req` ever holds: ceil((prompt_len + max_new - 1) / block_size).

        The last sampled token is never fed back, so its KV is never computed.
        """
        return blocks_for_tokens(req.prompt_len + req.max_new - 1, self.block_size)

    # ------------------------------------------------------------------ lifecycle hooks

    def _check_fits(self, req: Request) -> int:
        need = self.blocks_needed(req)
        if need > self.num_blocks:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: ceil((prompt_len + max_new - 1) / block_size) = "
                f"ceil(({req.prompt_len} + {req.max_new} - 1) / {self.block_size}) = {need} blocks "
                f"> num_blocks = {self.num_blocks}"
            )
        return need

    def _new_live(self, req: Request, need: int) -> _Live:
        return _Live(req)

    def _decoded_in(self, obj: _Live, plan: StepPlan) -> bool:
        return obj.status is _DECODING and obj.decode_step < plan.step

    def _num_generated(self, obj: _Live) -> int:
        # num_prefilled counts the current episode's prefill (prompt + recomputed tokens).
        return self._step - 1 - obj.base if obj.status is _DECODING else obj.gen0

    # ------------------------------------------------------------------ the step

    def schedule(self) -> StepPlan:
        """Plan the next step: decodes, then the partial prefill, then FCFS admissions.

        Returns:
            The StepPlan of step `self.step`; `plan.preempted` lists the requests preempted in it
            (in arrival order). Empty when nothing can run.

        Raises:
            SchedulerStateError: the previous plan has not been completed.
        """
        if self._inflight is not None:
            raise SchedulerStateError(
                f"schedule() called twice: step {self._inflight.step} was not completed"
            )
        budget = self.token_budget
        step = self._step
        victims: list[_Live] = []
        # Contract step 1, KV part: the decodes whose token starts a block take one each; usually one
        # O(1) promise, else blocks one by one, oldest first, preempting as needed.
        bucket = self._buckets.get(step % self.block_size)
        if bucket and not self._pool.try_promise(len(bucket)):
            self._grow_decodes(bucket, step, victims)
        decode_rids, decode_offsets, used = self._decode_tuples(budget)
        prefills: list[ScheduledChunk] = []
        left = self._schedule_partial_prefill(budget - used, prefills, victims)
        if victims:
            # Victims go back in front of every never-started request, oldest first; a step that had
            # to preempt admits nothing (its blocks are spoken for).
            self._waiting.extendleft(victims)
            admitted: tuple[Hashable, ...] = ()
        else:
            admitted = self._admit(left, prefills)
        n_dec = len(decode_rids)
        plan = StepPlan(
            step=step,
            decode_rids=decode_rids,
            decode_offsets=decode_offsets,
            prefills=tuple(prefills),
            num_tokens=n_dec + sum(c.num_tokens for c in prefills),
            decode_context_sum=self._dec_offset_sum + n_dec * step,
            token_budget=budget,
            admitted=admitted,
            preempted=tuple(v.rid for v in reversed(victims)) if victims else (),
        )
        self._inflight = plan
        return plan

    def _grow_decodes(self, bucket: dict[Hashable, _Live], step: int, victims: list[_Live]) -> None:
        """Give each decode in `bucket` its new block, oldest first, preempting the newest running
        request (never an older one; itself when it is the newest) while none is free."""
        pool = self._pool
        for obj in list(bucket.values()):
            if obj.status is not _DECODING:
                continue  # a victim of an older decode earlier in this loop
            while pool.num_free == 0:
                victim = self._newest_running()
                self._preempt(victim, step, victims)
                if victim is obj:
                    break
            else:
                self._materialize(obj)
                pool.allocate(obj.table, 1)

    def _newest_running(self) -> _Live:
        """The most recently admitted running request: the partial prefill if any (nothing is
        admitted while a prompt is partly prefilled), else the last decode."""
        if self._prefilling is not None:
            return self._prefilling
        return self._dec[-1]

    def _decode_tuples(self, budget: int) -> tuple[tuple[Hashable, ...], tuple[int, ...], int]:
        """Contract step 1: one token per ready decode, oldest admitted first."""
        if self._dec_dirty:
            self._dec_rids_t = tuple(self._dec_rids)
            self._dec_offsets_t = tuple(self._dec_offsets)
            self._dec_dirty = False
        n = len(self._dec_rids_t)
        if n > budget:
            # Unreachable with a fixed budget: every ready decode had an entry in the last step.
            raise SchedulerStateError(f"{n} ready decodes exceed token_budget {budget}")
        return self._dec_rids_t, self._dec_offsets_t, n

    def _schedule_partial_prefill(self, left: int, out: list[ScheduledChunk], victims: list[_Live]) -> int:
        """Contract step 2: the rest of the prefill started earlier, with the blocks its chunk needs."""
        obj = self._prefilling
        if obj is None or left <= 0:
            return left
        done = obj.num_prefilled
        n = min(obj.target - done, left)
        need = blocks_for_tokens(done + n, self.block_size) - len(obj.table)
        if need > self._pool.num_free:
            # It is the newest running request (nothing is admitted behind a partial prefill), so
            # it is its own victim.
            self._preempt(obj, self._step, victims)
            return left
        self._pool.allocate(obj.table, need)
        if obj.num_preemptions:
            self._num_recomputed_tokens += n
        out.append(ScheduledChunk(obj.rid, n, True, done, done + n == obj.target))
        return left - n

    def _admit(self, left: int, out: list[ScheduledChunk]) -> tuple[Hashable, ...]:
        """Contract step 3: strict FCFS admission by slots, budget and free blocks above the watermark."""
        waiting = self._waiting
        if not waiting:
            return ()
        pool = self._pool
        bs = self.block_size
        admitted: list[Hashable] = []
        step = self._step
        free = pool.num_free
        while left > 0 and waiting:
            obj = waiting[0]
            if self._num_running >= self.max_seqs:
                break
            n = min(obj.target, left)
            need = -(-n // bs)
            # A preempted request comes back only when its whole recompute fits: it was preempted for
            # want of blocks, and readmitting it on its first chunk's blocks alone would recompute
            # that chunk and preempt it again, step after step (B21's thrashing).
            want = -(-obj.target // bs) if obj.num_preemptions else need
            if want > free or (self._num_running and free - want < self.watermark_blocks):
                break
            waiting.popleft()
            pool.allocate(obj.table, need)
            free -= need
            self._num_running += 1
            obj.status = _PREFILLING
            if obj.admitted_step is None:
                obj.admitted_step = step
            if obj.num_preemptions:
                self._num_recomputed_tokens += n
            out.append(ScheduledChunk(obj.rid, n, True, 0, n == obj.target))
            admitted.append(obj.rid)
            left -= n
        return tuple(admitted)

    # ------------------------------------------------------------------ internals

    def _first_token(self, obj: _Live, step: int) -> None:
        """The last chunk of an episode sampled token gen0 + 1: finish, or start decoding."""
        if obj.first_token_step is None:
            obj.first_token_step = step
        obj.status = _DECODING
        obj.decode_step = step
        if obj.gen0 + 1 == obj.max_new:
            self._finish(obj, FinishReason.LENGTH)
            return
        obj.base = step - 1 - obj.gen0
        obj.finish_step = obj.base + obj.max_new
        self._due.setdefault(obj.finish_step, []).append(obj)
        off = obj.prompt_len - obj.base - 2
        self._dec.append(obj)
        self._dec_rids.append(obj.rid)
        self._dec_offsets.append(off)
        self._dec_offset_sum += off
        self._dec_dirty = True
        obj.bucket = -off % self.block_size
        self._buckets.setdefault(obj.bucket, {})[obj.rid] = obj

    def _materialize(self, obj: _Live) -> None:
        """Give a decode's table the ids of the blocks promised to it.

        Its table must cover the tokens in KV: offset + step, plus the token of the plan in flight.
        """
        if obj.bucket < 0:
            return
        missing = self._unclaimed(obj)
        if missing:
            self._pool.claim(obj.table, missing)

    def _unclaimed(self, obj: _Live) -> int:
        """Blocks promised to a decode and not yet in its table."""
        tokens = obj.prompt_len - obj.base - 2 + self._step + (self._inflight is not None)
        return -(-tokens // self.block_size) - len(obj.table)

    def _leave_running(self, obj: _Live) -> None:
        """Drop a running request from the decodes or the partial prefill and free its blocks."""
        unclaimed = 0
        if obj.bucket >= 0:
            unclaimed = self._unclaimed(obj)
            dec = self._dec
            i = position_of(dec, obj)
            del dec[i], self._dec_rids[i]
            self._dec_offset_sum -= self._dec_offsets.pop(i)
            self._dec_dirty = True
            del self._buckets[obj.bucket][obj.rid]
            obj.bucket = -1
        elif self._prefilling is obj:
            self._prefilling = None
        self._num_running -= 1
        self._pool.release(obj.table, unclaimed)

    def _preempt(self, obj: _Live, step: int, victims: list[_Live]) -> None:
        """Preempt a running request by recompute: free its blocks, queue it to prefill prompt + generated."""
        gen = step - 1 - obj.base if obj.bucket >= 0 else obj.gen0
        self._leave_running(obj)
        obj.status = _PREEMPTED
        obj.gen0 = gen
        obj.target = obj.prompt_len + gen
        obj.num_prefilled = 0
        obj.finish_step = -1
        obj.decode_step = -1
        obj.num_preemptions += 1
        self._num_preemptions += 1
        victims.append(obj)
