"""Giving freed memory back to the system between the phases of a large run.

Imports allowed: the standard library (ctypes only when first needed: it is not loaded at start-up).

CPython frees a large array's buffer with the C library's free(); glibc keeps freed memory in the
middle of its heap (and up to its trim threshold at the top, which grows with the largest blocks
freed) in the process, so a run's peak resident memory would count what its earlier phases freed
(the replicas' step arrays once merged; the summary's pieces of inter-token gaps). give_back()
asks glibc to return it (malloc_trim: whole free pages, by madvise). map_large_blocks() (called
when a cluster run starts) has glibc give large blocks pages of their own, so that they never leave
holes in its heap at all.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["give_back", "map_large_blocks"]

_trim: list[Any] = []  # [malloc_trim or None], once looked up
_mallopt: list[Any] = []  # [mallopt or None], once looked up

#: glibc's mallopt parameter M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3
#: Blocks of at least this many bytes get pages of their own (map_large_blocks), bytes.
LARGE_BLOCK = 128 * 1024


def _libc_fn(name: str) -> Any:
    """The C library's function `name` (glibc on Linux), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def map_large_blocks(threshold: int = LARGE_BLOCK) -> None:
    """Have glibc give every block of at least `threshold` bytes pages of its own (mallopt's
    M_MMAP_THRESHOLD), for the rest of the process; nothing elsewhere.

    glibc otherwise raises that threshold as large blocks are freed (up to 32 MB), after which the
    step arrays of a cluster's replicas (a few MB each, growing by realloc) and the summary's pieces
    are carved from the middle of its heap, whose holes stay resident: with pages of their own, an
    array grows in place (mremap, no copy) and a freed block goes back to the system at once. The
    figures are the same; only where the memory comes from changes.

    Raises:
        ValueError: threshold < 4096 (a page) or above 2**31 - 1.
    """
    if not 4096 <= threshold < 2**31:
        raise ValueError(f"threshold must be 4096 to 2**31 - 1 bytes, got {threshold!r}")
    if not _mallopt:
        _mallopt.append(_libc_fn("mallopt"))
    if _mallopt[0] is not None:
        _mallopt[0](_M_MMAP_THRESHOLD, threshold)


def give_back() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim(0)); nothing elsewhere."""
    if not _trim:
        _trim.append(_libc_fn("malloc_trim"))
    if _trim[0] is not None:
        _trim[0](0)
