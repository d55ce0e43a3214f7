"""The CPU KV tier under its former module path: the code lives in stallfree.core.kv.tier.

Imports allowed: the standard library and stallfree.core only.
"""

from stallfree.core.kv.tier import CpuTier, CpuTierView, TieredBlockPool, TieredKV, TierStats

__all__ = ["CpuTier", "CpuTierView", "TierStats", "TieredBlockPool", "TieredKV"]
