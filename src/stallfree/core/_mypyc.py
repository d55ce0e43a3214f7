"""mypyc's class options for the compiled build (setup.py's NATIVE_MODULES, which a regular install compiles).

`@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)` is on every class of a compiled module:
serializable lets copy.deepcopy and pickle copy its objects (Scheduler.snapshot, a sweep's worker
processes, Ray), and a compiled class that allows interpreted subclasses is built by Python's own call
protocol, which the serializable flag alone leaves without its __init__ (mypyc 1.15 to 2.4); it also lets
pure-Python classes extend it (sim/run/session_run.py's SessionArrivals, core/fairness.py's
FairOnePartialPrefill). mypyc reads the decorator when it compiles; at run time it returns its class
unchanged: mypy_extensions' where mypy is installed, else this module's own, so the core needs nothing
outside the standard library.

Imports allowed: the standard library only (mypy_extensions where it is installed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["mypyc_attr"]

T = TypeVar("T")

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # no mypy installed: the options mean nothing outside mypyc

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[T], T]:
        """Return a decorator that leaves its class as it is (mypy_extensions.mypyc_attr's stand-in)."""
        return lambda cls: cls
