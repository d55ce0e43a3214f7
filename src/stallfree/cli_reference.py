"""`stallfree help-all`: every command's `--help`, from the parsers themselves, as one Markdown page.

docs/cli.md is this command's output (`stallfree help-all > docs/cli.md`), so the reference cannot drift
from `--help`: tests/test_cli_reference.py checks that every option of every command appears in it.
The help text is wrapped at a fixed width (100 columns) whatever the terminal, so the page is the same
on every machine with the same Python.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["register", "reference", "options_by_command"]

# Wide enough for the option tables, narrow enough to read in a diff.
_WIDTH = 100


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers under `parser`, by name, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {name: p for name, p in action.choices.items() if name != "help-all"}
    return {}


def _help_text(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(_WIDTH)
    try:
        return parser.format_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def options_by_command() -> dict[str, list[str]]:
    """Every option string (`--max-num-batched-tokens`, `-h`, ...) of every command, by command name.

    Commands whose optional extra is missing are left out (their parser has no options of its own).
    """
    from stallfree.cli import build_parser

    out: dict[str, list[str]] = {}
    for name, p in _commands(build_parser()).items():
        if not p.add_help:
            continue  # a stand-in for a command whose extra is not installed
        out[name] = [s for action in p._actions for s in action.option_strings]
    return out


def reference() -> str:
    """The Markdown page: the top-level help, then a section per command with its `--help` verbatim.

    Returns:
        The page's text, ending in a newline.
    """
    from stallfree.cli import build_parser

    top = build_parser()
    parts = [
        "# Command-line reference",
        "",
        "Every command's `--help`, generated from the parsers (`stallfree help-all > docs/cli.md`), so it",
        "matches the installed version. The guides (README.md and the other pages here) say when to use each",
        "flag; this page lists them all.",
        "",
        "```text",
        _help_text(top).rstrip(),
        "```",
    ]
    for name, p in _commands(top).items():
        parts += ["", f"## stallfree {name}", "", "```text", _help_text(p).rstrip(), "```"]
    return "\n".join(parts) + "\n"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `help-all` subcommand (prints `reference()` on stdout)."""
    p = sub.add_parser("help-all", help="print every command's --help as one Markdown page (docs/cli.md)")
    p.set_defaults(func=lambda _a: sys.stdout.write(reference()) and 0)
