"""The paged checker's historical import path: its rules are a part of stallfree.core.invariants.

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from stallfree.core.invariants import PagedInvariantChecker, PagedInvariantViolation

__all__ = ["PagedInvariantChecker", "PagedInvariantViolation"]
