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


class RecordingLine(ProgressLine):
    """A progress line that records every phase it is given and draws nothing."""

    phases: list[str] = []

    def phase(self, text: str) -> None:
        super().phase(text)
        RecordingLine.phases.append(text)


def test_simulate_names_each_phase(monkeypatch, capsys):
    """--compare-caching with ranges names the caching-off and caching-on runs of the replay and of each
    range replay, in the order they run."""
    monkeypatch.setattr("stallfree.sim.commands.simulate.ProgressLine", RecordingLine)
    monkeypatch.setattr(RecordingLine, "phases", [])
    argv = ["simulate", "--trace", "mooncake", "--num-requests", "20", "--kv-policy", "paged",
            "--compare-caching", "--kernels", "none", "--json"]
    assert main(argv) == 0
    capsys.readouterr()
    name = "replaying mooncake-fast25-conversation"
    low, high = "the range, every step x0.939 (1 of 2)", "the range, every step x1.231 (2 of 2)"
    assert RecordingLine.phases == [
        name, f"{name}, caching off (1 of 2)", f"{name}, caching on (2 of 2)",
        low, f"{low}, caching off (1 of 2)", f"{low}, caching on (2 of 2)",
        high, f"{high}, caching off (1 of 2)", f"{high}, caching on (2 of 2)",
    ]
