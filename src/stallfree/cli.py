"""The `stallfree` command line: a thin dispatcher over each subpackage's own commands.

Each subpackage that offers commands has a `cli` module with `register(subparsers)`, which adds its
subcommands and sets `func` (taking the parsed argparse.Namespace, returning an exit code) on each.
Imports allowed: anything in stallfree; subpackages are imported lazily so that `stallfree --help`
stays fast and a missing optional extra only disables its own commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from collections.abc import Sequence

__all__ = ["main"]

# Modules that register subcommands, in the order their commands are listed in --help.
_COMMAND_MODULES = (
    "stallfree.costmodel.cli",
    "stallfree.sim.cli",
    "stallfree.engine.cli",
    "stallfree.server.cli",
    "stallfree.demo",
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit code 2), with no usage dump."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available subcommand registered."""
    parser = _Parser(
        prog="stallfree",
        description="Continuous batching with a token budget and chunked prefill: "
        "cost model, simulator, engine and server.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A subpackage not yet present, or one whose optional extra is not installed.
            if exc.name and (name.startswith(exc.name) or not exc.name.startswith("stallfree")):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (0 ok, 1 failure, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
