"""LoRA adapters on the server: the model field picks the adapter, /v1/models lists adapters with their
parent, an unknown adapter is a 404 naming the served ones, load and unload behind the API key, per-adapter
metrics, and the serve flags' usage errors."""

from __future__ import annotations

import pytest

from server.fake_engine import FakeEngine
from server.helpers import asgi_client, run
from server.ops_helpers import ops_client
from stallfree.server.options import OpsConfig


def _folder(tmp_path, name: str) -> str:
    """A folder with the two files of a PEFT adapter (the fake engine checks only that they exist)."""
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(b"")
    return str(d)


def _engine(tmp_path, **kw) -> FakeEngine:
    return FakeEngine(enable_lora=True, max_loras=2, lora_modules={"sql": _folder(tmp_path, "sql")}, **kw)


def _metric(client, name: str, labels: dict[str, str]) -> float | None:
    reg = client.app.state.server.metrics
    reg.render()  # samples the gauges read at render time
    return reg.registry.get_sample_value(name, {"model_name": "fake-model", **labels})


def test_model_field_picks_the_adapter_and_models_lists_it(tmp_path) -> None:
    """A request with model "sql" runs with the adapter (the scheduler's Request carries it) and answers
    model "sql"; /v1/models lists the base (parent null) and sql (parent the base, root its folder)."""
    eng = _engine(tmp_path)

    async def go() -> None:
        async with asgi_client(eng) as c:
            r = await c.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["model"] == "sql"
            r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["model"] == "fake-model"
            models = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
            assert models["fake-model"]["parent"] is None
            assert models["sql"]["parent"] == "fake-model" and models["sql"]["root"].endswith("sql")
            assert _metric(c, "stallfree_lora_requests_total", {"lora": "sql", "finished_reason": "length"}) == 1
            assert _metric(c, "stallfree_lora_requests_active", {"lora": "sql"}) == 0
            assert _metric(c, "stallfree_lora_adapters_served", {}) == 1

    run(go())
    assert eng.lora_requests == {"sql": 1} and list(eng.lora_of.values()) == ["sql"]


def test_unknown_adapter_is_404_naming_the_served_ones(tmp_path) -> None:
    """model "nope" is a 404 model_not_found whose message names the base model and the adapter sql."""
    async def go() -> None:
        async with asgi_client(_engine(tmp_path)) as c:
            r = await c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user",
                                                                                        "content": "x"}]})
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and "'fake-model'" in err["message"] and "'sql'" in err["message"]

    run(go())


def test_load_and_unload(tmp_path) -> None:
    """Load "math", use it, unload it: afterwards it is a 404; bad loads are 400s naming the fault (a name
    served twice, a folder without its files, a missing field); unloading an unknown name is a 404."""
    eng = _engine(tmp_path)
    math_dir = _folder(tmp_path, "math")

    async def go() -> None:
        async with asgi_client(eng) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": math_dir})
            assert r.status_code == 200 and "math" in r.text
            assert (await c.post("/v1/completions", json={"model": "math", "prompt": "a", "max_tokens": 2})
                    ).status_code == 200
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": math_dir})
            assert r.status_code == 400 and "already served" in r.json()["error"]["message"]
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
            assert r.status_code == 400 and "has no adapter_config.json" in r.json()["error"]["message"]
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "fake-model", "lora_path": math_dir})
            assert r.status_code == 400
            assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "math"})).status_code == 200
            r = await c.post("/v1/completions", json={"model": "math", "prompt": "a", "max_tokens": 2})
            assert r.status_code == 404
            assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "math"})).status_code == 404
            ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            assert ids == ["fake-model", "sql"]

    run(go())


def test_lora_routes_without_lora_are_400() -> None:
    """A server without --enable-lora answers a load with a 400 naming the flag."""
    async def go() -> None:
        async with asgi_client(FakeEngine()) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
            assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]

    run(go())


def test_load_is_behind_the_api_key(tmp_path) -> None:
    """Without the key a load is a 401 and nothing is loaded; with it, a 200."""
    eng = _engine(tmp_path)
    d = _folder(tmp_path, "k")

    async def go() -> None:
        async with ops_client(eng, OpsConfig(api_key="sk-test")) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "k", "lora_path": d})
            assert r.status_code == 401 and "k" not in eng.loras
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "k", "lora_path": d},
                             headers={"Authorization": "Bearer sk-test"})
            assert r.status_code == 200 and "k" in eng.loras

    run(go())


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--max-loras", "2"], "--max-loras needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "'a' is not NAME=PATH"),
    (["--enable-lora", "--lora-modules", "a={d}", "a={d}"], "the name 'a' is given twice"),
    (["--enable-lora", "--lora-modules", "a={e}"], "has no adapter_config.json"),
], ids=["modules-without-enable", "max-loras-without-enable", "no-equals", "twice", "no-files"])
def test_serve_lora_flag_errors_exit_2(tmp_path, capsys, argv: list[str], message: str) -> None:
    """Each bad LoRA flag is exit 2 with one line naming it, before the model is loaded."""
    from stallfree.cli import main

    d, e = _folder(tmp_path, "ok"), tmp_path / "empty"
    e.mkdir()
    argv = [a.format(d=d, e=e) for a in argv]
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
