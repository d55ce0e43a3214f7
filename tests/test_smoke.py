"""Smoke tests of the package layout."""

import stallfree
from stallfree.demo import run_demo


def test_demo_hand_trace_lines():
    """The demo prints one line per step and finishes every request with its KV returned."""
    lines = run_demo()
    assert len(lines) == 6
    assert "b:prefillx6" in lines[3]
    assert lines[-1].endswith("kv_free 64")


def test_version_string():
    """The package carries a version."""
    assert stallfree.__version__ == "0.1.0"
