"""The checks of Scheduler(...)'s KV keywords: which policies exist, and what each keyword may be.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

import math

from stallfree.core.errors import InvalidConfig, check_positive_int

__all__ = ["KV_POLICIES", "check_kv_options", "check_watermark"]


def check_watermark(value: object) -> float:
    """Return `value` as a float if it is a real number with 0 <= value < 1 (bools excluded).

    Raises:
        InvalidConfig: otherwise; the message names `watermark` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfig(f"watermark must be a number in [0, 1), got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and 0 <= value < 1):
        raise InvalidConfig(f"watermark must be a number in [0, 1), got {value!r}")
    return float(value)



#: The KV policies of Scheduler(kv_policy=...).
KV_POLICIES = ("reserve", "paged")


def check_kv_options(
    kv_policy: object, block_size: object, align_chunks: object, watermark: object, enable_prefix_caching: object
) -> tuple[bool, float]:
    """Validate the KV keywords of Scheduler(...) and resolve align_chunks' default.

    Args:
        kv_policy: "reserve" or "paged".
        block_size: tokens per block, an integer >= 1, or None (not allowed under "paged").
        align_chunks: None (on for "reserve" with a block_size, off for "paged"), True or False.
        watermark: 0 <= watermark < 1.
        enable_prefix_caching: True (needs "paged") or False.

    Returns:
        (align_chunks, watermark as a float).

    Raises:
        InvalidConfig: any of these out of range; the message names the keyword and the value.
    """
    if kv_policy not in KV_POLICIES:
        raise InvalidConfig(f"kv_policy must be 'reserve' or 'paged', got {kv_policy!r}")
    if kv_policy == "paged" and block_size is None:
        raise InvalidConfig("kv_policy='paged' needs a block_size (tokens per KV block), got None")
    if align_chunks not in (None, True, False):
        raise InvalidConfig(f"align_chunks must be None, True or False, got {align_chunks!r}")
    if align_chunks and block_size is None:
        raise InvalidConfig("align_chunks=True needs a block_size, got None")
    wm = check_watermark(watermark)
    if not isinstance(enable_prefix_caching, bool):
        raise InvalidConfig(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
    if enable_prefix_caching and kv_policy != "paged":
        raise InvalidConfig(
            f"enable_prefix_caching=True needs kv_policy='paged' (cached blocks are shared block-table "
            f"entries), got kv_policy={kv_policy!r}"
        )
    if block_size is not None:
        check_positive_int("block_size", block_size)
    if align_chunks is None:
        return kv_policy == "reserve" and block_size is not None, wm
    return bool(align_chunks), wm


