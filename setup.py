"""Build hook: the compiled build of the simulator's step path (docs/install.md).

A regular install (`pip install .`) compiles the modules of NATIVE_MODULES with mypyc (the compiler of the
mypy project: it turns type-annotated Python into C extensions) where it can: the same sources and the same
results, in about half the CPU (docs/costmodel.md, "Whole runs"). It needs a C compiler and Python's headers;
without them, or when the compilation fails, the install goes on as pure Python and says why (pip shows
it with -v). mypy and numpy are fetched for the build only, never at run time. An editable install
(`pip install -e .`) is pure Python, so that edits to the sources take effect. `stallfree --version` says
which build is imported.

STALLFREE_COMPILE in the environment chooses: unset or "auto" as above; "1" compiles or fails the install
(CI's compiled build); "0" never compiles.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup

# The build backend (build_backend/stallfree_build.py: setuptools' own, asking for mypy and numpy where a
# build may compile) reads STALLFREE_COMPILE the same way; it is on the path when pip builds, put there for
# a direct `python setup.py`.
sys.path.insert(0, str(Path(__file__).resolve().parent / "build_backend"))
from stallfree_build import compile_mode  # noqa: E402

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



def _say(why: str) -> None:
    print(f"stallfree: installing the pure-Python build: {why} (STALLFREE_COMPILE=1 makes this an error; "
          "docs/install.md)", file=sys.stderr)


def _why_not_compiler() -> str | None:
    """Why this machine cannot compile C extensions for this Python (None: it looks able to)."""
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return f"Python's headers are missing (no Python.h under {include}; Debian and Ubuntu: python3-dev)"
    cc, source = os.environ.get("CC"), "$CC"  # setuptools compiles with $CC where it is set
    if not cc:
        cc, source = sysconfig.get_config_var("CC"), "Python's build configuration"
    program = str(cc).split()[0] if cc else ""
    if program and not shutil.which(program):
        return f"no C compiler ({program}, named by {source}, is not found; Debian and Ubuntu: build-essential)"
    return None


def _fallback_build_ext() -> Any:
    """setuptools' build_ext that, when compiling fails, removes what it built and lets the install go on
    pure Python (each compiled module's .py source is installed beside it, so nothing is missing)."""
    from setuptools.command.build_ext import build_ext

    class FallbackBuildExt(build_ext):  # type: ignore[misc]
        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # a compiler error of any kind: the pure build is complete without it
                for ext in self.extensions:
                    for path in (self.get_ext_fullpath(ext.name),):
                        if os.path.exists(path):
                            os.remove(path)
                self.extensions = []
                _say(f"compiling failed ({type(exc).__name__}: {exc})")

    return FallbackBuildExt


def native_build(argv: list[str]) -> dict[str, object]:
    """setup() keywords for the setuptools command line `argv`: the compiled build where it applies and can
    be made, else none (pure Python).

    Raises:
        SystemExit: STALLFREE_COMPILE=1 with an editable install (its compiled modules would shadow the
            sources being edited) or without a C compiler and Python's headers.
    """
    mode = compile_mode()
    if mode == "0":
        return {}
    required = mode == "1"
    if "editable_wheel" in argv:
        if required:  # the backend refuses it first (get_requires_for_build_editable); a direct call too
            raise SystemExit("STALLFREE_COMPILE=1 needs a regular install (pip install .): in an editable one "
                             "the compiled modules would shadow the sources being edited")
        return {}
    if not any(cmd in argv for cmd in ("bdist_wheel", "build_ext", "build", "install")):
        return {}  # the metadata passes (egg_info, dist_info): nothing to compile
    why = _why_not_compiler()
    if why is not None:
        if required:
            raise SystemExit(f"STALLFREE_COMPILE=1: {why}")
        _say(why)
        return {}
    try:
        from mypyc.build import mypycify
    except ImportError:
        why = ("mypy is not installed in the build's environment (pip fetches it for the build unless told "
               "--no-build-isolation: then install mypy first)")
        if required:
            raise SystemExit(f"STALLFREE_COMPILE=1: {why}") from None
        _say(why)
        return {}
    if required:
        return {"ext_modules": mypycify(list(NATIVE_MODULES), opt_level="3")}
    try:
        ext_modules = mypycify(list(NATIVE_MODULES), opt_level="3")
    except (Exception, SystemExit) as exc:  # mypyc's own refusal (a type error): never the user's install
        _say(f"mypyc failed ({type(exc).__name__}: {exc})")
        return {}
    return {"ext_modules": ext_modules, "cmdclass": {"build_ext": _fallback_build_ext()}}


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__; the tests import it
    setup(**native_build(sys.argv))
