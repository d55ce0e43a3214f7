"""The flat batch of one step: token ids, positions, KV slots and attention metadata as tensors.

Imports allowed: the standard library, torch, stallfree.core (plans only).

A step's entries (decodes and prefill chunks from many requests) are laid end to end in one token
axis T. Attention runs in at most two calls per layer, whatever the number of requests: one for
the one-token entries (decodes, padded to the longest context) and one for the multi-token entries
(prefill chunks, padded to the longest chunk and the longest context). Keys are gathered from the
paged cache a whole block at a time through padded block tables; see KVCache for why every key
gathered, masked or not, is memory the engine wrote.

Two builders make the same FlatBatch: `build_flat_batch` from a list of BatchEntry (tests and
tools), and `BatchBuilder.build` from a StepPlan's compact fields with tensor operations (the
engine's hot path: nothing per running request in Python, except at a block boundary).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

__all__ = ["AttentionGroup", "BatchBuilder", "BatchEntry", "FlatBatch", "build_flat_batch"]

_I64 = torch.int64


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
class AttentionGroup:
    """E entries attended to in one call: queries padded to Q per entry, keys to C = nb * block_size.

    Shapes (int64), R = real queries of the group:
        q_rows [E*Q]: the batch row of each (entry, query); a padding query repeats its entry's
            last row (its output is dropped).
        q_pos [E, Q]: the position of each query; query (e, i) sees keys 0 .. q_pos[e, i].
        tables [E, nb]: block tables, padded with the cache's zero pad block.
        out_index [R]: where the real queries sit in the E*Q order (None when Q == 1: all real).
        out_rows [R]: their batch rows (None when Q == 1: q_rows).
    """

    q_rows: torch.Tensor
    q_pos: torch.Tensor
    tables: torch.Tensor
    out_index: torch.Tensor | None
    out_rows: torch.Tensor | None

    @property
    def num_queries(self) -> int:
        """Q: queries per entry after padding."""
        return int(self.q_pos.shape[1])


@dataclass(frozen=True, slots=True)
class FlatBatch:
    """The tensors of one forward pass (all int64).

    Shapes: token_ids [T], positions [T], slot_mapping [T] (where each token's K and V are
    written); zero_blocks [Z] (blocks this step writes first: zeroed before the writes);
    logits_rows [S] (rows whose logits are returned, in entry order); groups: the attention
    calls (one-token entries first, then multi-token entries; either may be absent).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    zero_blocks: torch.Tensor
    logits_rows: torch.Tensor
    groups: tuple[AttentionGroup, ...]

    @property
    def num_tokens(self) -> int:
        """T: tokens in the batch."""
        return int(self.token_ids.shape[0])

    def to(self, device: torch.device) -> FlatBatch:
        """Return the batch on `device` in one host-to-device copy (a no-op on the same device)."""
        if self.token_ids.device == device:
            return self
        parts: list[torch.Tensor] = []

        def take(t: torch.Tensor | None) -> None:
            if t is not None:
                parts.append(t.reshape(-1))

        for f in ("token_ids", "positions", "slot_mapping", "zero_blocks", "logits_rows"):
            take(getattr(self, f))
        for g in self.groups:
            for f in fields(g):
                take(getattr(g, f.name))
        flat = torch.cat(parts).to(device, non_blocking=True)
        it = iter(flat.split([p.numel() for p in parts]))

        def back(t: torch.Tensor | None) -> Any:
            return None if t is None else next(it).view(t.shape)

        head = {f: back(getattr(self, f)) for f in
                ("token_ids", "positions", "slot_mapping", "zero_blocks", "logits_rows")}
        groups = tuple(AttentionGroup(*(back(getattr(g, f.name)) for f in fields(g)))
                       for g in self.groups)
        return replace(self, groups=groups, **head)


def _group(row0: torch.Tensor, n: torch.Tensor, start: torch.Tensor, tables: torch.Tensor) -> AttentionGroup:
    """Make the AttentionGroup of E entries: first batch rows row0 [E], lengths n [E] (>= 1),
    start positions start [E], block tables [E, nb] (padded)."""
    q = int(n.max())
    if q == 1:
        return AttentionGroup(row0, start[:, None], tables, None, None)
    i = torch.arange(q, dtype=_I64)
    qi = torch.minimum(i[None, :], (n - 1)[:, None])  # padding queries repeat the last real one
    q_rows = (row0[:, None] + qi).flatten()
    out_index = (i[None, :] < n[:, None]).flatten().nonzero().squeeze(1)
    return AttentionGroup(q_rows, start[:, None] + qi, tables, out_index, q_rows[out_index])


def _first_write_blocks(start: int, end: int, table: Sequence[int], block_size: int) -> list[int]:
    """Blocks of `table` whose first slot lies in positions start .. end - 1."""
    first = -(-start // block_size)
    return [table[b] for b in range(first, -(-end // block_size))]


def _pad_tables(tables: Sequence[Sequence[int]], width: int, pad: int) -> torch.Tensor:
    return torch.tensor([list(t[:width]) + [pad] * (width - min(len(t), width)) for t in tables],
                        dtype=_I64)


def build_flat_batch(
    entries: Sequence[BatchEntry], block_size: int, device: torch.device, pad_block: int = 0
) -> FlatBatch:
    """Lay `entries` end to end and build the slot and attention metadata.

    Args:
        entries: the step's entries in batch order (each with >= 1 token).
        block_size: tokens per KV block.
        device: where the batch's tensors go.
        pad_block: the block id that pads block tables (KVCache.pad_block, whose K and V are
            zeros); 0 only for caches whose every block was written.

    Returns:
        The FlatBatch; its logits_rows list, in entry order, the rows each entry asked for.

    Raises:
        ValueError: an entry has no tokens, or its block table is too short for its tokens.
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    zero: list[int] = []
    logit_rows: list[int] = []
    kinds: tuple[list[tuple[int, int, int, Sequence[int]]], ...] = ([], [])  # one-token, multi
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
        slots.extend(e.block_table[p // block_size] * block_size + p % block_size
                     for p in range(e.start, end))
        zero.extend(_first_write_blocks(e.start, end, e.block_table, block_size))
        kinds[n > 1].append((row, n, e.start, e.block_table[:nb]))
        if e.logits == "last":
            logit_rows.append(row + n - 1)
        elif e.logits == "all":
            logit_rows.extend(range(row, row + n))
    groups = []
    for kind in kinds:
        if kind:
            rows, ns, starts, tables = zip(*kind, strict=True)
            width = max(len(t) for t in tables)
            groups.append(_group(torch.tensor(rows, dtype=_I64), torch.tensor(ns, dtype=_I64),
                                 torch.tensor(starts, dtype=_I64), _pad_tables(tables, width, pad_block)))

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=_I64)

    batch = FlatBatch(t(ids), t(pos), t(slots), t(zero), t(logit_rows), tuple(groups))
    return batch.to(torch.device(device))


TableFn = Callable[[Hashable, int], Sequence[int]]


class BatchBuilder:
    """Builds each step's FlatBatch from a StepPlan's compact fields with tensor operations.

    It owns one row per live request that has been scheduled (rows are reused after release):
    the request's block table and its last token, kept as tensors, so a step's decodes are
    gathered by row index instead of one Python object per request. Python runs per prefill chunk
    (few per step) and per decode that starts a new block (one decode in block_size).

    Shapes: tables [R, M] int64 (block ids; pad_block past the table), last_token [R] int64;
    R rows (grows by doubling), M = ceil(max_model_len / block_size).

    Args:
        block_size: tokens per KV block.
        max_model_len: the longest context, in tokens.
        pad_block: the cache's zero pad block (KVCache.pad_block).
        table_for: table_for(rid, num_tokens) returns the request's block table covering
            num_tokens tokens (the engine's allocator or the scheduler's table).
        device: where batches go (one host-to-device copy per step).
    """

    def __init__(self, block_size: int, max_model_len: int, pad_block: int, table_for: TableFn,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.pad_block = pad_block
        self.table_for = table_for
        self.device = device
        self._width = -(-max_model_len // block_size)
        self.tables = torch.full((8, self._width), pad_block, dtype=_I64)
        self.last_token = torch.zeros(8, dtype=_I64)
        self._row: dict[Hashable, int] = {}
        self._rid_of: list[Hashable] = [None] * 8
        self._free_rows = list(range(7, -1, -1))
        # The plan shares its decode tuples across steps while the decodes do not change.
        self._dec_key: tuple[Any, Any] | None = None
        self._dec_rows = self._dec_off = torch.zeros(0, dtype=_I64)

    def _row_of(self, rid: Hashable) -> int:
        row = self._row.get(rid)
        if row is None:
            if not self._free_rows:
                old = self.tables.shape[0]
                self.tables = torch.cat([self.tables, torch.full_like(self.tables, self.pad_block)])
                self.last_token = torch.cat([self.last_token, torch.zeros_like(self.last_token)])
                self._rid_of.extend([None] * old)
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self._free_rows.pop()
            self._row[rid] = row
            self._rid_of[row] = rid
        return row

    def release(self, rid: Hashable) -> None:
        """Forget `rid`'s row (no-op if it has none)."""
        row = self._row.pop(rid, None)
        if row is not None:
            self.tables[row] = self.pad_block
            self._rid_of[row] = None
            self._free_rows.append(row)
            self._dec_key = None

    def _set_table(self, row: int, rid: Hashable, num_tokens: int) -> list[int]:
        table = list(self.table_for(rid, num_tokens)[: self._width])
        full = table + [self.pad_block] * (self._width - len(table))  # no stale tail after a preemption
        self.tables[row] = torch.tensor(full, dtype=_I64)
        return table

    def _decode_rows(self, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rids, offsets = plan.decode_rids, plan.decode_offsets
        key = (rids, offsets)
        if self._dec_key is None or self._dec_key[0] is not rids or self._dec_key[1] is not offsets:
            self._dec_rows = torch.tensor([self._row[r] for r in rids], dtype=_I64)
            self._dec_off = torch.tensor(offsets, dtype=_I64)
            self._dec_key = key
        return self._dec_rows, self._dec_off

    def build(
        self, plan: Any, token_ids: Callable[[Hashable], Sequence[int]], skip: frozenset[Hashable] = frozenset()
    ) -> tuple[FlatBatch, list[Hashable], torch.Tensor] | None:
        """Build the FlatBatch of `plan` (a StepPlan).

        Args:
            token_ids: a request's tokens so far (prompt, then generated), for its prefill chunks.
            skip: rids to leave out (aborted while in the plan).

        Returns:
            (batch on the device, the rids that sample a token in logits-row order, their rows
            [S] int64 on the CPU for `record`), or None when nothing is left to run.
        """
        bs = self.block_size
        rows, offs = self._decode_rows(plan)
        if skip and plan.num_decodes:
            keep = torch.tensor([r not in skip for r in plan.decode_rids], dtype=torch.bool)
            rows, offs = rows[keep], offs[keep]
        b = int(rows.shape[0])
        starts = offs + plan.step
        zero: list[torch.Tensor] = []
        if b:
            new_block = (starts % bs == 0).nonzero().squeeze(1)
            for i in new_block.tolist():  # a decode that starts a block: its table grows
                row = int(rows[i])
                self._set_table(row, self._rid_of[row], int(starts[i]) + 1)
            blk = starts // bs
            slots = self.tables[rows, blk] * bs + starts % bs
            zero.append(self.tables[rows[new_block], blk[new_block]])
            sampled = [self._rid_of[r] for r in rows.tolist()] if skip else list(plan.decode_rids)
        else:
            slots = torch.zeros(0, dtype=_I64)
            sampled = []
        ids: list[int] = []
        pos: list[torch.Tensor] = [starts]
        slot_parts = [slots]
        chunk_rows: list[int] = []
        chunk = ([], [], [], [])  # row0, n, start, tables
        logit_rows = list(range(b))
        for c in plan.prefills:
            if c.rid in skip:
                continue
            row = self._row_of(c.rid)
            end = c.start + c.num_tokens
            table = self._set_table(row, c.rid, end)
            ids.extend(token_ids(c.rid)[c.start:end])
            p = torch.arange(c.start, end, dtype=_I64)
            pos.append(p)
            t = torch.tensor(table[: -(-end // bs)], dtype=_I64)
            slot_parts.append(t[p // bs] * bs + p % bs)
            zero.append(torch.tensor(_first_write_blocks(c.start, end, table, bs), dtype=_I64))
            r0 = b + sum(chunk[1])
            for lst, v in zip(chunk, (r0, c.num_tokens, c.start, t), strict=True):
                lst.append(v)
            if c.is_last:
                logit_rows.append(r0 + c.num_tokens - 1)
                chunk_rows.append(row)
                sampled.append(c.rid)
        if not b and not chunk[0]:
            return None
        groups = []
        if b:
            nb = int(starts.max()) // bs + 1
            # Blocks past a decode's own context (handed out ahead, maybe never written) read as pad.
            tables = self.tables[rows, :nb]
            past = torch.arange(nb, dtype=_I64)[None, :] > blk[:, None]
            groups.append(_group(torch.arange(b, dtype=_I64), torch.ones(b, dtype=_I64), starts,
                                 tables.masked_fill_(past, self.pad_block)))
        if chunk[0]:
            width = max(len(t) for t in chunk[3])
            tables = torch.full((len(chunk[3]), width), self.pad_block, dtype=_I64)
            for i, t in enumerate(chunk[3]):
                tables[i, : len(t)] = t
            groups.append(_group(torch.tensor(chunk[0], dtype=_I64), torch.tensor(chunk[1], dtype=_I64),
                                 torch.tensor(chunk[2], dtype=_I64), tables))
        tok = self.last_token[rows]
        if ids:
            tok = torch.cat([tok, torch.tensor(ids, dtype=_I64)])
        batch = FlatBatch(tok, torch.cat(pos), torch.cat(slot_parts), torch.cat(zero),
                          torch.tensor(logit_rows, dtype=_I64), tuple(groups))
        sample_rows = torch.cat([rows, torch.tensor(chunk_rows, dtype=_I64)]) if chunk_rows else rows
        return batch.to(self.device), sampled, sample_rows

    def record(self, sample_rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store the tokens sampled this step ([S] int64, any device) as the rows' last tokens."""
        self.last_token[sample_rows] = tokens.to("cpu", _I64)
