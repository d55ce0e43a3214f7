"""The KV side of the scheduler: one block pool, and the two KV policies that answer the scheduler's
questions about it (can this request be admitted, give this request the KV for these tokens, free it).

Imports allowed: the standard library and stallfree.core only.

A KV block holds the keys and values of `block_size` consecutive tokens of one request; a request's
block table is the list of its block ids in token order (token t lives in table[t // block_size]).
Everything here deals in integers: the tensors live in the engine, which writes token t of a request
to slot table[t // block_size] * block_size + t % block_size.

Who calls whom (docs/DESIGN.md, architecture): Scheduler -> KVManager (ReservationKV or PagedKV) ->
BlockPool. The scheduler decides *who* runs and who is preempted; the manager only says whether the
KV is there. A manager method that returns False means "a preemption is needed"; preemption itself is
one method of the scheduler.

Source: paged KV cache with a per-request block table and preemption by recompute (PagedAttention /
vLLM, Kwon et al., SOSP'23); the free-block watermark at admission (vLLM's and Sarathi-Serve's block
managers); reservation of prompt_len + max_new at admission (the contract, docs/DESIGN.md section 1).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

from stallfree.core.errors import InvalidConfig, RequestRejected, SchedulerStateError, check_positive_int
from stallfree.core.request import Request

if TYPE_CHECKING:
    from stallfree.core.live import LiveRequest

__all__ = ["BlockPool", "KVManager", "PagedKV", "ReservationKV", "blocks_for_tokens", "check_watermark"]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Return the KV blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size).

    Args:
        num_tokens: tokens, >= 0.
        block_size: tokens per block, >= 1.
    """
    return -(-num_tokens // block_size)


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


class BlockPool:
    """Owns the ids 0..num_blocks-1 of the KV blocks and which of them are free.

    It hands blocks out into block tables (plain lists of ids that the caller owns) and takes them
    back; it never sees tokens or requests. Blocks may also be *promised*: counted as used at once
    (O(1), however many) and given their ids later, when the owner materializes its table; this is
    how a step's decodes that cross a block boundary are served without touching each of them, and
    how the reservation policy counts its reservations. Freed blocks are reused first (a stack), so
    a workload that fits touches few distinct blocks; ids never handed out are not listed, so a pool
    of 10**15 blocks costs nothing until it is used.

    Args:
        num_blocks: KV blocks in the cache, >= 1.
        block_size: tokens per block, >= 1.

    Raises:
        InvalidConfig: num_blocks or block_size is not an integer >= 1; the message names it.
    """

    __slots__ = ("num_blocks", "block_size", "_free", "_fresh", "_promised")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        # Freed ids, a stack (its end is handed out first); ids >= _fresh were never handed out and
        # go out in increasing order after the stack, so block 0 goes first on a fresh pool.
        self._free: list[int] = []
        self._fresh = 0
        self._promised = 0

    @property
    def num_free(self) -> int:
        """Blocks neither in a block table nor promised."""
        return len(self._free) + self.num_blocks - self._fresh - self._promised

    @property
    def num_used(self) -> int:
        """Blocks in block tables or promised: num_blocks - num_free."""
        return self.num_blocks - self.num_free

    @property
    def num_promised(self) -> int:
        """Blocks counted as used whose ids have not been handed out yet."""
        return self._promised

    def free_ids(self) -> tuple[int, ...]:
        """The ids not in any block table (free or promised), last handed out first; O(num_blocks)."""
        return tuple(range(self.num_blocks - 1, self._fresh - 1, -1)) + tuple(self._free)

    def allocate(self, table: list[int], n: int) -> None:
        """Append `n` free blocks to `table`.

        Raises:
            SchedulerStateError: fewer than `n` blocks are free (the caller must check first);
                nothing changes.
        """
        if n > self.num_free:
            raise SchedulerStateError(f"allocate {n} KV blocks with only {self.num_free} free")
        self._take(table, n)

    def promise(self, n: int) -> None:
        """Count `n` free blocks as used now; their ids go out later through claim().

        Raises:
            SchedulerStateError: fewer than `n` blocks are free; nothing changes.
        """
        if n > self.num_free:
            raise SchedulerStateError(f"promise {n} KV blocks with only {self.num_free} free")
        self._promised += n

    def try_promise(self, n: int) -> bool:
        """Promise `n` blocks if that many are free and return True; else change nothing, return False."""
        if n > len(self._free) + self.num_blocks - self._fresh - self._promised:
            return False
        self._promised += n
        return True

    def claim(self, table: list[int], n: int) -> None:
        """Append `n` of the promised blocks to `table` (a promise is kept, so this cannot fail).

        Raises:
            SchedulerStateError: fewer than `n` blocks are promised (a caller's bookkeeping fault).
        """
        if n > self._promised:
            raise SchedulerStateError(f"claim {n} KV blocks with only {self._promised} promised")
        self._promised -= n
        self._take(table, n)

    def release(self, table: list[int], unclaimed: int = 0) -> None:
        """Return every block of `table`, and `unclaimed` promised blocks, to the pool; empty `table`."""
        self._free.extend(reversed(table))
        table.clear()
        self._promised -= unclaimed

    def unpromise(self, n: int) -> None:
        """Return `n` promised blocks that will never be claimed (a reservation that ended)."""
        self._promised -= n

    def release_tail(self, table: list[int], keep: int) -> None:
        """Return the blocks of `table` after its first `keep` to the pool."""
        if len(table) > keep:
            self._free.extend(reversed(table[keep:]))
            del table[keep:]

    def _take(self, table: list[int], n: int) -> None:
        if n <= 0:
            return
        free = self._free
        k = min(n, len(free))
        if k:
            got = free[-k:]
            del free[-k:]
            got.reverse()
            table.extend(got)
        if n > k:
            table.extend(range(self._fresh, self._fresh + n - k))
            self._fresh += n - k


class KVManager(Protocol):
    """What the scheduler asks of its KV policy. Counts are tokens unless they say blocks.

    Every method deals with the scheduler's own records (stallfree.core.live.LiveRequest); none
    decides who runs or who is preempted.
    """

    kv_total: int

    @property
    def kv_free(self) -> int: ...
    def check_fits(self, req: Request) -> int: ...
    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int) -> bool: ...
    def admit(self, rec: LiveRequest, first_chunk: int) -> None: ...
    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None: ...


class ReservationKV:
    """The contract's KV policy: prompt_len + max_new tokens reserved at admission, returned at the end.

    The reservation is counted in units of the pool's blocks (1 token, or block_size tokens when a
    block size is given: ceil((prompt_len + max_new) / B) blocks out of floor(kv_tokens / B)) and
    promised at admission, so kv_free and admission only count. The ids come later from that
    promise: `materialize` gives a request's block table exactly the blocks that cover the tokens
    it asks for (claimed from its own promise, so it never fails: a request never computes more
    than prompt_len + max_new - 1 tokens), and `free` returns the table and the unclaimed rest.
    Tables are filled only when read (the engine reads them; the simulator never does), so the
    reservation costs no work per step.

    Args:
        kv_tokens: KV capacity in tokens, >= 1.
        block_size: None (count tokens) or tokens per block, >= 1 and <= kv_tokens.
    """

    def __init__(self, kv_tokens: int, block_size: int | None) -> None:
        self.unit = block_size or 1
        self.pool = BlockPool(kv_tokens // self.unit, self.unit)
        self.kv_total = self.pool.num_blocks * self.unit

    @property
    def kv_free(self) -> int:
        """Unreserved KV, in tokens."""
        return self.pool.num_free * self.unit

    def kv_needed(self, prompt_len: int, max_new: int) -> int:
        """Tokens reserved at admission: prompt_len + max_new, in whole blocks when a block size is set."""
        u = self.unit
        return -(-(prompt_len + max_new) // u) * u

    def check_fits(self, req: Request) -> int:
        """Return the tokens `req` reserves at admission.

        Raises:
            RequestRejected: more than kv_total; the message gives the numbers.
        """
        need = self.kv_needed(req.prompt_len, req.max_new)
        if need > self.kv_total:
            blocks = f" in whole blocks of {self.unit}" if self.unit > 1 else ""
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {req.prompt_len} + "
                f"{req.max_new} = {req.prompt_len + req.max_new}, {need} tokens of KV{blocks} "
                f"> kv_tokens = {self.kv_total}"
            )
        return need

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int) -> bool:
        """True when the whole reservation of `rec` is free."""
        return rec.kv <= self.pool.num_free * self.unit

    def admit(self, rec: LiveRequest, first_chunk: int) -> None:
        """Reserve `rec`'s KV (can_admit must have said yes)."""
        self.pool.promise(rec.kv // self.unit)

    def materialize(self, rec: LiveRequest, tokens: int) -> None:
        """Make `rec`'s block table exactly the blocks that hold `tokens` tokens, within its reservation.

        Missing blocks are claimed from its promise; blocks past `tokens` (rejected speculative
        tokens) go back to the promise, so kv_free does not change.

        Raises:
            SchedulerStateError: `tokens` exceeds the reservation (a caller's bookkeeping fault);
                nothing changes.
        """
        table = rec.block_table
        want = -(-tokens // self.unit)
        have = len(table)
        if want > rec.kv // self.unit:
            raise SchedulerStateError(
                f"request {rec.rid!r}: {tokens} tokens of KV exceed its reservation of {rec.kv}"
            )
        if want > have:
            self.pool.claim(table, want - have)
        elif want < have:
            self.pool.release_tail(table, want)
            self.pool.promise(have - want)

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Return `rec`'s reservation: the blocks of its table and the promised rest."""
        self.pool.release(rec.block_table, rec.kv // self.unit - len(rec.block_table))


class PagedKV:
    """The paged KV policy: blocks taken as tokens are scheduled, admission by a free-block watermark.

    A running request holds ceil(tokens in its KV / block_size) blocks (plus, while its step is in
    flight, those of the tokens scheduled in it). Decodes are filed by the step residue at which their
    next token starts a block: at step k the decodes of bucket k % block_size each need one, and are
    served by one promise of that many blocks; each table gets its ids when it is read
    (`materialize`). A decode whose progress is not one token a step (a skipped decode, speculative
    tokens) is re-filed by the scheduler through `refile`.

    Args:
        num_blocks: KV blocks, >= 1.
        block_size: tokens per block, >= 1.
        watermark: the fraction of num_blocks kept free at admission, 0 <= watermark < 1.

    Raises:
        InvalidConfig: an argument is out of range; the message names it.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark = check_watermark(watermark)
        self.watermark_blocks = math.floor(self.watermark * num_blocks)
        self.kv_total = num_blocks * block_size
        self.buckets: dict[int, dict[Hashable, LiveRequest]] = {}

    @property
    def kv_free(self) -> int:
        """Free KV in tokens: free blocks x block_size."""
        return self.pool.num_free * self.block_size

    def blocks_needed(self, req: Request) -> int:
        """The most blocks `req` ever holds: ceil((prompt_len + max_new - 1) / block_size).

        The last sampled token is never fed back, so its KV is never computed.
        """
        return blocks_for_tokens(req.prompt_len + req.max_new - 1, self.block_size)

    def check_fits(self, req: Request) -> int:
        """Return blocks_needed(req).

        Raises:
            RequestRejected: more than num_blocks; the message gives the numbers.
        """
        need = self.blocks_needed(req)
        if need > self.num_blocks:
            raise RequestRejected(
                f"request {req.rid!r} can never fit: ceil((prompt_len + max_new - 1) / block_size) = "
                f"ceil(({req.prompt_len} + {req.max_new} - 1) / {self.block_size}) = {need} blocks "
                f"> num_blocks = {self.num_blocks}"
            )
        return 0

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int) -> bool:
        """The blocks of the first chunk are free and the watermark stays free (waived when nothing
        runs). A preempted request needs the blocks of its whole recompute (prompt + generated), so
        that it is not readmitted only to be preempted again (B21's thrashing)."""
        bs = self.block_size
        want = -(-rec.target // bs) if rec.num_preemptions else -(-first_chunk // bs)
        free = self.pool.num_free
        return want <= free and not (num_running and free - want < self.watermark_blocks)

    def admit(self, rec: LiveRequest, first_chunk: int) -> None:
        """Give `rec` the blocks of its first chunk (can_admit must have said yes)."""
        self.pool._take(rec.block_table, -(-first_chunk // self.block_size))

    def grow(self, rec: LiveRequest, tokens: int) -> bool:
        """Give `rec` the blocks to hold `tokens` tokens; False (nothing changes) when too few are free."""
        need = -(-tokens // self.block_size) - len(rec.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        self.pool.allocate(rec.block_table, need)
        return True

    def file_decode(self, rec: LiveRequest) -> None:
        """File a new decode under the residue at which its next token starts a block."""
        rec.bucket = -rec.offset % self.block_size
        self.buckets.setdefault(rec.bucket, {})[rec.rid] = rec

    def refile(self, rec: LiveRequest) -> None:
        """Re-file a decode whose offset moved (its table must hold the ids it was promised)."""
        del self.buckets[rec.bucket][rec.rid]
        self.file_decode(rec)

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """Return the blocks of `rec` beyond those that hold `tokens` tokens (rejected speculative tokens)."""
        self.pool.release_tail(rec.block_table, -(-tokens // self.block_size))

    def unclaimed(self, rec: LiveRequest, step: int, in_flight: bool) -> int:
        """Blocks promised to a decode and not yet in its table: its table must cover the tokens in
        its KV (offset + step), plus the token of the plan in flight."""
        tokens = rec.offset + step + in_flight
        return max(0, -(-tokens // self.block_size) - len(rec.block_table))

    def materialize(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Give a decode's table the ids of the blocks promised to it."""
        if rec.bucket >= 0:
            missing = self.unclaimed(rec, step, in_flight)
            if missing:
                self.pool.claim(rec.block_table, missing)

    def free(self, rec: LiveRequest, step: int, in_flight: bool) -> None:
        """Return every block of `rec` (and its unclaimed promises); drop it from its bucket."""
        unclaimed = 0
        if rec.bucket >= 0:
            table = rec.block_table
            unclaimed = -(-(rec.offset + step + in_flight) // self.block_size) - len(table)
            if unclaimed < 0:
                unclaimed = 0
            del self.buckets[rec.bucket][rec.rid]
            rec.bucket = -1
        self.pool.release(rec.block_table, unclaimed)
