"""The contract's KV policy: prompt_len + max_new tokens reserved at admission, returned at the end.

Imports allowed: the standard library and stallfree.core only.

Source: reservation at admission is the contract (docs/DESIGN.md section 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import RequestRejected, SchedulerStateError
from stallfree.core.kv.pool import BlockPool
from stallfree.core.kv.pooled import PooledKV, reject_hashes
from stallfree.core.kv.protocol import NO_HIT, PrefixCacheStats
from stallfree.core.request import Request

if TYPE_CHECKING:
    from stallfree.core.live import LiveRequest

__all__ = ["ReservationKV"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class ReservationKV(PooledKV):
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

    #: Admission reserves every token a request computes: grow always answers True and trim changes
    #: nothing, so the scheduler need not ask them per decode (KVManager's optional attribute).
    holds_every_token = True

    def __init__(self, kv_tokens: object, block_size: object) -> None:
        # Read as given and checked by the pool (a compiled build would have converted a bool first).
        tokens: Any = kv_tokens
        unit: Any = block_size or 1
        self.pool = BlockPool(tokens // unit, unit)
        self.unit = self.pool.block_size
        self.kv_total = self.pool.num_blocks * self.unit
        self.has_block_ids = block_size is not None
        self.prefix_stats = PrefixCacheStats()

    def kv_needed(self, prompt_len: int, max_new: int) -> int:
        """Tokens reserved at admission: prompt_len + max_new, in whole blocks when a block size is set."""
        u = self.unit
        return -(-(prompt_len + max_new) // u) * u

    def kv_needed_for(self, req: Request) -> int:
        """Tokens `req` reserves at admission (kv_needed of its lengths)."""
        return self.kv_needed(req.prompt_len, req.max_new)

    def blocks_needed(self, req: Request) -> int:
        """Units (tokens, or blocks of block_size) `req` reserves at admission."""
        return self.kv_needed(req.prompt_len, req.max_new) // self.unit

    def cached_prefix_len(self, req: Request) -> int:
        """Always 0: nothing is cached."""
        return 0

    def check_fits(self, req: Request) -> int:
        """Return the tokens `req` reserves at admission.

        Raises:
            RequestRejected: more than kv_total, or `req` has block_hashes (no prefix caching here);
                the message gives the numbers.
        """
        if req.block_hashes is not None:
            reject_hashes(req, "reserve")
        need = self.kv_needed(req.prompt_len, req.max_new)
        if need > self.kv_total:
            blocks = f" in whole blocks of {self.unit}" if self.unit > 1 else ""
            raise RequestRejected(
                f"request {req.rid!r} can never fit: prompt_len + max_new = {req.prompt_len} + "
                f"{req.max_new} = {req.prompt_len + req.max_new}, {need} tokens of KV{blocks} "
                f"> kv_tokens = {self.kv_total}"
            )
        return need

    def lookup(self, rec: LiveRequest) -> tuple[int, Sequence[int]]:
        """NO_HIT: nothing is cached."""
        return NO_HIT

    def can_admit(self, rec: LiveRequest, first_chunk: int, num_running: int, hits: Sequence[int] = ()) -> bool:
        """True when the whole reservation of `rec` is free."""
        return rec.kv <= self.pool.num_free * self.unit

    def admit(self, rec: LiveRequest, first_chunk: int, hits: Sequence[int] = ()) -> None:
        """Reserve `rec`'s KV (can_admit must have said yes)."""
        self.pool.promise(rec.kv // self.unit)

    def promise_decode_blocks(self, step: int) -> Sequence[LiveRequest]:
        """(): the reservations already hold every decode's KV."""
        return ()

    def grow(self, rec: LiveRequest, tokens: int, step: int) -> bool:
        """True: the reservation covers every token a request computes."""
        return True

    def filled(self, rec: LiveRequest, start: int, end: int) -> None:
        """Nothing to do: nothing is cached."""

    def moved(self, rec: LiveRequest, step: int) -> None:
        """Nothing to do: a table is made exact when it is read."""

    def start_decode(self, rec: LiveRequest) -> None:
        """Nothing to do: the reservation holds the decode's KV."""

    def trim(self, rec: LiveRequest, tokens: int) -> None:
        """Nothing to do: a table is made exact when it is read (`block_table`)."""

    def block_table(self, rec: LiveRequest, tokens: int) -> tuple[int, ...]:
        """`rec`'s table made exactly the blocks of `tokens` tokens (materialize), as a tuple."""
        self.materialize(rec, tokens)
        return tuple(rec.block_table)

    def peek_table(self, rec: LiveRequest, tokens: int) -> tuple[tuple[int, ...], int]:
        """`rec`'s table as it is, and the blocks it lacks to hold exactly `tokens` tokens (negative: the
        blocks past them, which `block_table` would return to the reservation); a pure read."""
        return tuple(rec.block_table), -(-tokens // self.unit) - len(rec.block_table)

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
