"""The scheduler's block tables as the engine reads them, and the flat batch's slot mapping, checked
against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from stallfree import Request, Scheduler
from stallfree.engine.batch import BatchEntry, build_flat_batch
from stallfree.engine.kv_cache import KVCache

CPU = torch.device("cpu")


def test_scheduler_tables_grow_at_block_boundaries_and_blocks_are_reused():
    """The engine's former allocator's cases on the scheduler's tables (reserve, 4 blocks of 4): a
    table grows only when a token crosses a block boundary, reading it again adds nothing, the pool
    cannot run dry (each request's blocks come out of its own reservation), and a finished request's
    blocks go back and are handed out again."""
    s = Scheduler(8, 2, 16, block_size=4, align_chunks=False)
    s.add(Request("x", 3, 3))  # 3 + 3 = 6 tokens reserved: 2 blocks
    s.add(Request("y", 5, 3))  # 8 tokens: 2 blocks
    table = s.block_table
    assert table is not None
    p = s.schedule()  # x's 3 prompt tokens, y's 5
    assert (table("x"), table("x"), table("y")) == ((0,), (0,), (1, 2)) and s.stats().num_free_blocks == 0
    s.complete(p)
    p = s.schedule()  # x's decode at position 3: still block 0
    assert (table("x"), table("y")) == ((0,), (1, 2))
    s.complete(p)
    p = s.schedule()  # x's decode at position 4: a second block, out of x's reservation
    assert table("x") == (0, 3)
    s.complete(p)  # both finish: every block back
    assert not s.has_unfinished() and sorted(s.free_block_ids()) == [0, 1, 2, 3]
    s.add(Request("z", 4, 1))
    s.schedule()
    assert len(table("z")) == 1 and table("z")[0] in range(4)


def test_flat_batch_slots_positions_and_groups():
    """Two decodes and one chunk: slots follow the block tables; the decodes form one attention
    group and the chunk another; blocks whose first slot is written this step are zeroed first."""
    bs = 4
    entries = [
        BatchEntry([11], 5, [7, 2]),  # position 5 -> block 2, offset 1 -> slot 9
        BatchEntry([12], 0, [3]),  # position 0 -> slot 12; block 3 written first
        BatchEntry([13, 14, 15], 2, [5, 6], "all"),  # positions 2, 3, 4 -> slots 22, 23, 24
    ]
    b = build_flat_batch(entries, bs, CPU, pad_block=9)
    assert b.token_ids.tolist() == [11, 12, 13, 14, 15]
    assert b.positions.tolist() == [5, 0, 2, 3, 4]
    assert b.slot_mapping.tolist() == [9, 12, 22, 23, 24]
    assert b.zero_blocks.tolist() == [3, 6]  # position 0 of block 3, position 4 of block 6
    dec, chunk = b.groups
    assert dec.q_rows.tolist() == [0, 1] and dec.q_pos.tolist() == [[5], [0]]
    assert dec.tables.tolist() == [[7, 2], [3, 9]] and dec.out_index is None
    assert chunk.q_rows.tolist() == [2, 3, 4] and chunk.q_pos.tolist() == [[2, 3, 4]]
    assert chunk.tables.tolist() == [[5, 6]] and chunk.out_rows.tolist() == [2, 3, 4]
    assert b.logits_rows.tolist() == [0, 1, 2, 3, 4]


def test_chunks_of_unequal_length_are_padded():
    """Chunks of 2 and 3 tokens share one group of 3 queries each; the short chunk's padding query
    repeats its last row and position, and only the 5 real queries are written back."""
    b = build_flat_batch([BatchEntry([1, 2], 0, [0]), BatchEntry([3, 4, 5], 4, [1, 2])], 4, CPU,
                         pad_block=8)
    (g,) = b.groups
    assert g.q_rows.tolist() == [0, 1, 1, 2, 3, 4]
    assert g.q_pos.tolist() == [[0, 1, 1], [4, 5, 6]]
    assert g.tables.tolist() == [[0, 8], [1, 2]]
    assert g.out_index.tolist() == [0, 1, 3, 4, 5] and g.out_rows.tolist() == [0, 1, 2, 3, 4]
    assert b.zero_blocks.tolist() == [0, 2]  # position 0 in block 0; position 4 in block 2
    assert b.logits_rows.tolist() == [1, 4]


def test_flat_batch_refuses_short_block_table():
    """An entry whose block table cannot hold its tokens raises naming the counts."""
    with pytest.raises(ValueError, match="holds 4 tokens < 5 needed"):
        build_flat_batch([BatchEntry([1], 4, [0])], 4, CPU)


def test_kv_cache_shape_bytes_and_zero_pad_block():
    """K and V are [L, N + block_size, Hkv, D] with N = blocks * block size usable slots; the pad
    block (id 5) is zeros; bytes count both at 4 B each; zero_blocks zeroes whole blocks."""
    kv = KVCache(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=5, block_size=4,
                 dtype=torch.float32, device=CPU)
    assert tuple(kv.k.shape) == (2, 24, 3, 8) and kv.num_slots == 20 and kv.pad_block == 5
    assert kv.nbytes == 2 * 2 * 24 * 3 * 8 * 4
    assert not kv.k[:, 20:].any() and not kv.v[:, 20:].any()
    kv.k.fill_(float("nan"))
    kv.zero_blocks(torch.tensor([1, 3]))
    assert not kv.k[:, 4:8].any() and not kv.k[:, 12:16].any() and kv.k[:, 8:12].isnan().all()
