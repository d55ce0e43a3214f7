"""The KV block pool: ids handed out and taken back, promises, and bad input."""

from __future__ import annotations

import pytest

from stallfree import InvalidConfig, SchedulerStateError
from stallfree.core.kv import BlockPool, blocks_for_tokens


@pytest.mark.parametrize(
    ("tokens", "size", "blocks"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 4, 9), (5, 1, 5)],
    ids=["empty", "one", "full", "one-over", "b21-like", "size-1"],
)
def test_blocks_for_tokens_is_ceiling(tokens, size, blocks):
    """blocks_for_tokens is ceil(tokens / block_size)."""
    assert blocks_for_tokens(tokens, size) == blocks


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_blocks", 0), ("block_size", 0), ("num_blocks", True), ("block_size", 2.0)],
    ids=["blocks-0", "size-0", "blocks-bool", "size-float"],
)
def test_bad_pool_config_names_field(field, value):
    """A pool size that is not an integer >= 1 raises InvalidConfig naming the field and value."""
    kw = {"num_blocks": 8, "block_size": 4, field: value}
    with pytest.raises(InvalidConfig, match=field) as exc:
        BlockPool(**kw)
    assert repr(value) in str(exc.value)


def test_fresh_pool_hands_out_ids_in_order_and_reuses_freed_first():
    """A fresh pool hands out 0, 1, 2, ...; released blocks are handed out again before untouched ones."""
    pool = BlockPool(num_blocks=6, block_size=4)
    a: list[int] = []
    b: list[int] = []
    pool.allocate(a, 2)
    pool.allocate(b, 1)
    assert (a, b, pool.num_free, pool.num_used) == ([0, 1], [2], 3, 3)
    pool.release(a)
    assert a == [] and pool.num_free == 5
    c: list[int] = []
    pool.allocate(c, 3)
    assert c == [0, 1, 3]


def test_allocate_more_than_free_raises_and_changes_nothing():
    """Asking for more blocks than are free raises SchedulerStateError and leaves pool and table alone."""
    pool = BlockPool(num_blocks=3, block_size=4)
    t = [99]
    with pytest.raises(SchedulerStateError, match="4 KV blocks with only 3 free"):
        pool.allocate(t, 4)
    assert t == [99] and pool.num_free == 3 and pool.free_ids() == (2, 1, 0)


def test_promised_blocks_count_as_used_until_claimed_or_released():
    """promise() takes blocks from the free count at once; claim() gives their ids; release() returns the rest."""
    pool = BlockPool(num_blocks=5, block_size=2)
    assert pool.try_promise(3) and pool.num_free == 2 and pool.num_promised == 3
    assert not pool.try_promise(3) and pool.num_free == 2  # refused: nothing changes
    t: list[int] = []
    pool.claim(t, 2)
    assert t == [0, 1] and pool.num_promised == 1 and pool.num_free == 2
    pool.allocate(t, 2)  # the promised block is not handed to someone else
    assert t == [0, 1, 2, 3] and pool.num_free == 0 and pool.num_promised == 1
    with pytest.raises(SchedulerStateError):
        pool.promise(1)
    with pytest.raises(SchedulerStateError, match="2 KV blocks with only 1 promised"):
        pool.claim(t, 2)
    pool.release(t, unclaimed=1)
    assert pool.num_free == 5 and pool.num_promised == 0 and sorted(pool.free_ids()) == [0, 1, 2, 3, 4]
