"""The compiled build (setup.py: a regular install with a C compiler) refuses what the pure-Python build refuses.

A compiled `int` or `float` parameter turns True into 1 before the function's own check runs, so every
value a caller hands in to be checked is read as `object` in the compiled modules. These refusals run in
both builds (CI runs the suite on each); under the compiled one they fail if a checked parameter is typed
as a number again.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from stallfree import InvalidConfig, Request, Scheduler, SchedulerStateError
from stallfree._native import PROBE_MODULE, compiled
from stallfree.core.kv.paged import PagedKV
from stallfree.core.kv.pool import BlockPool
from stallfree.core.kv.reservation import ReservationKV
from stallfree.core.kv.tier import CpuTier, TieredKV
from stallfree.core.plain_steps import plain_decode_run
from stallfree.core.policies import BlockAlignedChunks, build_policies, check_partial_prefills
from stallfree.sim.run.closed_loop import ClosedLoop


def test_compiled_says_whether_the_probe_module_is_an_extension() -> None:
    """compiled() is True exactly when the probe module's file is a C extension, not a .py source."""
    origin = importlib.util.find_spec(PROBE_MODULE).origin
    assert compiled() == (not origin.endswith(".py"))


def _native_modules() -> list[str]:
    """setup.py's NATIVE_MODULES as module names (read from the checkout's setup.py, not imported)."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    found = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "NATIVE_MODULES" for t in n.targets))
    paths = ast.literal_eval(found)
    return [p.removeprefix("src/").removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in paths]


def test_every_module_of_the_set_is_compiled_exactly_when_the_build_is() -> None:
    """Each module setup.py compiles is a C extension in the compiled build and a .py source otherwise: a
    module left out of the build (or shadowed by a source) would run pure Python unnoticed."""
    modules = _native_modules()
    assert "stallfree.core.scheduler_core" in modules and "stallfree.costmodel.step_prices" in modules
    kinds = {m: importlib.util.find_spec(m).origin.endswith(".py") for m in modules}
    assert [m for m, is_source in kinds.items() if is_source == compiled()] == []


@pytest.mark.parametrize("bad", [True, 2.0])
def test_the_compiled_modules_checks_see_the_value_given(bad: object) -> None:
    """A bool or a float where a count belongs is refused, naming the field, by each checked entry point."""
    with pytest.raises(InvalidConfig, match="block_size"):
        BlockAlignedChunks(bad)
    with pytest.raises(InvalidConfig, match="num_blocks"):
        BlockPool(bad, 4)
    with pytest.raises(InvalidConfig, match="cpu_blocks"):
        CpuTier(bad)
    with pytest.raises(InvalidConfig, match="num_blocks"):
        PagedKV(bad, 4, 0.0)
    with pytest.raises(InvalidConfig, match="block_size"):
        PagedKV(10, bad, 0.0, enable_prefix_caching=True)
    with pytest.raises(InvalidConfig, match="num_blocks"):
        TieredKV(bad, 4, 0.0, 8)
    with pytest.raises(InvalidConfig, match="num_blocks|block_size"):
        ReservationKV(10, bad)
    with pytest.raises(InvalidConfig, match="num_spec_tokens"):
        build_policies(None, "fcfs", None, None, "oldest", bad)
    with pytest.raises(InvalidConfig, match="max_num_partial_prefills"):
        check_partial_prefills(bad, None, None, None)
    with pytest.raises(InvalidConfig, match="block_size"):
        Scheduler(token_budget=8, max_seqs=2, kv_tokens=100, block_size=bad)
    with pytest.raises(ValueError, match="ClosedLoop.concurrency"):
        ClosedLoop(bad)  # type: ignore[arg-type]
    s = Scheduler(16, 4, 1000)
    s.add(Request("a", 4, 5))
    s.complete(s.schedule())
    with pytest.raises(InvalidConfig, match="limit"):
        plain_decode_run(s, bad)
    run = plain_decode_run(s, 10)
    assert run is not None
    with pytest.raises(SchedulerStateError, match="count"):
        run.take(bad)


def test_a_chunk_cap_answering_a_bool_is_refused() -> None:
    """schedule(chunk_cap=...) answering True is an error in both builds, not a cap of 1 token."""
    s = Scheduler(8, 4, 1000)
    s.add(Request("A", 20, 1))
    with pytest.raises(SchedulerStateError, match=r"chunk_cap\('A', start=0, n=8\) returned True"):
        s.schedule(chunk_cap=lambda rid, start, n: True)


@pytest.mark.parametrize(
    ("field", "bad"),
    [("policy", 2.5), ("decode_overflow", 2.5), ("fairness", 2.5), ("max_num_partial_prefills", 2.5),
     ("cpu_kv_tokens", 2.5), ("tenant_burst_tokens", True), ("max_long_partial_prefills", True)],
)
def test_scheduler_options_of_the_wrong_type_are_named(field: str, bad: object) -> None:
    """Scheduler(...) names a mistyped option in an InvalidConfig, in both builds (a compiled `str` or `int`
    parameter would raise a bare TypeError before the check)."""
    with pytest.raises(InvalidConfig, match=field):
        Scheduler(token_budget=8, max_seqs=2, kv_tokens=100, **{field: bad})

