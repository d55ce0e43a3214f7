"""Build hook: the optional compiled build of the simulator's step path (docs/install.md).

A plain install (`pip install .`, `pip install -e .`) is pure Python and needs no compiler. With
STALLFREE_COMPILE=1 in the environment a regular (not editable) install also compiles the modules of
NATIVE_MODULES with mypyc (the compiler of the mypy project: it turns type-annotated Python into C
extensions): the same sources and the same results, in less CPU (docs/costmodel.md, "Whole runs"). It needs
a C compiler and the Python headers; mypy is fetched for the build only, never at run time. `stallfree
--version` says which build is imported.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

#: The modules a simulated step runs through (scheduler internals, paged KV, pricing, the event loop and the
#: replica), compiled together. Each is plain typed Python; the compiled build checks every annotation at
#: run time, so they must be honest (an array where a list is annotated raises TypeError), and a value a
#: caller hands in to be checked is read as `object` (a compiled `int` parameter turns True into 1). Every
#: class in them carries core/_mypyc.py's options, which let it be copied, pickled and extended.
NATIVE_MODULES = (
    "src/stallfree/core/decode.py",
    "src/stallfree/core/fairness.py",
    "src/stallfree/core/lifecycle.py",
    "src/stallfree/core/live.py",
    "src/stallfree/core/plain_steps.py",
    "src/stallfree/core/policies.py",
    "src/stallfree/core/prefill.py",
    "src/stallfree/core/scheduler_core.py",
    "src/stallfree/core/kv/__init__.py",
    "src/stallfree/core/kv/factory.py",
    "src/stallfree/core/kv/options.py",
    "src/stallfree/core/kv/paged.py",
    "src/stallfree/core/kv/pool.py",
    "src/stallfree/core/kv/pooled.py",
    "src/stallfree/core/kv/protocol.py",
    "src/stallfree/core/kv/reservation.py",
    "src/stallfree/core/kv/tier.py",
    "src/stallfree/costmodel/decode_runs.py",
    "src/stallfree/costmodel/step_prices.py",
    "src/stallfree/sim/run/load.py",
    "src/stallfree/sim/run/loop.py",
    "src/stallfree/sim/run/replica.py",
)

COMPILE = os.environ.get("STALLFREE_COMPILE", "") == "1"


def _native_build() -> dict[str, object]:
    """setup() keywords of the compiled build: setup_requires names mypy and numpy, which setuptools' build
    backend hands pip as build requirements (get_requires_for_build_wheel) before the build itself imports it.

    Raises:
        SystemExit: an editable install (its compiled modules would shadow the sources being edited).
    """
    if "editable_wheel" in sys.argv:
        raise SystemExit("STALLFREE_COMPILE=1 needs a regular install (pip install .): in an editable one the "
                         "compiled modules would shadow the sources being edited")
    # numpy for its types: mypyc type-checks what the compiled modules import (numpy lazily, in the summary
    # paths), and the build runs before pip installs the package's own dependencies.
    requires = ["mypy>=1.15", "numpy>=1.26"]
    try:
        from mypyc.build import mypycify
    except ImportError:  # the backend's first pass, asking what the build needs
        return {"setup_requires": requires}
    return {"setup_requires": requires, "ext_modules": mypycify(list(NATIVE_MODULES), opt_level="3")}


setup(**(_native_build() if COMPILE else {}))
