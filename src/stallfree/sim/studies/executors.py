"""Where the simulations of a sweep or a tuning search run: in this process, in a pool of worker
processes, or as tasks on a Ray cluster the user already has.

Imports allowed: the standard library; ray lazily (an optional extra: pip install "stallfree[ray]").

Every executor maps a picklable function over picklable items and returns the results in the
items' order, so a sweep's rows are the same whichever runs it (only wall-time fields differ).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from stallfree.core.errors import StallfreeError
from stallfree.sim.defaults import EXECUTORS, JOBS_LIMIT

__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorError",
    "ProcessExecutor",
    "RayExecutor",
    "SerialExecutor",
    "make_executor",
    "reusing_workers",
]

T = TypeVar("T")
R = TypeVar("R")


#: Seconds to wait for a Ray head named by --ray-address / RAY_ADDRESS to answer on its port.
RAY_CONNECT_TIMEOUT_S = 3.0
#: Seconds to wait for ray.init to join that head (Ray itself retries for about a minute).
RAY_JOIN_TIMEOUT_S = 5.0


class ExecutorError(StallfreeError, RuntimeError):
    """An executor cannot run: Ray is not installed, or its cluster cannot be reached."""


class Executor(Protocol):
    """Runs fn over items, results in the items' order; `progress(k)` after each k-th finished."""

    name: str

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int], None] | None = None
    ) -> list[R]: ...


class SerialExecutor:
    """Runs every item in this process, one after the other."""

    name = "serial"

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int], None] | None = None
    ) -> list[R]:
        """Return [fn(x) for x in items], calling progress after each."""
        out = []
        for k, item in enumerate(items, start=1):
            out.append(fn(item))
            if progress:
                progress(k)
        return out


class ProcessExecutor:
    """A standard-library pool of `jobs` worker processes (concurrent.futures); default the CPUs, at most
    JOBS_LIMIT (stallfree.sim.defaults).

    Raises:
        ExecutorError: jobs is not an integer from 1 to JOBS_LIMIT.
    """

    name = "process"

    def __init__(self, jobs: int | None = None) -> None:
        jobs = jobs if jobs is not None else min(os.cpu_count() or 1, JOBS_LIMIT)
        if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= JOBS_LIMIT:
            raise ExecutorError(f"jobs must be an integer from 1 to {JOBS_LIMIT:,}, got {jobs!r}")
        self.jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int], None] | None = None
    ) -> list[R]:
        """Run the items in the pool (in this process when one job or one item); in the pool kept open by
        `kept_open`, if any, else in a pool of its own."""
        if self.jobs <= 1 or len(items) <= 1:
            return SerialExecutor().map(fn, items, progress)
        if self._pool is not None:
            return _collect(self._pool, fn, items, progress)
        with ProcessPoolExecutor(max_workers=min(self.jobs, len(items))) as pool:
            return _collect(pool, fn, items, progress)

    @contextmanager
    def kept_open(self) -> Iterator[None]:
        """Within it, every map shares one pool of `jobs` workers, so a search of many small rounds starts
        its workers (their imports, the cost model's tables) once; shut down on exit."""
        if self.jobs <= 1 or self._pool is not None:
            yield
            return
        self._pool = ProcessPoolExecutor(max_workers=self.jobs)
        try:
            yield
        finally:
            pool, self._pool = self._pool, None
            pool.shutdown()

    def __getstate__(self) -> dict[str, Any]:
        return {"jobs": self.jobs}  # a pool does not cross a process boundary

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.jobs, self._pool = state["jobs"], None


def _collect(pool: ProcessPoolExecutor, fn: Callable[[T], R], items: Sequence[T],
             progress: Callable[[int], None] | None) -> list[R]:
    """Submit every item to `pool`; their results in item order, progress after each finishes."""
    out: list[Any] = [None] * len(items)
    futures = {pool.submit(fn, x): k for k, x in enumerate(items)}
    for done, fut in enumerate(as_completed(futures), start=1):
        out[futures[fut]] = fut.result()
        if progress:
            progress(done)
    return out


@contextmanager
def reusing_workers(executor: Any) -> Iterator[None]:
    """Keep a ProcessExecutor's workers for the whole block (ProcessExecutor.kept_open); other
    executors (serial, Ray: its own worker pool) are unchanged."""
    if isinstance(executor, ProcessExecutor):
        with executor.kept_open():
            yield
    else:
        yield


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ExecutorError("`executor`='ray' needs Ray: pip install \"stallfree[ray]\"") from None
    return ray


def _check_reachable(address: str, timeout: float) -> None:
    """Fail fast when `address` names a host:port that does not answer (ray.init would retry for a minute)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ExecutorError(f"`ray_address` wants HOST:PORT, ray://HOST:PORT, 'auto' or 'local', got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ExecutorError(
            f"`ray_address` {address}: no Ray cluster answers there within {timeout:g} s ({exc})"
        ) from None


class RayExecutor:
    """Each item is one Ray task on the cluster at `address` (or RAY_ADDRESS; absent both, a local
    Ray instance started for this run and shut down after it).

    Args:
        address: a Ray address ("HOST:PORT", "ray://HOST:PORT", "auto") or None.
        num_cpus: CPUs of a local instance (None: Ray's default, all of them).
        connect_timeout_s: how long a named head may take to answer, s.

    Raises:
        ExecutorError: Ray is not installed (the message says how to install the extra), or `address`
            names a HOST:PORT that does not answer within connect_timeout_s.
    """

    name = "ray"

    def __init__(
        self, address: str | None = None, num_cpus: int | None = None, connect_timeout_s: float = RAY_CONNECT_TIMEOUT_S
    ) -> None:
        self.ray = _import_ray()
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.num_cpus = num_cpus
        self.timeout = connect_timeout_s
        if self.address:
            _check_reachable(self.address, self.timeout)

    def map(
        self, fn: Callable[[T], R], items: Sequence[T], progress: Callable[[int], None] | None = None
    ) -> list[R]:
        """Submit one task per item; gather the results in the items' order.

        Raises:
            ExecutorError: Ray cannot start or join its cluster.
        """
        ray = self.ray
        started = False
        if not ray.is_initialized():
            try:
                if self.address:
                    _join(ray, self.address, RAY_JOIN_TIMEOUT_S)
                else:
                    # A local instance of our own: never join a cluster that RAY_ADDRESS does not name.
                    ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False,
                             log_to_driver=False, logging_level="ERROR")
            except ExecutorError:
                raise
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = self.address or "a local instance"
                raise ExecutorError(f"cannot start or join Ray at {where}: {exc}") from None
            started = True
        try:
            remote = ray.remote(fn)
            refs = [remote.remote(x) for x in items]
            index = {r: k for k, r in enumerate(refs)}
            out: list[Any] = [None] * len(items)
            pending, done = list(refs), 0
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    out[index[ref]] = ray.get(ref)
                    done += 1
                    if progress:
                        progress(done)
            return out
        finally:
            if started:
                ray.shutdown()


def _join(ray: Any, address: str, timeout: float) -> None:
    """ray.init(address) in a helper thread, given up after `timeout` s: something may answer on the
    port (a proxy, another service) without being a Ray head, and Ray would retry for a minute."""

    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["exc"] = exc

    th = threading.Thread(target=target, name="stallfree-ray-join", daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise ExecutorError(f"`ray_address` {address}: something answers there but no Ray cluster joined within "
                            f"{timeout:g} s")
    if "exc" in box:
        raise ExecutorError(f"`ray_address` {address}: cannot join the Ray cluster: {box['exc']}")


def make_executor(name: str, jobs: int | None = None, ray_address: str | None = None) -> Executor:
    """Build an executor by name (one of EXECUTORS).

    Args:
        name: "process" (jobs workers), "ray" (ray_address or RAY_ADDRESS or a local instance with
            jobs CPUs) or "serial".
        jobs: worker processes (process) or a local Ray instance's CPUs; None: all CPUs.
        ray_address: the Ray cluster (ray only).

    Raises:
        ExecutorError: an unknown name, jobs < 1, ray_address without ray, or Ray not installed.
    """
    if name not in EXECUTORS:
        raise ExecutorError(f"unknown executor {name!r} (choose from {', '.join(EXECUTORS)})")
    if ray_address is not None and name != "ray":
        raise ExecutorError(f"`ray_address` applies to `executor`='ray', not {name!r}")
    if name == "serial":
        return SerialExecutor()
    if name == "process":
        return ProcessExecutor(jobs)
    return RayExecutor(ray_address, num_cpus=jobs)
