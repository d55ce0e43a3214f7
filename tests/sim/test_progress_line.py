"""The progress line of long simulator runs: drawn on a terminal only, erased before the report."""

from __future__ import annotations

import io
import json
import time

from stallfree.cli import main
from stallfree.sim.commands import common
from stallfree.sim.commands.common import ProgressLine


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_line_drawn_on_a_terminal_then_erased():
    """Past its delay the line names the phase and the whole seconds elapsed; the block's end erases it."""
    tty = FakeTTY()
    with ProgressLine(delay=0.0, interval=0.01, stream=tty) as line:
        line.phase("replaying azure-conv-2023")
        time.sleep(0.1)
    text = tty.getvalue()
    assert "\rsimulating: replaying azure-conv-2023, 0 s\x1b[K" in text
    assert text.endswith("\r\x1b[K")


def test_nothing_before_the_delay():
    """A run shorter than the delay writes nothing, not even the erase sequence."""
    tty = FakeTTY()
    with ProgressLine(delay=60.0, stream=tty) as line:
        line.phase("replaying")
    assert tty.getvalue() == ""


def test_nothing_when_not_a_terminal():
    """A pipe or a file gets nothing, whatever the delay."""
    pipe = io.StringIO()
    with ProgressLine(delay=0.0, interval=0.01, stream=pipe):
        time.sleep(0.05)
    assert pipe.getvalue() == ""


def test_simulate_on_a_terminal_keeps_stdout(monkeypatch, capsys):
    """simulate --json with a terminal stderr and no delay draws the line there and prints the same JSON."""
    argv = ["simulate", "--num-requests", "40", "--json", "--kernels", "none", "--no-range"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    tty = FakeTTY()
    monkeypatch.setattr(common, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr("sys.stderr", tty)
    assert main(argv) == 0
    drawn = json.loads(capsys.readouterr().out)
    for run in (plain, drawn):
        run["runs"][0].pop("wall_time_s", None)
        run["runs"][0].pop("sim_wall_s", None)
    assert drawn == plain
    assert tty.getvalue().startswith("\rsimulating")
    assert tty.getvalue().endswith("\r\x1b[K")
