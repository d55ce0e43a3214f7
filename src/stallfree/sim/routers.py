"""Former path of `stallfree.sim.run.routers`, kept for one release: import from the new path.

Routers: how a group of replicas shares the requests arriving at it (one `route` method each), and their names for
the command line. Every public name this module had is re-exported from where it lives now; the module goes in the
next release.
"""

from stallfree.sim.run.loop import Router
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import ClusterError
from stallfree.sim.run.routers import (
    DEFAULT_ADAPTER_SLOTS,
    DEFAULT_AFFINITY_LOAD_FACTOR,
    DEFAULT_AFFINITY_LOAD_MARGIN,
    DEFAULT_PREFIX_THRESHOLD,
    DEFAULT_ROUTER_SEED,
    DEFAULT_SESSION_LOAD_FACTOR,
    DEFAULT_SESSION_LOAD_MARGIN,
    ROUTERS,
    AdapterAffinityRouter,
    LeastKVRouter,
    LeastOutstandingRouter,
    PrefixAffinityRouter,
    RandomRouter,
    RoundRobinRouter,
    SessionAffinityRouter,
    VllmDPRouter,
    make_router,
)

__all__ = [
    "AdapterAffinityRouter",
    "ClusterError",
    "DEFAULT_ADAPTER_SLOTS",
    "DEFAULT_AFFINITY_LOAD_FACTOR",
    "DEFAULT_AFFINITY_LOAD_MARGIN",
    "DEFAULT_PREFIX_THRESHOLD",
    "DEFAULT_ROUTER_SEED",
    "DEFAULT_SESSION_LOAD_FACTOR",
    "DEFAULT_SESSION_LOAD_MARGIN",
    "LeastKVRouter",
    "LeastOutstandingRouter",
    "PrefixAffinityRouter",
    "ROUTERS",
    "RandomRouter",
    "Replica",
    "RoundRobinRouter",
    "Router",
    "SessionAffinityRouter",
    "VllmDPRouter",
    "make_router",
]
