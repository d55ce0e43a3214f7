"""docs/cli.md is `stallfree help-all`'s output: every option of every command appears in its section."""

from __future__ import annotations

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
