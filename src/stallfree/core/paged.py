"""The paged-KV scheduler's historical import path: PagedScheduler is Scheduler(kv_policy="paged").

Imports allowed: the standard library and stallfree.core only.
"""

from __future__ import annotations

from stallfree.core.kv import check_watermark
from stallfree.core.scheduler import PagedScheduler

__all__ = ["PagedScheduler", "check_watermark"]
