"""stallfree's build backend: setuptools' own (setuptools.build_meta), with the compiled build's requirements
asked for only by a build that may compile (docs/install.md, "The compiled build").

A regular build (a wheel, what `pip install .` makes) may compile setup.py's NATIVE_MODULES with mypyc, so it
asks pip for mypy and numpy (numpy for its types: mypyc type-checks what the compiled modules import) in its
build environment; an editable build (`pip install -e .`) is always pure Python and asks for nothing more
than setuptools. STALLFREE_COMPILE chooses: unset, empty or "auto" (compile where a C compiler is found),
"1" (compile or fail), "0" (never compile); any other value is refused before anything is fetched.
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every hook this module does not define is setuptools')

#: What a build that may compile needs beside setuptools.
COMPILE_REQUIRES = ["mypy>=1.15", "numpy>=1.26"]


def compile_mode() -> str:
    """STALLFREE_COMPILE, read: "1" (compile or fail), "0" (never) or "auto" (unset, empty or "auto").

    Raises:
        SystemExit: any other value, named.
    """
    raw = os.environ.get("STALLFREE_COMPILE", "")
    mode = raw.strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"STALLFREE_COMPILE={raw!r}: use 1 (compile or fail), 0 (pure Python) or auto (compile "
                         "where a C compiler is found; the same as leaving it unset)")
    return mode


def get_requires_for_build_wheel(config_settings: dict[str, object] | None = None) -> list[str]:
    """setuptools' requirements, and mypy and numpy unless STALLFREE_COMPILE=0."""
    extra = [] if compile_mode() == "0" else COMPILE_REQUIRES
    return [*_setuptools.get_requires_for_build_wheel(config_settings), *extra]


def get_requires_for_build_editable(config_settings: dict[str, object] | None = None) -> list[str]:
    """setuptools' requirements alone: an editable install is pure Python.

    Raises:
        SystemExit: STALLFREE_COMPILE=1 (its compiled modules would shadow the sources being edited), or
            a value compile_mode refuses.
    """
    if compile_mode() == "1":
        raise SystemExit("STALLFREE_COMPILE=1 needs a regular install (pip install .): in an editable one the "
                         "compiled modules would shadow the sources being edited")
    return list(_setuptools.get_requires_for_build_editable(config_settings))
