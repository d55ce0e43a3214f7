"""The flat batch of one step: token ids, positions, KV slots and attention metadata as tensors.

Imports allowed: the standard library, torch.

A step's entries (decodes and prefill chunks from many requests) are laid end to end in one
token axis T. One-token entries (decodes) are attended to together, padded to the longest
context; each longer chunk is attended to on its own, causally over its request's earlier tokens
and itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["BatchEntry", "ChunkMeta", "FlatBatch", "build_flat_batch"]


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One request's tokens in a step.

    Attributes:
        token_ids: the tokens this entry feeds (a decode's last sampled token, or a prompt chunk).
        start: the position of its first token = tokens of the request already in the KV cache.
        block_table: the request's KV blocks, covering at least start + len(token_ids) tokens.
        logits: "last" (sample from the last token), "all" (every token; for tests) or "none".
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    logits: str = "last"


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """A multi-token entry: rows q_start:q_end of the batch, attending to `ctx_slots`.

    Shapes: ctx_slots [start + n] int64, the slots of positions 0 .. start + n - 1.
    """

    q_start: int
    q_end: int
    start: int
    ctx_slots: torch.Tensor


@dataclass(frozen=True, slots=True)
class FlatBatch:
    """The tensors of one forward pass.

    Shapes (int64 unless said):
        token_ids [T], positions [T], slot_mapping [T] (where each token's K and V are written);
        dec_rows [B] (batch rows of the one-token entries), dec_slots [B, C] (their context slots,
        padded with slot 0), dec_mask [B, C] bool (True = a real key), C = the longest context;
        logits_rows [S] (rows whose logits are returned).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    dec_rows: torch.Tensor | None
    dec_slots: torch.Tensor | None
    dec_mask: torch.Tensor | None
    chunks: tuple[ChunkMeta, ...]
    logits_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """T: tokens in the batch."""
        return int(self.token_ids.shape[0])


def build_flat_batch(
    entries: Sequence[BatchEntry], block_size: int, device: torch.device
) -> FlatBatch:
    """Lay `entries` end to end and build the slot and attention metadata.

    Args:
        entries: the step's entries in batch order (each with >= 1 token).
        block_size: tokens per KV block.

    Returns:
        The FlatBatch; its logits_rows list, in entry order, the rows each entry asked for.

    Raises:
        ValueError: an entry has no tokens, or its block table is too short for its tokens.
    """
    ids: list[int] = []
    pos: list[int] = []
    slot_map: list[torch.Tensor] = []
    dec_rows: list[int] = []
    dec_tables: list[Sequence[int]] = []
    dec_lens: list[int] = []
    chunks: list[ChunkMeta] = []
    logit_rows: list[int] = []
    offsets = torch.arange(block_size, dtype=torch.int64)
    for i, e in enumerate(entries):
        n = len(e.token_ids)
        end = e.start + n
        if n < 1:
            raise ValueError(f"batch entry {i} has no tokens")
        nb = -(-end // block_size)
        if len(e.block_table) < nb:
            raise ValueError(
                f"batch entry {i}: block table of {len(e.block_table)} blocks holds "
                f"{len(e.block_table) * block_size} tokens < {end} needed"
            )
        row = len(ids)
        ids.extend(e.token_ids)
        pos.extend(range(e.start, end))
        blocks = torch.tensor(list(e.block_table[:nb]), dtype=torch.int64)
        ctx = (blocks[:, None] * block_size + offsets).flatten()[:end]
        slot_map.append(ctx[e.start:])
        if n == 1:
            dec_rows.append(row)
            dec_tables.append(e.block_table[:nb])
            dec_lens.append(end)
        else:
            chunks.append(ChunkMeta(row, row + n, e.start, ctx.to(device)))
        if e.logits == "last":
            logit_rows.append(row + n - 1)
        elif e.logits == "all":
            logit_rows.extend(range(row, row + n))

    def t(x: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    dec_slots = dec_mask = dec_rows_t = None
    if dec_rows:
        width = max(len(b) for b in dec_tables)
        tables = t([list(b) + [0] * (width - len(b)) for b in dec_tables])
        dec_slots = (tables[:, :, None] * block_size + offsets.to(device)).flatten(1)
        dec_slots = dec_slots[:, : max(dec_lens)]
        dec_mask = torch.arange(dec_slots.shape[1], device=device)[None, :] < t(dec_lens)[:, None]
        dec_rows_t = t(dec_rows)
    slots = torch.cat(slot_map).to(device) if slot_map else t([])
    return FlatBatch(t(ids), t(pos), slots, dec_rows_t, dec_slots, dec_mask,
                     tuple(chunks), t(logit_rows))
