"""Prefix caching's pure helper: the chained hashes of a prompt's full KV blocks.

Imports allowed: the standard library only.

The core never sees token ids; an engine (or a trace reader) turns a prompt into one hash per full
block of block_size tokens with `hash_blocks` and hands them to the scheduler in
Request(block_hashes=...). The block pool that keeps computed blocks for reuse is
stallfree.core.kv.CachingBlockPool.

Source: hash-chained KV blocks, a block's key covering its own tokens and (through its parent's
hash) every token before it, as in vLLM's automatic prefix caching (block hash = hash of the parent
hash and the block's tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from stallfree.core.errors import check_positive_int

__all__ = ["hash_blocks"]


def hash_blocks(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Return one chained hash per full block of `token_ids` (the last partial block has none).

    Hash i is the first 16 bytes of SHA-256 over hash i-1 (16 zero bytes for i = 0) and the block's
    token ids (8 bytes each, little endian, signed), read as an unsigned integer; so two prompts get
    equal hash i exactly when (up to a 2**-128 collision chance) their first (i + 1) * block_size
    tokens are equal, and the values are the same in every process (no Python hash seed).

    Args:
        token_ids: the prompt's token ids, integers in [-2**63, 2**63).
        block_size: tokens per KV block, >= 1.

    Returns:
        A tuple of len(token_ids) // block_size integers in [0, 2**128).

    Raises:
        InvalidConfig: block_size is not an integer >= 1.
        ValueError: a token id is not an integer in range; the message gives its position.
    """
    check_positive_int("block_size", block_size)
    out: list[int] = []
    parent = bytes(16)
    n = len(token_ids) // block_size
    for b in range(n):
        h = hashlib.sha256(parent)
        for i in range(b * block_size, (b + 1) * block_size):
            t = token_ids[i]
            if isinstance(t, bool) or not isinstance(t, int) or not -(2**63) <= t < 2**63:
                raise ValueError(f"token_ids[{i}] must be an integer in [-2**63, 2**63), got {t!r}")
            h.update(t.to_bytes(8, "little", signed=True))
        parent = h.digest()[:16]
        out.append(int.from_bytes(parent, "little"))
    return tuple(out)
