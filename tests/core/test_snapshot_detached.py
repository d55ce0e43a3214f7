"""Scheduler.snapshot() is detached under every option, in both builds: the copy shares no mutable object
with the original, and stepping the copy leaves the original's steps exactly as without it.

Why both checks: in the compiled build a bound method of a compiled object is a built-in method, which
copy.deepcopy keeps as it is, so a view holding one (the prefill and decode hosts, a priority queue's key,
the CPU tier's eviction hook) would make the copy step the original. The walk below finds any such object.
"""

from __future__ import annotations

import gc
import types

import pytest

from stallfree.core import Request, Scheduler

OPTIONS = {
    "reserve": {},
    "paged": {"block_size": 16, "kv_policy": "paged"},
    "prefix caching": {"block_size": 16, "kv_policy": "paged", "enable_prefix_caching": True},
    "cpu tier": {"block_size": 16, "kv_policy": "paged", "enable_prefix_caching": True, "cpu_kv_tokens": 4096},
    "priority": {"policy": "priority", "aging_interval": 5},
    "vtc": {"fairness": "vtc"},
    "speculative": {"num_spec_tokens": 2},
    "partial prefills": {"max_num_partial_prefills": 3, "long_prefill_token_threshold": 32},
    "queue time": {"max_queue_time_s": 50.0, "clock": lambda: 1.0},
}

# Objects a copy may share: values that never change, classes, functions, modules (a module function
# is a built-in method whose __self__ is its module).
_SHAREABLE = (str, int, float, bool, bytes, tuple, frozenset, type, types.FunctionType, types.ModuleType,
              type(None), Request)


def _reachable(root: object, stop: dict[int, object] | None = None) -> dict[int, object]:
    """Every object reachable from `root` by id (gc.get_referents), not walking past those in `stop`."""
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, types.ModuleType | type):
            continue
        seen[id(obj)] = obj
        if stop is None or id(obj) not in stop:
            todo.extend(gc.get_referents(obj))
    return seen


def _shared(obj: object) -> str:
    if isinstance(obj, types.BuiltinMethodType | types.MethodType):
        return f"{type(obj.__self__).__name__}.{obj.__name__}"
    return type(obj).__name__


def _busy(options: dict[str, object], n: int = 12) -> Scheduler:
    s = Scheduler(64, 8, 4096, **options)
    for i in range(n):
        s.add(Request(i, 30 + 7 * i, 20, priority=i % 3, tenant=f"t{i % 2}"))
    for _ in range(3):
        s.complete(s.schedule())
    return s


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_snapshot_shares_no_mutable_object_with_its_original(name):
    s = _busy(OPTIONS[name])
    original = _reachable(s)
    twin = s.snapshot()
    shared = sorted({_shared(o) for k, o in _reachable(twin, stop=original).items()
                     if k in original and not isinstance(o, _SHAREABLE)
                     and not (isinstance(o, types.BuiltinMethodType) and isinstance(o.__self__, types.ModuleType))})
    # RequestStatus members are enum singletons, shared by design.
    assert [x for x in shared if x != "RequestStatus"] == []


@pytest.mark.parametrize("name", list(OPTIONS))
def test_stepping_a_snapshot_leaves_the_original_as_it_was(name):
    """The original's plans, emitted tokens and finishes after a snapshot was stepped (and fed new requests)
    are those of a twin run that never took one."""
    a, b = _busy(OPTIONS[name]), _busy(OPTIONS[name])
    twin = a.snapshot()
    twin.add(Request("extra", 500, 50, tenant="t0"))
    for _ in range(5):
        twin.complete(twin.schedule())
    for _ in range(40):
        pa, pb = a.schedule(), b.schedule()
        assert (pa.decode_rids, [(c.rid, c.start, c.num_tokens) for c in pa.prefills]) == (
            pb.decode_rids, [(c.rid, c.start, c.num_tokens) for c in pb.prefills])
        assert a.complete(pa) == b.complete(pb)
        assert a.last_finished == b.last_finished
    assert a.stats() == b.stats()
