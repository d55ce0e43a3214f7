"""The top-level package's public names: sorted, complete, and all importable."""

from __future__ import annotations

import stallfree
import stallfree.core


def test_all_is_sorted_and_importable():
    """stallfree.__all__ and stallfree.core.__all__ are sorted and every name resolves."""
    for module in (stallfree, stallfree.core):
        names = [n for n in module.__all__ if not n.startswith("__")]
        assert names == sorted(names)
        for name in module.__all__:
            assert getattr(module, name) is not None


def test_top_level_exports_the_public_core():
    """The names DESIGN.md promises at the top level are there and are the core's objects."""
    promised = {
        "Request",
        "Scheduler",
        "SchedulerConfig",
        "PagedScheduler",
        "StepPlan",
        "ScheduledChunk",
        "RequestStatus",
        "RequestRejected",
    }
    assert promised <= set(stallfree.__all__)
    for name in promised:
        assert getattr(stallfree, name) is getattr(stallfree.core, name)
    assert issubclass(stallfree.RequestRejected, ValueError)
