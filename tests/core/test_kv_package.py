"""The KV package's layout: every name stallfree.core.kv exported as one module still imports, the CPU tier
under its former path too, and the tier reaches the pool only through its public members."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import stallfree.core.kv as kv
from stallfree.core.kv import tier

# stallfree.core.kv's __all__ when it was one module.
FORMER_NAMES = ["NO_HIT", "NO_TRANSFERS", "BlockPool", "CachingBlockPool", "KVManager", "PagedKV", "PrefixCacheStats",
                "PrefixCacheView", "ReservationKV", "Transfers", "KV_POLICIES", "blocks_for_tokens", "build_kv_manager",
                "check_kv_options", "check_watermark"]


def test_every_former_name_imports_from_the_package():
    """Each former name is in the package's __all__ and resolves; __all__ holds nothing that does not."""
    assert set(FORMER_NAMES) <= set(kv.__all__)
    assert all(getattr(kv, n) is not None for n in kv.__all__)


def test_the_tier_keeps_its_module_path():
    """stallfree.core.kv_tier names the very classes of stallfree.core.kv.tier (monkeypatching one patches both)."""
    old = importlib.import_module("stallfree.core.kv_tier")
    assert [getattr(old, n) for n in old.__all__] == [getattr(tier, n) for n in old.__all__]


@pytest.mark.pure_python
def test_the_tier_uses_only_the_pools_public_members():
    """No private field or method of BlockPool/CachingBlockPool is named in kv/tier.py."""
    private = {"_cached", "_hash_of", "_refs", "_evictable", "_promised", "_pin", "_take", "_drop", "_evict_into"}
    text = inspect.getsource(tier)
    assert sorted({m[1:] for m in re.findall(r"\.(_\w+)", text)} & private) == []


def test_the_two_managers_share_their_figures():
    """kv_free, the block counts and the cache view are written once, in PooledKV, for both managers."""
    for name in ("kv_free", "num_free_blocks", "num_used_blocks", "num_evictable_blocks", "num_evictions",
                 "free_block_ids", "cache_view", "step_transfers"):
        assert name not in vars(kv.ReservationKV) and name not in vars(kv.PagedKV), name
        assert name in vars(kv.PooledKV)
    r = kv.ReservationKV(100, 4)  # 25 units of 4 tokens
    p = kv.PagedKV(25, 4, 0.0)
    assert (r.kv_free, r.num_free_blocks, p.kv_free, p.num_free_blocks) == (100, 25, 100, 25)
