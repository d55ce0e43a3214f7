"""Former path of `stallfree.sim.studies.executors`, kept for one release: import from the new path.

Where the simulations of a sweep or a tuning search run: in this process, in a pool of worker processes, or as tasks
on a Ray cluster the user already has. Every public name this module had is re-exported from where it lives now; the
module goes in the next release.
"""

from stallfree.sim.studies.executors import (
    EXECUTORS,
    RAY_CONNECT_TIMEOUT_S,
    RAY_JOIN_TIMEOUT_S,
    Executor,
    ExecutorError,
    ProcessExecutor,
    R,
    RayExecutor,
    SerialExecutor,
    T,
    make_executor,
    reusing_workers,
)

__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorError",
    "ProcessExecutor",
    "R",
    "RAY_CONNECT_TIMEOUT_S",
    "RAY_JOIN_TIMEOUT_S",
    "RayExecutor",
    "SerialExecutor",
    "T",
    "make_executor",
    "reusing_workers",
]
