"""Giving freed memory back to the system between the phases of a large run.

Imports allowed: the standard library.

CPython frees a large array's buffer with the C library's free(); glibc keeps freed memory in the
middle of its heap (and up to its trim threshold at the top, which grows with the largest blocks
freed) in the process, so a run's peak resident memory would count what its earlier phases freed
(the replicas' step arrays once merged; the summary's pieces of inter-token gaps). give_back()
asks glibc to return it (malloc_trim: whole free pages, by madvise).
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["give_back"]

_TRIM = None
if sys.platform.startswith("linux"):
    try:
        _TRIM = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        _TRIM = None


def give_back() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim(0)); nothing elsewhere."""
    if _TRIM is not None:
        _TRIM(0)
