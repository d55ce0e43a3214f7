"""Which build of stallfree is imported: the pure-Python one, or the compiled one (setup.py's NATIVE_MODULES
turned into C extensions by mypyc: what a regular install makes where it finds a C compiler).

Imports allowed: the standard library only.
"""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from importlib.util import find_spec

__all__ = ["PROBE_MODULE", "compiled"]

#: One of the compiled modules, looked up (not imported) to tell the builds apart.
PROBE_MODULE = "stallfree.core.kv.pool"


def compiled() -> bool:
    """True where the compiled build is the one Python imports: PROBE_MODULE resolves to a C extension
    (a `.so`/`.pyd` beside or instead of its `.py`). Imports the packages above PROBE_MODULE, not it."""
    spec = find_spec(PROBE_MODULE)
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(tuple(EXTENSION_SUFFIXES))
