"""Tests of stallfree.sim.run.routers on their own: routers read only what a Replica shows (load, cached
prefix), so a stand-in replica drives them by hand. The routers inside a cluster run are tested in
test_cluster.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from stallfree.core.request import Request
from stallfree.sim.run.result import ClusterError
from stallfree.sim.run.routers import (
    ROUTERS,
    LeastOutstandingRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    make_router,
)
from stallfree.sim.run.routers import PrefixAffinityRouter as ReexportedRouter


@dataclass
class FakeReplica:
    """What a router reads of a replica: load and cached prefix."""

    num_outstanding: int
    cached: int

    def cached_prefix_len(self, request: Request) -> int:
        """The cached prefix, tokens."""
        return self.cached


def test_prefix_affinity_by_hand():
    """Prefix affinity: the replica with the longest cached prefix over the threshold (256) wins,
    even when busier, while its load is within the cap; at or under the threshold, the least loaded
    wins. The cap with the least loaded replica at `low` requests: max(1.5 x low, low + 4).

    - loads 0, 5, 9 (cap max(0, 4) = 4): neither cache holder is within it: least loaded, 0.
    - loads 3, 5, 9 (cap max(4.5, 7) = 7): replica 1 (300 tokens) is, replica 2 (400) is not: 1.
    - loads 12, 17, 17 (cap max(18, 16) = 18: the factor's): both are, the longer prefix wins: 2.
    - loads 12, 19, 19: cap 18, neither: replica 0.
    - cap off (load_factor inf): loads 0, 5, 9: the longest prefix, 2.
    - 256 tokens is not over the threshold, nor 100: the least loaded, replica 2.
    - factor 2, margin 0, loads 3, 6, 7: cap 6: replica 1.
    - equal prefixes (300 each) at loads 0, 2, 1: the less loaded of the two within the cap, 2; at
      loads 0, 1, 1: the lower index, 1.
    """
    req = Request(0, 1000, 10)
    router = PrefixAffinityRouter()
    assert router.route(req, [FakeReplica(0, 0), FakeReplica(5, 300), FakeReplica(9, 400)]) == 0
    assert router.route(req, [FakeReplica(3, 0), FakeReplica(5, 300), FakeReplica(9, 400)]) == 1
    assert router.route(req, [FakeReplica(12, 0), FakeReplica(17, 300), FakeReplica(17, 400)]) == 2
    assert router.route(req, [FakeReplica(12, 0), FakeReplica(19, 300), FakeReplica(19, 400)]) == 0
    uncapped = PrefixAffinityRouter(load_factor=math.inf)
    assert uncapped.route(req, [FakeReplica(0, 0), FakeReplica(5, 300), FakeReplica(9, 400)]) == 2
    assert router.route(req, [FakeReplica(3, 0), FakeReplica(5, 256), FakeReplica(1, 100)]) == 2
    assert PrefixAffinityRouter(threshold=50).route(req, [FakeReplica(3, 0), FakeReplica(5, 100)]) == 1
    assert make_router("prefix-affinity", load_factor=2.0, load_margin=0).route(
        req, [FakeReplica(3, 0), FakeReplica(6, 300), FakeReplica(7, 400)]
    ) == 1
    assert router.route(req, [FakeReplica(0, 0), FakeReplica(2, 300), FakeReplica(1, 300)]) == 2
    assert router.route(req, [FakeReplica(0, 0), FakeReplica(1, 300), FakeReplica(1, 300)]) == 1


def test_cluster_module_reexports_the_routers():
    """The routers moved to stallfree.sim.run.routers; stallfree.sim.run.cluster still exports the same classes."""
    assert ReexportedRouter is PrefixAffinityRouter


def test_round_robin_and_least_outstanding_on_stand_ins():
    """Round robin cycles 0, 1, 2, 0; least outstanding takes the fewest unfinished, ties to the lower index."""
    reps = [FakeReplica(2, 0), FakeReplica(1, 0), FakeReplica(1, 0)]
    rr = RoundRobinRouter()
    assert [rr.route(Request(i, 1, 1), reps) for i in range(4)] == [0, 1, 2, 0]  # type: ignore[arg-type]
    assert LeastOutstandingRouter().route(Request(0, 1, 1), reps) == 1  # type: ignore[arg-type]


def test_an_entry_passes_the_loads_it_read_only_to_a_router_that_routes_by_them() -> None:
    """Entry hands the loads it read for the imbalance ratios to LeastOutstandingRouter.pick_by_outstanding
    (the first of the least), not to a subclass that overrides route nor to a router without the method."""
    from stallfree.sim.run.loop import Entry

    assert LeastOutstandingRouter.pick_by_outstanding([3, 1, 2, 1]) == 1

    class Busiest(LeastOutstandingRouter):
        def route(self, request, replicas):  # type: ignore[no-untyped-def]
            loads = [r.num_outstanding for r in replicas]
            return loads.index(max(loads))

    from stallfree.sim.inputs.workload import Workload
    from stallfree.sim.run.load import Arrivals

    def entry(router):  # type: ignore[no-untyped-def]
        arrivals = Arrivals(Workload((0.0,), (1,), (1,)))
        return Entry([], router, lambda rid: Request(rid, 1, 1), {}, arrivals, track_imbalance=True)

    assert entry(LeastOutstandingRouter())._pick == LeastOutstandingRouter.pick_by_outstanding
    assert entry(Busiest())._pick is None
    assert entry(RoundRobinRouter())._pick is None


def test_make_router_names() -> None:
    """make_router builds each name of ROUTERS and refuses another, naming it."""
    assert [type(make_router(n)).__name__ for n in ROUTERS] == [
        "RoundRobinRouter", "LeastOutstandingRouter", "LeastKVRouter", "PrefixAffinityRouter", "RandomRouter",
        "VllmDPRouter", "SessionAffinityRouter", "AdapterAffinityRouter"]
    with pytest.raises(ClusterError, match="unknown router 'fastest'"):
        make_router("fastest")


def test_vllm_dp_router_by_hand() -> None:
    """vLLM's front end: the least 4 x waiting + running, ties to the lowest index."""
    from stallfree.sim.run.routers import VllmDPRouter, make_router

    @dataclass
    class Rep:
        num_waiting: int
        num_outstanding: int

    r = VllmDPRouter()
    req = Request(rid=0, prompt_len=8, max_new=2)
    assert r.route(req, [Rep(0, 0), Rep(0, 0)]) == 0  # type: ignore[list-item]
    assert r.route(req, [Rep(1, 1), Rep(0, 3)]) == 1  # type: ignore[list-item]  # 4 against 3
    assert r.route(req, [Rep(1, 1), Rep(0, 4)]) == 0  # type: ignore[list-item]  # 4 against 4: the lower
    assert r.route(req, [Rep(0, 5), Rep(1, 1)]) == 1  # type: ignore[list-item]  # 5 against 4
    assert isinstance(make_router("vllm-dp"), VllmDPRouter)
