"""The Python examples in docs/simulator.md and docs/tuning.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


def test_docs_have_python_examples():
    """Each page has the examples the tests below run (the one-run, sweep and tune APIs)."""
    assert len(_blocks("simulator.md")) >= 2
    assert any("sweep(" in b for b in _blocks("simulator.md"))
    assert any("tune(" in b for b in _blocks("tuning.md"))


@pytest.mark.slow
@pytest.mark.parametrize("page", ["simulator.md", "tuning.md"], ids=["simulator", "tuning"])
def test_python_examples_run(page, capsys):
    """Every ```python block of the page executes without error and prints what it promises."""
    for block in _blocks(page):
        exec(compile(block, f"{page}:example", "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.strip()
