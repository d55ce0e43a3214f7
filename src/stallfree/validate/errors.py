"""The error of a data file that `stallfree validate` reads but cannot use.

Imports allowed: the standard library and stallfree.core.
"""

from __future__ import annotations

from stallfree.core.errors import StallfreeError

__all__ = ["ValidateDataError"]


class ValidateDataError(StallfreeError, ValueError):
    """A measured run, a silicon CSV or a vllm bench result was opened, but its contents are malformed
    or of no known format (not UTF-8, not JSON, a missing field or column, a bad value); the message
    names the file and, where there is one, the line and field. `stallfree validate` exits 1 for it (a
    data error), and 2 for a missing or unopenable path or a bad option (a ValueError)."""
