"""Tests of stallfree.sim.studies.executors: serial, process and Ray give the same sweep rows in the same
order; a missing Ray gives the one-line install message; an unreachable --ray-address fails fast."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from stallfree.cli import main
from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.executors import (
    ExecutorError,
    ProcessExecutor,
    SerialExecutor,
    _check_reachable,
    make_executor,
)
from stallfree.sim.studies.sweep import sweep

WALL_KEYS = ("sim_wall_s",)


def _need_ray() -> None:
    """Skip without Ray, except where STALLFREE_REQUIRE_RAY=1 (CI): there a missing Ray fails the test,
    so that the Ray executor is never silently left untested."""
    if os.environ.get("STALLFREE_REQUIRE_RAY") == "1":
        import ray  # noqa: F401 - an ImportError here is the failure CI wants
    else:
        pytest.importorskip("ray")


def _rows(executor: object) -> list[dict[str, object]]:
    """A small sweep (two budgets, two rate scales) run by `executor`, wall-time keys dropped."""
    setup = Setup(WorkloadOptions(num_requests=150), HardwareOptions())
    res = sweep(setup, [256, 2048], batching=["chunked"], rate_scales=[4.0, 16.0], slo_ttft=1.0, slo_tpot=0.05,
                jobs=executor)  # type: ignore[arg-type]
    return [{k: v for k, v in r.items() if k not in WALL_KEYS} for r in res.table_rows]


def _closed_port() -> int:
    """A local TCP port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_square_in_order():
    """Serial and process executors return fn over the items in the items' order."""
    items = list(range(7))
    assert SerialExecutor().map(abs, [-x for x in items]) == items
    seen: list[int] = []
    assert ProcessExecutor(2).map(abs, [-x for x in items], seen.append) == items
    assert sorted(seen) == list(range(1, 8))


def test_serial_and_process_sweeps_are_identical():
    """The same sweep in this process and in two worker processes: identical rows, same order."""
    serial = _rows(SerialExecutor())
    assert serial == _rows(ProcessExecutor(2))
    grid = [(r["rate_scale"], r["token_budget"]) for r in serial]
    assert grid == [(4.0, 256), (4.0, 2048), (16.0, 256), (16.0, 2048)]


@pytest.mark.slow
def test_ray_sweep_is_identical_to_process():
    """--executor ray on a local Ray instance gives the process pool's rows (skipped without Ray)."""
    _need_ray()
    ray_rows = _rows(make_executor("ray", jobs=2))
    assert ray_rows == _rows(ProcessExecutor(2))


def test_missing_ray_gives_the_install_message(monkeypatch, capsys):
    """Without Ray, --executor ray fails with one line naming the extra to install (exit 2)."""
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ExecutorError, match=r'pip install "stallfree\[ray\]"'):
        make_executor("ray")
    assert main(["sweep", "--executor", "ray", "--num-requests", "20", "--budgets", "256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['stallfree sweep: error: --executor ray needs Ray: pip install "stallfree[ray]"']


def test_unreachable_address_fails_fast():
    """A HOST:PORT with nothing listening is refused at once, naming the address."""
    port = _closed_port()
    with pytest.raises(ExecutorError, match=f"`ray_address` 127.0.0.1:{port}: no Ray cluster answers"):
        _check_reachable(f"127.0.0.1:{port}", 3.0)
    with pytest.raises(ExecutorError, match="wants HOST:PORT"):
        _check_reachable("nonsense", 3.0)


def test_cli_unreachable_ray_address(capsys):
    """`sweep --executor ray --ray-address` at a closed port exits 2 with the address (needs Ray)."""
    _need_ray()
    port = _closed_port()
    code = main(["sweep", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--num-requests", "20",
                 "--budgets", "256"])
    assert code == 2
    assert f"--ray-address 127.0.0.1:{port}: no Ray cluster answers" in capsys.readouterr().err


@pytest.mark.slow
def test_port_that_is_not_ray_gives_up_after_the_join_timeout(monkeypatch):
    """A port that accepts connections but is no Ray head: an error after RAY_JOIN_TIMEOUT_S (needs Ray)."""
    _need_ray()
    import stallfree.sim.studies.executors as ex

    monkeypatch.setattr(ex, "RAY_JOIN_TIMEOUT_S", 2.0)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        with pytest.raises(ExecutorError, match=f"`ray_address` {address}: "):
            ex.RayExecutor(address).map(abs, [1, 2])


def test_bad_executor_options():
    """An unknown executor, zero jobs and --ray-address without ray are refused."""
    with pytest.raises(ExecutorError, match="unknown executor 'dask'"):
        make_executor("dask")
    with pytest.raises(ExecutorError, match="jobs must be an integer from 1 to 1,024, got 0"):
        ProcessExecutor(0)
    # A fork-started pool starts every worker at once: 100,000 would fork until the machine gives out.
    with pytest.raises(ExecutorError, match="jobs must be an integer from 1 to 1,024, got 100000"):
        ProcessExecutor(100_000)
    with pytest.raises(ExecutorError, match="`ray_address` applies to `executor`='ray'"):
        make_executor("process", ray_address="127.0.0.1:6379")


def _pid(_: int) -> int:
    return os.getpid()


def test_process_workers_are_reused_within_kept_open():
    """Within reusing_workers, two rounds run in the same two worker processes (started once); outside,
    each map starts its own; a ProcessExecutor still pickles (its pool stays behind). Which of the two
    workers takes a round's tasks is up to the pool (a slow-starting second worker may take none of the
    first round), so the rounds are checked together: at most two processes, none of them this one."""
    import pickle

    from stallfree.sim.studies.executors import ProcessExecutor, reusing_workers

    ex = ProcessExecutor(2)
    with reusing_workers(ex):
        first = set(ex.map(_pid, list(range(8))))
        second = set(ex.map(_pid, list(range(8))))
        assert pickle.loads(pickle.dumps(ex)).jobs == 2
    both = first | second
    assert os.getpid() not in both and 1 <= len(both) <= 2
    assert ex._pool is None
    assert not set(ex.map(_pid, list(range(8)))) & both  # a pool of its own: new processes
