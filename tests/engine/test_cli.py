"""`stallfree generate` streams real text; bad arguments give one line on stderr and exit code 2 or 1."""

from __future__ import annotations

import pytest

from stallfree.cli import build_parser, main


def test_generate_prints_real_text(capsys):
    """The bundled model answers the chat prompt about France's capital with Paris."""
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
               "--threads", "1", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0 and out.err == ""
    assert out.out == "The capital of France is Paris.\n"


def test_generate_prompts_file_prints_in_order(tmp_path, capsys):
    """Prompts from a file run together and print in file order, each prefixed by its index."""
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is\n\n1, 2, 3, 4,\n")
    rc = main(["generate", "--prompts", str(f), "--raw", "--max-tokens", "3", "--threads", "1",
               "--device", "cpu", "--token-budget", "4"])
    assert rc == 0
    assert capsys.readouterr().out == "[0]  Paris.\n\n[1]  5,\n"


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [(["--prompt", "x", "--temperature", "5"], 2, "temperature must be a number in [0, 2], got 5.0"),
     (["--prompts", "/no/such/file"], 2, "No such file or directory"),
     (["--prompt", "x", "--model", "/no/such/model"], 1, "is not a .gguf file or a directory"),
     (["--prompt", "x", "--token-budget", "0"], 2, "token_budget must be an integer >= 1, got 0")],
    ids=["temperature", "prompts_file", "model_path", "budget"],
)
def test_generate_errors_are_one_line(capsys, argv, code, needle):
    """Each bad argument ends with one stderr line naming it, and no traceback."""
    assert main(["generate", *argv, "--device", "cpu"]) == code
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_bench_engine_is_registered():
    """`bench engine` parses its options."""
    args = build_parser().parse_args(["bench", "engine", "--quick", "--long-prompt", "64"])
    assert args.quick and args.long_prompt == 64 and callable(args.func)
