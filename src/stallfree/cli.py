"""The `stallfree` command line: a thin dispatcher over each subpackage's own commands.

Each subpackage that offers commands has a `cli` module with `register(subparsers)`, which adds its
subcommands and sets `func` (taking the parsed argparse.Namespace, returning an exit code) on each.
Imports allowed: anything in stallfree; subpackages are imported lazily so that `stallfree --help`
stays fast and a missing optional extra only disables its own commands.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

# Modules that register subcommands, in the order their commands are listed in --help, with the
# optional extra each needs and its commands (so that a missing extra is named, not a traceback).
_COMMAND_MODULES: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("stallfree.costmodel.cli", None, ("budget", "calibrate", "specs")),
    ("stallfree.sim.commands", "sim", ("simulate", "sweep", "tune", "plan")),
    ("stallfree.engine.cli", "engine", ("generate", "bench")),
    ("stallfree.server.cli", "server", ("serve",)),
    ("stallfree.validate.cli", None, ("validate",)),
    ("stallfree.demo", None, ("demo",)),
    ("stallfree.cli_reference", None, ("help-all",)),
)
_EXTRA_OF = {cmd: extra for _, extra, cmds in _COMMAND_MODULES for cmd in cmds}


def _missing_extra(command: str | None, missing: str | None) -> str:
    extra = _EXTRA_OF.get(command or "") or "all"
    return (
        f"stallfree {command}: needs the '{extra}' extra ({missing} is not installed): "
        f"pip install 'stallfree[{extra}]'"
    )


class _Version(argparse.Action):
    """`--version`: the package version and whether the compiled build (setup.py: a regular install with a C
    compiler) is the one imported, as mypy prints its own; looked up only when asked, so no other command pays
    for it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from stallfree import __version__
        from stallfree._native import compiled

        print(f"stallfree {__version__} (compiled: {'yes' if compiled() else 'no'})")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit code 2), with no usage dump.

    A word that starts with '-' and a digit ("-1s", "-5ms", "-3") is a value, never an option (no
    option of ours starts with a digit), so that `--slo-ttft -1s` reaches the option's own check and
    is refused as a negative time rather than read as a missing argument.
    """

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self._did_you_mean(message)} (see {self.prog} --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """For an unknown option, "; did you mean --x?" naming this command's closest option (a flag of
        another command, `--budgets` of sweep given to simulate, is the common slip), else ""."""
        import difflib

        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for word in message.split(":", 1)[1].split():
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.75)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named first in argv (its first word not starting with '-'), or None (also when
    a top-level option such as --help comes first: the top-level help lists every command)."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with the subcommands registered.

    Args:
        command: a subcommand's name: register only the module that owns it (so that `stallfree
            simulate --help` imports the simulator's commands and nothing else); None, or a name no
            module owns, registers every available subcommand.
    """
    owner = next((name for name, _e, cmds in _COMMAND_MODULES if command in cmds), None)
    parser = _Parser(
        prog="stallfree",
        description="Continuous batching with a token budget and chunked prefill: "
        "cost model, simulator, engine and server.",
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and whether the "
                        "compiled build is imported, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, _extra, commands in _COMMAND_MODULES:
        if owner is not None and name != owner:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not exc.name or exc.name.startswith("stallfree"):
                raise
            # Its optional extra is not installed: keep the commands, which explain what to install.
            for command in commands:
                # No option prefix: whatever options follow are taken as they are, then explained.
                p = sub.add_parser(command, help=f"(needs the missing {exc.name})", add_help=False, prefix_chars="\0")
                p.add_argument("rest", nargs="*")
                p.set_defaults(func=_explain_missing(command, exc.name))
            continue
        module.register(sub)
    return parser


def _explain_missing(command: str, missing: str) -> typing.Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(_missing_extra(command, missing), file=sys.stderr)
        return 1

    return run


_PACKAGE = str(Path(__file__).resolve().parent)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: typing.TextIO | None = None, line: str | None = None) -> None:
    """warnings.showwarning while a command runs: stallfree's own warnings (a class of stallfree's, such as
    CostModelWarning, or one warned from stallfree's code) as one 'warning: ...' line on stderr, like the
    commands' other warnings, not Python's two lines with a source file and its code; others as Python
    shows them."""
    if category.__module__.startswith("stallfree.") or str(Path(filename).resolve()).startswith(_PACKAGE):
        print(f"warning: {message}", file=sys.stderr if file is None else file)
        return
    (sys.stderr if file is None else file).write(warnings.formatwarning(message, category, filename, lineno, line))


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of `command` under `parser`, or `parser` itself when there is none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (0 ok, 1 failure, 2 usage error)."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_of(words))
    args, extra = parser.parse_known_args(words)
    if extra:
        # Named by the subcommand's own parser, so that the error points at `stallfree CMD --help`.
        _subparser(parser, getattr(args, "command", None)).error(f"unrecognized arguments: {' '.join(extra)}")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        # No command installed a way to show a warning (the cost model's commands record their own), so
        # one raised while building a cost model (`simulate --gpu a100`: no fp8 units) came out as
        # Python's "path:line: CostModelWarning: ..." and the source line.
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`stallfree demo | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.startswith("stallfree"):
            raise
        print(_missing_extra(args.command, exc.name), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
