"""`stallfree serve`: options and vLLM aliases, clear errors, and the app it hands to uvicorn."""

from __future__ import annotations

import pytest

from server.fake_engine import FakeEngine, FakeSamplingParams
from stallfree import cli
from stallfree.server import cli as serve_cli


def _parse(argv):
    return cli.build_parser().parse_args(["serve", *argv])


def test_vllm_aliases_map_to_our_options():
    """--max-num-batched-tokens, --max-num-seqs and --served-model-name set token_budget, max_seqs, names."""
    a = _parse(["--max-num-batched-tokens", "256", "--max-num-seqs", "8", "--served-model-name", "x", "y"])
    b = _parse(["--token-budget", "256", "--max-seqs", "8"])
    assert (a.token_budget, a.max_seqs, a.served_model_name) == (256, 8, ["x", "y"])
    assert (b.token_budget, b.max_seqs) == (256, 8)


def test_defaults():
    """Defaults: bundled model, 127.0.0.1:8000, budget 512, 64 seqs, 256 default max_tokens, 1024 waiting."""
    a = _parse([])
    assert (a.model, a.host, a.port, a.token_budget, a.max_seqs, a.kv_tokens) == (
        None, "127.0.0.1", 8000, 512, 64, None)
    assert (a.default_max_tokens, a.max_waiting) == (256, 1024)


@pytest.mark.parametrize("argv", [["--token-budget", "0"], ["--port", "70000"], ["--max-seqs", "x"]],
                         ids=["budget0", "port", "seqs"])
def test_bad_option_is_usage_error(argv, capsys):
    """A bad value exits 2 with an error line naming the option, no traceback."""
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "Traceback" not in err


def test_missing_engine_is_one_line_exit_1(monkeypatch, capsys):
    """When the engine cannot be imported, serve prints one line and returns 1."""

    def boom(args):
        raise ImportError("No module named 'stallfree.engine'")

    monkeypatch.setattr(serve_cli, "build_engine", boom)
    assert cli.main(["serve", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("stallfree serve: loading ") and "engine is not available" in err[1]


def test_model_load_error_is_one_line_exit_1(monkeypatch, capsys, tmp_path):
    """A model that fails to load (a malformed file) is one line on stderr after the loading line, exit 1."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")

    def boom(args):
        raise ValueError(f"malformed model: {args.model}")

    monkeypatch.setattr(serve_cli, "build_engine", boom)
    assert cli.main(["serve", "--port", "0", "--model", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"stallfree serve: loading {bad} on cpu as bfloat16 or float32 (bfloat16 where the CPU has "
                   "AMX bf16 units)",
                   f"stallfree serve: cannot load the model: malformed model: {bad}"]


def test_model_folder_without_a_checkpoint_is_an_input_error(monkeypatch, capsys, tmp_path):
    """--model naming a folder with neither config.json nor a .gguf file, or an empty value (read as the working
    directory): one line naming --model and the value, exit 2, with no "loading ..." line before it and nothing
    loaded."""
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--port", "0", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"stallfree serve: error: --model '{tmp_path}': the folder holds neither config.json (a Hugging Face "
        "directory) nor a .gguf file"]
    assert cli.main(["serve", "--port", "0", "--model", ""]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "stallfree serve: error: --model '': empty; pass a .gguf file or a Hugging Face directory"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--model", "/nope.gguf"], "--model '/nope.gguf': no such file or directory"),
     (["--dtype", "fp64"], "--dtype must be one of"),
     (["--device", "gpu0"], "--device must be cpu, cuda, cuda:N or mps, got 'gpu0'"),
     (["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "5"],
      "--max-long-partial-prefills 5 must be <= --max-num-partial-prefills 2"),
     (["--max-num-partial-prefills", "2", "--long-prefill-token-threshold", "8"],
      "--long-prefill-token-threshold (8) must be >= --block-size (16)")],
    ids=["model", "dtype", "device", "long_over_k", "threshold_under_block"],
)
def test_bad_flags_refused_before_loading(monkeypatch, capsys, argv, needle):
    """Options that argparse cannot check are checked before anything is imported or loaded: exit 2, one
    line prefixed with the command."""
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stallfree serve: error: ") and needle in err and err.count("\n") == 1


def test_policies_and_block_size_reach_the_engine(monkeypatch):
    """--kv-policy (default paged), --block-size (16) and --scheduling-policy reach build_engine's call."""
    a = _parse([])
    assert (a.kv_policy, a.block_size, a.policy, a.max_request_bytes) == ("paged", 16, "fcfs", 2**21)
    a = _parse(["--kv-policy", "reserve", "--block-size", "32", "--scheduling-policy", "priority"])
    assert (a.kv_policy, a.block_size, a.policy) == ("reserve", 32, "priority")


def test_banner_names_what_is_served():
    """The banner gives model, device, dtype, KV tokens and blocks, budget, max_seqs, policies and address."""
    text = serve_cli.banner(FakeEngine(kv_policy="paged", block_size=16, kv_tokens=4096).info, "127.0.0.1", 8000)
    for needle in ("fake-model", "cpu", "float32", "4,096 tokens = 256 blocks of 16", "--kv-policy paged",
                   "token budget 64", "max_seqs 8", "--scheduling-policy fcfs", "http://127.0.0.1:8000"):
        assert needle in text


def test_serve_builds_app_and_runs_uvicorn(monkeypatch):
    """serve hands uvicorn an app over the built engine, with the host, port and limits given."""
    seen = {}
    import stallfree.server.app as app_mod

    monkeypatch.setattr(app_mod, "_sampling_params_cls", lambda config: FakeSamplingParams)
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: FakeEngine())
    import stallfree.server.ops as ops_mod

    monkeypatch.setattr(ops_mod, "run_server",
                        lambda app, host, port, ops: seen.update(app=app, host=host, port=port, ops=ops) or 0)
    assert cli.main(["serve", "--port", "0", "--max-waiting", "3", "--served-model-name", "tiny",
                     "--default-max-tokens", "7", "--max-request-bytes", "5000", "--shutdown-timeout", "4",
                     "--limit-concurrency", "9"]) == 0
    state = seen["app"].state.server
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 0)
    assert (seen["ops"].shutdown_timeout_s, seen["ops"].limit_concurrency, seen["ops"].api_key) == (4.0, 9, None)
    assert seen["app"].state.drain.timeout_s == 4.0
    assert state.names == ("tiny",) and state.async_engine.max_waiting == 3
    assert state.config.default_max_tokens == 7 and state.config.max_request_bytes == 5000


def test_serve_checks_flags_before_importing_torch():
    """A bad flag is refused in a fresh interpreter without importing torch: exit 2, the command's name first."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom stallfree.cli import main\nrc = main(['serve', '--device', 'gpu0'])\n"
            "print('torch' in sys.modules, rc)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.split() == ["False", "2"], r.stderr
    assert r.stderr.startswith("stallfree serve: error: --device")


def test_max_model_len_reaches_the_engine(monkeypatch):
    """serve --max-model-len N passes max_model_len=N to LLMEngine.from_pretrained; without it, none is passed
    (the checkpoint's own)."""
    import sys
    import types

    seen = {}
    # A stand-in for stallfree.engine, so that the test does not import torch.
    fake = types.SimpleNamespace(LLMEngine=types.SimpleNamespace(from_pretrained=lambda **kw: seen.update(kw)))
    monkeypatch.setitem(sys.modules, "stallfree.engine", fake)
    serve_cli.build_engine(_parse(["--max-model-len", "1024"]))
    assert seen["max_model_len"] == 1024
    seen.clear()
    serve_cli.build_engine(_parse([]))
    assert "max_model_len" not in seen  # the checkpoint's own


def test_ops_defaults():
    """Defaults: no key, /metrics open, 30 s shutdown and read timeouts, 5 s keep-alive, no connection limit."""
    a = _parse([])
    assert (a.api_key, a.protect_metrics, a.shutdown_timeout, a.request_read_timeout, a.timeout_keep_alive,
            a.limit_concurrency) == (None, False, 30.0, 30.0, 5.0, None)


def test_help_texts_are_current(capsys):
    """serve --help no longer says priority needs --kv-policy reserve, nor that every request reserves
    prompt + max_tokens; it names the new options."""
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "needs --kv-policy reserve" not in text and "under either --kv-policy" in text
    assert "under --kv-policy reserve each request reserves KV for prompt + max_tokens" in text
    for flag in ("--api-key", "--protect-metrics", "--shutdown-timeout", "--request-read-timeout",
                 "--timeout-keep-alive", "--limit-concurrency", "--max-model-len"):
        assert flag in text


def test_missing_packages_are_named_together_before_the_model_check(monkeypatch, capsys):
    """A core-only install meets one line naming every missing package and the extras that bring them (exit 1),
    rather than the bundled model's message first and, once that is fixed, the server extra's."""
    import importlib.util

    real = importlib.util.find_spec
    gone = {"fastapi", "uvicorn", "gguf"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--port", "0", "--model", "/no/such.gguf"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "stallfree serve: missing dependencies (gguf, fastapi, uvicorn); install them with: "
        "pip install 'stallfree[engine,server]'"]
