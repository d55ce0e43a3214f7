"""The KV block pool of the paged scheduler: a fixed set of block ids with a free list.

Imports allowed: the standard library and stallfree.core only.

A KV block holds the keys and values of `block_size` consecutive tokens of one request; a request's
block table is the list of its block ids in token order (token t lives in table[t // block_size]).
The pool deals only in integers: the tensors live in the engine, which writes token t of a request
to slot table[t // block_size] * block_size + t % block_size.

Source: paged KV cache with a per-request block table (PagedAttention / vLLM, Kwon et al., SOSP'23).
"""

from __future__ import annotations

from stallfree.core.errors import SchedulerStateError, check_positive_int

__all__ = ["BlockPool", "blocks_for_tokens"]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Return the KV blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size).

    Args:
        num_tokens: tokens, >= 0.
        block_size: tokens per block, >= 1.
    """
    return -(-num_tokens // block_size)


class BlockPool:
    """Owns the ids 0..num_blocks-1 of the KV blocks and which of them are free.

    It hands blocks out into block tables (plain lists of ids that the caller owns) and takes them
    back; it never sees tokens or requests. Blocks may also be *promised*: counted as used at once
    (O(1), however many) and given their ids later, when the owner materializes its table; this is
    how a step's decodes that cross a block boundary are served without touching each of them.
    Freed blocks are reused first (a stack), so a workload that fits touches few distinct blocks.

    Args:
        num_blocks: KV blocks in the cache, >= 1.
        block_size: tokens per block, >= 1.

    Raises:
        InvalidConfig: num_blocks or block_size is not an integer >= 1; the message names it.
    """

    __slots__ = ("num_blocks", "block_size", "_free", "_promised")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        # A stack: the end of the list is handed out first, so block 0 goes first on a fresh pool.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._promised = 0

    @property
    def num_free(self) -> int:
        """Blocks neither in a block table nor promised."""
        return len(self._free) - self._promised

    @property
    def num_used(self) -> int:
        """Blocks in block tables or promised: num_blocks - num_free."""
        return self.num_blocks - self.num_free

    @property
    def num_promised(self) -> int:
        """Blocks counted as used whose ids have not been handed out yet."""
        return self._promised

    def free_ids(self) -> tuple[int, ...]:
        """The ids not in any block table (free or promised; a copy, O(num_blocks)), for checkers."""
        return tuple(self._free)

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
        if n > len(self._free) - self._promised:
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

    def _take(self, table: list[int], n: int) -> None:
        if n <= 0:
            return
        free = self._free
        got = free[-n:]
        del free[-n:]
        got.reverse()
        table.extend(got)
