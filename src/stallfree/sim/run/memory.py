"""Giving freed memory back to the system between the phases of a large run.

Imports allowed: the standard library (ctypes only when first needed: it is not loaded at start-up).

CPython frees a large array's buffer with the C library's free(); glibc keeps freed memory in the
middle of its heap (and up to its trim threshold at the top, which grows with the largest blocks
freed) in the process, so a run's peak resident memory would count what its earlier phases freed
(the replicas' step arrays once merged; the summary's pieces of inter-token gaps). give_back()
asks glibc to return it (malloc_trim: whole free pages, by madvise).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["give_back"]

_trim: list[Any] = []  # [malloc_trim or None], once looked up


def give_back() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim(0)); nothing elsewhere."""
    if not _trim:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                fn = None
        _trim.append(fn)
    if _trim[0] is not None:
        _trim[0](0)
