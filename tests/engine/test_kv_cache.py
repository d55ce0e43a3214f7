"""The block allocator and the flat batch's slot mapping, checked against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from stallfree.engine.batch import BatchEntry, build_flat_batch
from stallfree.engine.kv_cache import BlockAllocator, KVCache

CPU = torch.device("cpu")


def test_allocator_grows_tables_idempotently_and_frees():
    """ensure() adds blocks only when a block boundary is crossed; free() returns them all."""
    a = BlockAllocator(num_blocks=4, block_size=4)
    assert a.ensure("x", 3) == [0]
    assert a.ensure("x", 4) == [0]
    assert a.ensure("x", 5) == [0, 1]
    assert a.ensure("y", 8) == [2, 3] and a.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="needs 1 more blocks, 0 free of 4"):
        a.ensure("x", 9)
    assert a.table("x") == [0, 1]  # the failed call changed nothing
    a.free("x")
    assert a.num_free_blocks == 2 and a.table("x") == []
    assert a.ensure("z", 1) == [0]


def test_flat_batch_slots_positions_and_masks():
    """Two decodes and one chunk: slots follow the block tables; masks cover each context."""
    bs = 4
    entries = [
        BatchEntry([11], 5, [7, 2]),  # position 5 -> block 2, offset 1 -> slot 9
        BatchEntry([12], 0, [3]),  # position 0 -> slot 12
        BatchEntry([13, 14, 15], 2, [5, 6], "all"),  # positions 2, 3, 4 -> slots 22, 23, 24
    ]
    b = build_flat_batch(entries, bs, CPU)
    assert b.token_ids.tolist() == [11, 12, 13, 14, 15]
    assert b.positions.tolist() == [5, 0, 2, 3, 4]
    assert b.slot_mapping.tolist() == [9, 12, 22, 23, 24]
    assert b.dec_rows.tolist() == [0, 1]
    assert b.dec_slots.tolist() == [[28, 29, 30, 31, 8, 9], [12, 13, 14, 15, 0, 1]]
    assert b.dec_mask.tolist() == [[True] * 6, [True] + [False] * 5]
    (chunk,) = b.chunks
    assert (chunk.q_start, chunk.q_end, chunk.start) == (2, 5, 2)
    assert chunk.ctx_slots.tolist() == [20, 21, 22, 23, 24]
    assert b.logits_rows.tolist() == [0, 1, 2, 3, 4]


def test_flat_batch_refuses_short_block_table():
    """An entry whose block table cannot hold its tokens raises naming the counts."""
    with pytest.raises(ValueError, match="holds 4 tokens < 5 needed"):
        build_flat_batch([BatchEntry([1], 4, [0])], 4, CPU)


def test_kv_cache_shape_and_bytes():
    """K and V are [L, N, Hkv, D]; N = blocks * block size; bytes count both at 4 B each."""
    kv = KVCache(num_layers=2, num_kv_heads=3, head_dim=8, num_blocks=5, block_size=4,
                 dtype=torch.float32, device=CPU)
    assert tuple(kv.k.shape) == (2, 20, 3, 8) and kv.num_slots == 20
    assert kv.nbytes == 2 * 2 * 20 * 3 * 8 * 4
