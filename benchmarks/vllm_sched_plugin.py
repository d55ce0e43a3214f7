"""A pytest plugin that runs vLLM's scheduler tests against stallfree's vLLM scheduler classes.

Loaded by benchmarks/vllm_scheduler_tests.py (`-p vllm_sched_plugin`, this folder on PYTHONPATH) inside the
environment of benchmarks/vllm_cpu/make_env.sh. It replaces the names `Scheduler` and `AsyncScheduler` in vLLM's
`tests.v1.core.utils` and in each test module with stallfree.integrations.vllm.SyncScheduler and Scheduler
(monkeypatch, undone after each test), and writes one JSON line per test to $STALLFREE_VLLM_REPORT:
its node id, outcome, whether our class was built, and whether building it was refused as unsupported.
Without $STALLFREE_VLLM_SWAP=1 nothing is replaced (vLLM's own run), and `built` says whether the test built
vLLM's scheduler.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_STATE: dict[str, Any] = {"built": 0, "refused": 0}
_SWAP = os.environ.get("STALLFREE_VLLM_SWAP") == "1"


def _count_builds(cls: type) -> None:
    """Wrap cls.__init__ so that each construction (and each refusal) is counted."""
    orig = cls.__dict__["__init__"]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        _STATE["built"] += 1
        try:
            orig(self, *args, **kwargs)
        except Exception as exc:
            if "does not support" in str(exc):
                _STATE["refused"] += 1
            raise

    cls.__init__ = init  # type: ignore[misc]


def _count_request_refusals(cls: type) -> None:
    """Wrap cls.add_request so that a request our class refuses (a feature it does not support) is counted."""
    orig = cls.__dict__["add_request"]

    def add_request(self: Any, request: Any) -> None:
        orig(self, request)
        err = self.grammar_compile_error_reqs.get(request.request_id)
        if err is not None and "does not support" in err.message:
            _STATE["refused"] += 1

    cls.add_request = add_request  # type: ignore[attr-defined]


if _SWAP:
    import stallfree.integrations.vllm as sv

    _count_builds(sv.SyncScheduler)
    _count_request_refusals(sv.SyncScheduler)
else:
    from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

    _count_builds(_VllmScheduler)


@pytest.fixture(autouse=True)
def _stallfree_scheduler(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    _STATE["built"] = 0
    _STATE["refused"] = 0
    if not _SWAP:
        return
    import tests.v1.core.utils as utils

    for mod in (utils, request.module):
        if hasattr(mod, "Scheduler"):
            monkeypatch.setattr(mod, "Scheduler", sv.SyncScheduler)
        if hasattr(mod, "AsyncScheduler"):
            monkeypatch.setattr(mod, "AsyncScheduler", sv.Scheduler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    rep = outcome.get_result()
    path = os.environ.get("STALLFREE_VLLM_REPORT")
    if not path:
        return
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        line = {
            "test": item.nodeid, "outcome": rep.outcome, "built": _STATE["built"] > 0,
            "refused": _STATE["refused"] > 0,
            "error": (str(call.excinfo.value)[:300] if call.excinfo is not None else ""),
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
