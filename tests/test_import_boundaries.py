"""Import direction between subpackages (core <- costmodel <- sim; core <- engine <- server), and the
heavy libraries that the core, cost model and simulator loop must never pull in."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "stallfree"

# Which stallfree subpackages each subpackage may import (besides itself).
ALLOWED = {
    "core": set(),
    "costmodel": {"core"},
    "sim": {"core", "costmodel"},
    "engine": {"core"},
    "server": {"core", "engine"},
    "validate": {"core", "costmodel", "sim", "engine"},
    "integrations": {"core"},
}


def _stallfree_imports(path: Path) -> set[str]:
    """The stallfree subpackages a module imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "stallfree" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_direction(package):
    """Every module of a subpackage imports only the subpackages it sits on."""
    bad = {}
    for path in sorted((SRC / package).rglob("*.py")):
        # _argtypes (argparse value types), _files (bounded reading of user files), flags (the
        # scheduler flags, over the core) and _default_replica (the commands' default model and GPU) are
        # leaves that every subcommand may share.
        leaves = {"_argtypes", "_files", "flags", "_default_replica"}
        extra = _stallfree_imports(path) - ALLOWED[package] - {package} - leaves
        if extra:
            bad[str(path.relative_to(SRC))] = sorted(extra)
    assert bad == {}


def test_core_costmodel_and_sim_loop_import_no_heavy_library():
    """Importing the core, the cost model and the simulator's event loop loads no torch, numpy, matplotlib
    or HTTP library (checked in a fresh interpreter)."""
    code = (
        "import sys\n"
        "import stallfree, stallfree.core, stallfree.costmodel, stallfree.sim.run.simulator, "
        "stallfree.sim.inputs.workload\n"
        "heavy = ['torch', 'numpy', 'matplotlib', 'fastapi', 'uvicorn', 'httpx', 'starlette', 'rich']\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": str(SRC.parent)}
    )
    assert out.stdout.strip() == ""
