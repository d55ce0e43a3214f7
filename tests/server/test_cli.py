"""`stallfree serve`: options and vLLM aliases, clear errors, and the app it hands to uvicorn."""

from __future__ import annotations

import pytest
import uvicorn

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
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine is not available" in err[0]


def test_model_load_error_is_one_line_exit_1(monkeypatch, capsys):
    """A model that fails to load (missing file) is one line on stderr and exit code 1."""

    def boom(args):
        raise FileNotFoundError(f"no such model: {args.model}")

    monkeypatch.setattr(serve_cli, "build_engine", boom)
    assert cli.main(["serve", "--model", "/nope.gguf"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "stallfree serve: cannot load the model: no such model: /nope.gguf"


def test_serve_builds_app_and_runs_uvicorn(monkeypatch):
    """serve hands uvicorn an app over the built engine, with the host, port and limits given."""
    seen = {}
    import stallfree.server.app as app_mod

    monkeypatch.setattr(app_mod, "_sampling_params_cls", lambda config: FakeSamplingParams)
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: FakeEngine())
    monkeypatch.setattr(uvicorn, "run",
                        lambda app, host, port, log_level: seen.update(app=app, host=host, port=port))
    assert cli.main(["serve", "--port", "0", "--max-waiting", "3", "--served-model-name", "tiny",
                     "--default-max-tokens", "7"]) == 0
    state = seen["app"].state.server
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 0)
    assert state.names == ("tiny",) and state.async_engine.max_waiting == 3
    assert state.config.default_max_tokens == 7
