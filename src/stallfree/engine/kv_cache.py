"""The physical paged KV cache (K and V tensors addressed by slot); which blocks a request holds is
the scheduler's block table (stallfree.core), under either KV policy.

Imports allowed: the standard library, torch, stallfree.engine.errors.

Source: paged KV cache with block tables (vLLM / PagedAttention, Kwon et al., SOSP'23).

A slot is one token's place in the cache: slot = block * block_size + offset. A request's block
table lists its blocks in order, so its token at position p lives in slot
table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

import torch

__all__ = ["HostKVCache", "KVCache"]


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


class HostKVCache:
    """A CPU KV tier's blocks in host memory (stallfree.core.kv_tier): K and V of `num_blocks` blocks,
    shapes [L, num_blocks * block_size, Hkv, D], pinned when a GPU is present so that copies to and
    from it are DMA transfers.

    Args:
        num_layers, num_kv_heads, head_dim: L, Hkv, D of the model.
        num_blocks: CPU blocks (>= 1).
        block_size: tokens per block (>= 1).
        dtype: the engine's dtype.
        pin: page-lock the tensors (only with a GPU).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, pin: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        """Bytes held by K and V together."""
        return 2 * self.k.numel() * self.k.element_size()

    def _blocks(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (cache.k.shape[0], cache.num_blocks + 1, cache.block_size, *cache.k.shape[2:])
        return cache.k.view(shape), cache.v.view(shape)

    def offload(self, cache: KVCache, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy GPU blocks to CPU blocks, `pairs` of (gpu_block, cpu_block) (StepPlan.kv_offloads)."""
        if not pairs:
            return
        gk, gv = self._blocks(cache)
        src = torch.tensor([g for g, _ in pairs], dtype=torch.long, device=cache.k.device)
        dst = torch.tensor([c for _, c in pairs], dtype=torch.long)
        self.k.index_copy_(1, dst, gk.index_select(1, src).to("cpu"))
        self.v.index_copy_(1, dst, gv.index_select(1, src).to("cpu"))

    def load(self, cache: KVCache, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy CPU blocks into GPU blocks, `pairs` of (cpu_block, gpu_block) (StepPlan.kv_loads)."""
        if not pairs:
            return
        gk, gv = self._blocks(cache)
        src = torch.tensor([c for c, _ in pairs], dtype=torch.long)
        dst = torch.tensor([g for _, g in pairs], dtype=torch.long, device=cache.k.device)
        dev = cache.k.device
        gk.index_copy_(1, dst, self.k.index_select(1, src).to(dev, non_blocking=True))
        gv.index_copy_(1, dst, self.v.index_select(1, src).to(dev, non_blocking=True))
