"""The top-level command line: one-line usage errors, and a named extra when a dependency is missing."""

from __future__ import annotations

import sys

import pytest

from stallfree.cli import main


def test_unknown_command_is_one_line_exit_2(capsys):
    """An unknown command prints one error line naming it and exits 2."""
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nonsense" in err[0]


def test_missing_library_at_run_time_names_the_extra(monkeypatch, capsys):
    """`simulate` without numpy (the sim extra) says which extra to install instead of a traceback."""
    for name in [m for m in sys.modules if m == "numpy" or m.startswith("numpy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "numpy", None)
    assert main(["simulate", "--num-requests", "20"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'stallfree[sim]'" in err and "numpy" in err


def test_missing_library_at_import_keeps_the_command(monkeypatch, capsys):
    """Without fastapi (the server extra), `serve` still exists and explains what to install."""
    for name in [m for m in sys.modules if m.startswith(("stallfree.server", "fastapi"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "--port", "1"]) == 1
    assert "pip install 'stallfree[server]'" in capsys.readouterr().err
