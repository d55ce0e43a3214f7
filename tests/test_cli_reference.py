"""docs/cli.md is `stallfree help-all`'s output: every option of every command appears in its section."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from stallfree.cli import main
from stallfree.cli_reference import options_by_command, reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _sections(text: str) -> dict[str, str]:
    """The page's text under each `## stallfree NAME` heading, by NAME."""
    parts = re.split(r"^## stallfree (\S+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_option_of_every_command_is_in_docs_cli_md() -> None:
    doc = _sections(DOC.read_text(encoding="utf-8"))
    options = options_by_command()
    assert {"simulate", "sweep", "tune", "plan", "serve", "validate"} <= set(options)
    missing = {
        cmd: [o for o in opts if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", doc.get(cmd, ""))]
        for cmd, opts in options.items()
    }
    missing = {cmd: opts for cmd, opts in missing.items() if opts}
    assert not missing, f"docs/cli.md is stale; run `stallfree help-all > docs/cli.md`: {missing}"


def test_docs_cli_md_names_no_option_that_no_longer_exists() -> None:
    doc = _sections(DOC.read_text(encoding="utf-8"))
    options = options_by_command()
    for cmd, text in doc.items():
        if cmd not in options:
            continue
        usage = text.split("\n\n", 1)[0]  # the usage block lists each option once
        named = set(re.findall(r"\[(--?[\w-]+)", usage))
        stale = named - set(options[cmd])
        assert not stale, f"{cmd}: docs/cli.md names {sorted(stale)}; run `stallfree help-all > docs/cli.md`"


def test_help_all_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help-all"]) == 0
    out = capsys.readouterr().out
    assert out == reference()
    assert "## stallfree simulate" in out and "--max-num-batched-tokens" in out


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, nested ones (`bench engine`) included, by its prog."""
    from stallfree.cli import build_parser

    found: dict[str, argparse.ArgumentParser] = {}
    todo = [build_parser()]
    while todo:
        parser = todo.pop()
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return found


def _default_phrases(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each option's "default ..." phrases, as its --help shows them (whitespace squeezed), by option."""
    formatter = parser._get_formatter()
    out = {}
    for action in parser._actions:
        if not action.help or action.help == argparse.SUPPRESS:
            continue
        text = " ".join(formatter._expand_help(action).split())
        out[action.option_strings[0] if action.option_strings else action.dest] = [
            m.strip() for m in re.findall(r"\bdefault\b:? ?([^;)(]*)", text)]
    return out


def test_no_option_help_says_its_default_twice() -> None:
    """No --help of any command repeats a default ("default 16) (default 16)": a knob's own words and the
    default a command adds to them); two defaults of different things in one option are fine."""
    parsers = _all_parsers()
    assert {"stallfree simulate", "stallfree budget", "stallfree serve"} <= set(parsers)
    twice = {
        f"{prog} {option}": phrases
        for prog, parser in parsers.items()
        for option, phrases in _default_phrases(parser).items()
        if len(phrases) != len(set(phrases))
    }
    assert twice == {}


def test_model_and_hardware_flags_say_their_defaults() -> None:
    """simulate, sweep, tune and plan's --model, --gpu, --tp and --dtype say what they are and their default
    (the default replica), as budget's do; serve's --max-num-seqs reads as the other commands' does; the
    top-level help says what `bench` measures."""
    parsers = _all_parsers()
    for command in ("simulate", "sweep", "tune", "plan", "budget"):
        phrases = _default_phrases(parsers[f"stallfree {command}"])
        assert phrases["--model"] == ["llama-3.3-70b"], command
        assert phrases["--gpu"] == ["h100-sxm"], command
        assert phrases["--tp"] == ["4"], command
        assert phrases["--dtype"] == ["fp8"], command
    for command in ("serve", "generate"):
        formatter = parsers[f"stallfree {command}"]._get_formatter()
        seqs = next(a for a in parsers[f"stallfree {command}"]._actions if "--max-num-seqs" in a.option_strings)
        assert formatter._expand_help(seqs) == "the most running requests (default 64); formerly --max-seqs"
    top = " ".join(parsers["stallfree"].format_help().split())
    assert "bench measure the real engine" in top
