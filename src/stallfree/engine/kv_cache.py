"""The physical paged KV cache (K and V tensors addressed by slot) and the block allocator the
engine uses under the reservation scheduler.

Imports allowed: the standard library, torch, stallfree.engine.errors.

Source: paged KV cache with block tables (vLLM / PagedAttention, Kwon et al., SOSP'23).

A slot is one token's place in the cache: slot = block * block_size + offset. A request's block
table lists its blocks in order, so its token at position p lives in slot
table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["BlockAllocator", "KVCache"]


class KVCache:
    """K and V for every layer, in fixed-size blocks, plus one zero block that pads block tables.

    Shapes: k, v: [L, N + block_size, Hkv, D] in the engine's dtype, N = num_blocks * block_size
    usable slots; blocks 0 .. num_blocks - 1 are handed out, block `pad_block` (= num_blocks) is
    all zeros and never written.

    Memory the engine never wrote never reaches an output (issue: masked memory). The tensors are
    allocated with torch.empty, so an unwritten slot may hold anything (NaN, inf); attention masks
    out the slots past a request's context, but a masked score still multiplies the value stored
    there (0 x NaN = NaN). So every slot attention gathers holds a value the engine wrote:

    - block tables are padded with `pad_block`, whose K and V are zeros;
    - the first time a step writes a block (it writes the block's first slot, position
      p % block_size == 0), the whole block is zeroed before the write (FlatBatch.zero_blocks),
      so the slots of a request's last block past its context are zeros, not stale memory.

    Args:
        num_layers, num_kv_heads, head_dim: L, Hkv, D of the model.
        num_blocks: blocks in the cache (>= 1).
        block_size: tokens per block (>= 1).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        pad = slice(num_blocks * block_size, None)
        self.k[:, pad] = 0
        self.v[:, pad] = 0

    def zero_blocks(self, blocks: torch.Tensor) -> None:
        """Set K and V of `blocks` (int64 [Z] block ids) to zero in every layer."""
        if blocks.numel():
            shape = (self.k.shape[0], self.num_blocks + 1, -1)
            self.k.view(shape).index_fill_(1, blocks, 0)
            self.v.view(shape).index_fill_(1, blocks, 0)

    @property
    def num_slots(self) -> int:
        """N: token slots that blocks can be handed out from (the pad block not counted)."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V together (the pad block included)."""
        return 2 * self.k.numel() * self.k.element_size()


class BlockAllocator:
    """Hands out KV blocks to requests as their tokens are computed (reservation scheduler mode).

    The reservation scheduler guarantees that the running requests' reservations sum to at most
    kv_tokens; each request wastes less than one block to rounding, so a pool of
    ceil(kv_tokens / block_size) + max_seqs blocks can never run dry.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Popped from the end: low block ids are used first, which keeps small runs compact.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    def table(self, rid: Hashable) -> list[int]:
        """Return the block table of `rid` (empty if it holds no blocks). Do not mutate it."""
        return self._tables.get(rid, [])

    def ensure(self, rid: Hashable, num_tokens: int) -> list[int]:
        """Grow `rid`'s block table to hold `num_tokens` tokens; return the table.

        Idempotent: asking again for the same or fewer tokens allocates nothing.

        Raises:
            RuntimeError: the pool is empty, which the reservation guarantee rules out (an
                internal error, not a user error); nothing is allocated.
        """
        table = self._tables.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free):
            raise RuntimeError(
                f"KV block pool exhausted: request {rid!r} needs {need} more blocks, "
                f"{len(self._free)} free of {self.num_blocks}"
            )
        for _ in range(need):
            table.append(self._free.pop())
        return table

    def free(self, rid: Hashable) -> None:
        """Return all of `rid`'s blocks to the pool (no-op if it holds none)."""
        table = self._tables.pop(rid, None)
        if table:
            self._free.extend(reversed(table))
