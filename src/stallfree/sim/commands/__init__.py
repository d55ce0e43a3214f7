"""The `stallfree simulate`, `sweep`, `tune` and `plan` commands: argparse, the error guard and printing over
the simulator's library modules (setup, experiment, sweep, tune, plots), which never see argparse.

Imports allowed: the standard library, stallfree._argtypes and stallfree.sim; numpy, matplotlib and
rich lazily, when a command runs.
"""

from __future__ import annotations

from typing import Any

from stallfree.sim.commands import plan, simulate, sweep, tune

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the `simulate`, `sweep`, `tune` and `plan` subcommands to the top-level CLI."""
    simulate.register(subparsers)
    sweep.register(subparsers)
    tune.register(subparsers)
    plan.register(subparsers)
