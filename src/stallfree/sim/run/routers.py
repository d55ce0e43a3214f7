"""Routers: how a group of replicas shares the requests arriving at it (one `route` method each), and
their names for the command line.

Imports allowed: the standard library, stallfree.core and stallfree.sim (result, replica, loop).

A router sees each replica as stallfree.sim.run.replica.Replica shows it (num_outstanding, kv_free,
pending, cached_prefix_len) as of its last completed step plus the requests routed to it since.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from stallfree.core.request import Request
from stallfree.sim.defaults import (
    DEFAULT_ADAPTER_SLOTS,
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_AFFINITY_LOAD_MARGIN,
    DEFAULT_PREFIX_THRESHOLD,
    DEFAULT_ROUTER_SEED,
    DEFAULT_SESSION_LOAD_FACTOR,
    DEFAULT_SESSION_LOAD_MARGIN,
    ROUTERS,
)
from stallfree.sim.run.loop import Router
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import ClusterError

__all__ = [
    "DEFAULT_ADAPTER_SLOTS",
    "DEFAULT_AFFINITY_LOAD_FACTOR",
    "DEFAULT_AFFINITY_LOAD_MARGIN",
    "DEFAULT_PREFIX_THRESHOLD",
    "DEFAULT_ROUTER_SEED",
    "DEFAULT_SESSION_LOAD_FACTOR",
    "DEFAULT_SESSION_LOAD_MARGIN",
    "ROUTERS",
    "AdapterAffinityRouter",
    "LeastKVRouter",
    "LeastOutstandingRouter",
    "PrefixAffinityRouter",
    "RandomRouter",
    "RoundRobinRouter",
    "Router",
    "SessionAffinityRouter",
    "VllmDPRouter",
    "make_router",
]


@dataclass(slots=True)
class RoundRobinRouter:
    """Replicas 0, 1, ..., N-1, 0, ... in arrival order."""

    #: Reads no replica figure but num_outstanding: the event loop may leave a replica in a run of
    #: plain decode steps unvisited until a request could finish (Replica.wake_at).
    reads_only_outstanding = True

    cursor: int = 0

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the next replica in turn."""
        k = self.cursor % len(replicas)
        self.cursor += 1
        return k


@dataclass(slots=True)
class LeastOutstandingRouter:
    """The replica with the fewest unfinished requests; ties go to the lowest index."""

    #: Reads no replica figure but num_outstanding: the event loop may leave a replica in a run of
    #: plain decode steps unvisited until a request could finish (Replica.wake_at).
    reads_only_outstanding = True

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the least loaded replica."""
        return self.pick_by_outstanding([r.num_outstanding for r in replicas])

    @staticmethod
    def pick_by_outstanding(loads: list[int]) -> int:
        """The choice from the replicas' num_outstanding alone (`loads`, index order): the first of the
        least, the lowest index. A router with this method lets the caller that has read the loads
        already (the imbalance figures) pass them rather than have route read them again."""
        return loads.index(min(loads))


@dataclass(slots=True)
class VllmDPRouter:
    """vLLM's data-parallel load balancing in its front end: the replica with the least
    4 x waiting + running requests; ties go to the lowest index (vLLM starts its scan at the API
    server's index, 0 with one server). Source: vllm/v1/engine/core_client.py,
    DPLBAsyncMPClient.get_core_engine_for_request (Apache-2.0). vLLM reads the counts from the
    engines' stats, published about every 100 ms, and adds each request it routes to the chosen
    engine's waiting count meanwhile; here the counts are exact at the arrival, and the requests
    routed to a replica since its last step count as waiting (the same local increment)."""

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the replica with the least 4 x waiting + running."""

        def score(k: int) -> int:
            r = replicas[k]
            waiting = r.num_waiting
            return 4 * waiting + max(r.num_outstanding - waiting, 0)

        return min(range(len(replicas)), key=lambda k: (score(k), k))


@dataclass(slots=True)
class LeastKVRouter:
    """The replica with the most free KV (tokens, as of its last step, less what the requests
    already routed to it but not yet admitted will reserve: prompt_len + max_new each); ties go to
    the lowest index."""

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the replica with the most free KV."""

        def free(k: int) -> int:
            r = replicas[k]
            return r.kv_free - sum(p.prompt_len + p.max_new for p in r.pending)

        return min(range(len(replicas)), key=lambda k: (-free(k), k))


@dataclass(slots=True)
class PrefixAffinityRouter:
    """The replica holding the longest cached prefix of the request, among the replicas not too
    loaded, if it holds more than `threshold` tokens of it; otherwise the least loaded
    (LeastOutstandingRouter). Equal prefixes go to the less loaded replica, then the lower index
    (so that replicas holding the same prefix share its requests).

    Load cap: with `low` the fewest unfinished requests on any replica, a replica may win on its
    cache only while its unfinished requests are <= max(load_factor x low, low + load_margin).
    Without it, every request sharing a popular prefix piles onto the one replica that cached it
    first (on the Mooncake trace, 2,986 of 3,000 requests onto one of 4 replicas: docs/cluster.md).
    load_factor = inf (or load_margin large) turns the cap off. Without prefix caching every
    replica holds 0 tokens, so it routes as least-outstanding.

    Args:
        threshold: cached-prefix tokens needed to win, >= 0.
        load_factor: the relative cap, >= 1 (may be math.inf).
        load_margin: the absolute cap, requests, >= 0.

    Raises:
        ClusterError: threshold < 0, load_factor < 1 (or nan), load_margin < 0.
    """

    threshold: int = DEFAULT_PREFIX_THRESHOLD
    load_factor: float = DEFAULT_AFFINITY_LOAD_FACTOR
    load_margin: int = DEFAULT_AFFINITY_LOAD_MARGIN
    fallback: LeastOutstandingRouter = field(default_factory=LeastOutstandingRouter)

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 0:
            raise ClusterError(f"prefix-affinity threshold must be an integer >= 0 tokens, got {self.threshold!r}")
        f = self.load_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1:
            raise ClusterError(f"prefix-affinity load factor must be a number >= 1, got {f!r}")
        m = self.load_margin
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ClusterError(f"prefix-affinity load margin must be an integer >= 0 requests, got {m!r}")

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the replica under the load cap with the longest cached prefix over the threshold,
        else the least loaded."""
        low = min(r.num_outstanding for r in replicas)
        cap = math.inf if self.load_factor == math.inf else max(low * self.load_factor, low + self.load_margin)
        best, best_len = -1, self.threshold
        for k, r in enumerate(replicas):
            if r.num_outstanding > cap:
                continue
            n = r.cached_prefix_len(request)
            if n > best_len or (n == best_len and best >= 0 and r.num_outstanding < replicas[best].num_outstanding):
                best, best_len = k, n
        return best if best >= 0 else self.fallback.route(request, replicas)


@dataclass(slots=True)
class SessionAffinityRouter:
    """Each session's turns to the replica its first turn went to (the one that holds its history's
    KV), unless that replica is overloaded; a session's first turn, and a turn whose replica is
    overloaded, go to the least loaded replica (LeastOutstandingRouter), which the session then
    follows.

    Overloaded, the stated rule: with `low` the fewest unfinished requests on any replica, the
    session's replica has more than max(load_factor x low, low + load_margin) unfinished requests,
    the shape of PrefixAffinityRouter's load cap with looser defaults (2 and 16 requests:
    DEFAULT_SESSION_LOAD_FACTOR, DEFAULT_SESSION_LOAD_MARGIN). The session
    of each request comes from `sessions` (a session workload's per-turn session index, set by the
    session run: stallfree.sim.inputs.sessions.run_sessions); without it every request is its own session,
    so the router routes as least-outstanding.

    Args:
        load_factor: the relative cap, >= 1 (may be math.inf: never move a session).
        load_margin: the absolute cap, requests, >= 0.

    Raises:
        ClusterError: load_factor < 1 (or nan), load_margin < 0.
    """

    load_factor: float = DEFAULT_SESSION_LOAD_FACTOR
    load_margin: int = DEFAULT_SESSION_LOAD_MARGIN
    sessions: Sequence[int] = ()
    home: dict[int, int] = field(default_factory=dict)
    fallback: LeastOutstandingRouter = field(default_factory=LeastOutstandingRouter)
    #: Turns moved off their session's replica by the load cap.
    num_moved: int = 0

    def __post_init__(self) -> None:
        f = self.load_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1:
            raise ClusterError(f"session-affinity load factor must be a number >= 1, got {f!r}")
        m = self.load_margin
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ClusterError(f"session-affinity load margin must be an integer >= 0 requests, got {m!r}")

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the session's replica while it is not overloaded, else the least loaded one."""
        rid = request.rid
        if not isinstance(rid, int) or not 0 <= rid < len(self.sessions):
            return self.fallback.route(request, replicas)
        s = self.sessions[rid]
        k = self.home.get(s)
        if k is not None and k < len(replicas):
            low = min(r.num_outstanding for r in replicas)
            cap = math.inf if self.load_factor == math.inf else max(low * self.load_factor, low + self.load_margin)
            if replicas[k].num_outstanding <= cap:
                return k
            self.num_moved += 1
        k = self.fallback.route(request, replicas)
        self.home[s] = k
        return k


@dataclass(slots=True)
class RandomRouter:
    """A replica drawn uniformly with Python's random.Random(seed): the same seed, the same routes."""

    #: Reads no replica figure but num_outstanding: the event loop may leave a replica in a run of
    #: plain decode steps unvisited until a request could finish (Replica.wake_at).
    reads_only_outstanding = True

    seed: int = DEFAULT_ROUTER_SEED
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return a uniformly drawn replica."""
        return self.rng.randrange(len(replicas))


@dataclass(slots=True)
class AdapterAffinityRouter:
    """LoRA adapter affinity: a request goes to a replica that holds its adapter, so that adapters are
    loaded on few replicas rather than on all of them.

    Each replica is taken to hold the last `slots` distinct adapters routed to it (the router's own
    record, least recently routed out first: what a replica with `slots` GPU slots keeps under LRU when
    it runs what it is sent). Among the replicas under the load cap that hold the request's adapter the
    least loaded wins (then the lower index); when none does, or the request has no adapter, the least
    loaded replica (LeastOutstandingRouter). The load cap is PrefixAffinityRouter's: with `low` the fewest
    unfinished requests on any replica, a replica may win on its adapter only while its unfinished
    requests are <= max(load_factor x low, low + load_margin), so a popular adapter spreads over more
    replicas as it loads them rather than piling onto one. The rule has the shape of the LoRA affinity
    of Kubernetes' Gateway API inference extension (prefer a server with the adapter active, else one
    with room), with the load cap in place of its queue-depth thresholds.

    Args:
        slots: adapters per replica, >= 1 (the replicas' max_loras).
        load_factor: the relative cap, >= 1 (may be math.inf).
        load_margin: the absolute cap, requests, >= 0.

    Raises:
        ClusterError: slots < 1, load_factor < 1 (or nan), load_margin < 0.
    """

    slots: int = DEFAULT_ADAPTER_SLOTS
    load_factor: float = DEFAULT_AFFINITY_LOAD_FACTOR
    load_margin: int = DEFAULT_AFFINITY_LOAD_MARGIN
    fallback: LeastOutstandingRouter = field(default_factory=LeastOutstandingRouter)
    held: list[OrderedDict[Hashable, None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ClusterError(f"adapter-affinity slots must be an integer >= 1, got {self.slots!r}")
        PrefixAffinityRouter(0, self.load_factor, self.load_margin)  # the same checks of the load cap

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        """Return the least loaded replica under the cap holding the request's adapter, else the least loaded."""
        if len(self.held) != len(replicas):
            self.held = [OrderedDict() for _ in replicas]
        lora = request.lora
        if lora is None:
            return self.fallback.route(request, replicas)
        low = min(r.num_outstanding for r in replicas)
        cap = math.inf if self.load_factor == math.inf else max(low * self.load_factor, low + self.load_margin)
        best = -1
        for k, r in enumerate(replicas):
            if lora in self.held[k] and r.num_outstanding <= cap and (
                    best < 0 or r.num_outstanding < replicas[best].num_outstanding):
                best = k
        if best < 0:
            best = self.fallback.route(request, replicas)
        held = self.held[best]
        held[lora] = None
        held.move_to_end(lora)
        if len(held) > self.slots:
            held.popitem(last=False)
        return best


def make_router(
    name: str,
    seed: int = DEFAULT_ROUTER_SEED,
    threshold: int = DEFAULT_PREFIX_THRESHOLD,
    load_factor: float | None = None,
    load_margin: int | None = None,
    adapter_slots: int = DEFAULT_ADAPTER_SLOTS,
) -> Router:
    """Build a router by name (one of ROUTERS).

    Args:
        name: the router.
        seed: random: the RNG seed.
        threshold: prefix-affinity: tokens of cached prefix needed to win, >= 0.
        load_factor, load_margin: prefix-affinity, session-affinity and adapter-affinity: their load
            cap (PrefixAffinityRouter, SessionAffinityRouter, AdapterAffinityRouter); None: the router's
            default.
        adapter_slots: adapter-affinity: adapters per replica (the replicas' max_loras).

    Raises:
        ClusterError: an unknown name, or a prefix-affinity option out of range.
    """
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "least-outstanding":
        return LeastOutstandingRouter()
    if name == "least-kv":
        return LeastKVRouter()
    if name == "prefix-affinity":
        return PrefixAffinityRouter(threshold, DEFAULT_AFFINITY_LOAD_FACTOR if load_factor is None else load_factor,
                                    DEFAULT_AFFINITY_LOAD_MARGIN if load_margin is None else load_margin)
    if name == "random":
        return RandomRouter(seed)
    if name == "vllm-dp":
        return VllmDPRouter()
    if name == "session-affinity":
        return SessionAffinityRouter(DEFAULT_SESSION_LOAD_FACTOR if load_factor is None else load_factor,
                                     DEFAULT_SESSION_LOAD_MARGIN if load_margin is None else load_margin)
    if name == "adapter-affinity":
        return AdapterAffinityRouter(adapter_slots,
                                     DEFAULT_AFFINITY_LOAD_FACTOR if load_factor is None else load_factor,
                                     DEFAULT_AFFINITY_LOAD_MARGIN if load_margin is None else load_margin)
    raise ClusterError(f"unknown router {name!r} (choose from {', '.join(ROUTERS)})")
