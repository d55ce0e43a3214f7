"""Tests of the cost model package's boundaries and exports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import stallfree.costmodel as costmodel


def test_imports_only_core_and_stdlib():
    """Importing the cost model (and its CLI) pulls in no third-party package and no other stallfree part."""
    code = (
        "import sys, stallfree.costmodel, stallfree.costmodel.cli, stallfree.costmodel.calibrate\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'httpx', 'fastapi')\n"
        "       or m.startswith(('stallfree.sim', 'stallfree.engine', 'stallfree.server'))]\n"
        "print(','.join(bad))\n"
    )
    src = str(Path(costmodel.__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": src}
    )
    assert out.stdout.strip() == ""


def test_all_is_sorted_and_complete():
    """__all__ is sorted and names the API the simulator relies on."""
    assert costmodel.__all__ == sorted(costmodel.__all__)
    for name in (
        "CostModel",
        "CostModelError",
        "GPUSpec",
        "ModelSpec",
        "get_gpu",
        "get_model",
        "list_gpus",
        "list_models",
    ):
        assert hasattr(costmodel, name) and name in costmodel.__all__
    assert issubclass(costmodel.CostModelError, ValueError)
