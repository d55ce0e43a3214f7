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


def test_short_soak_with_churn_has_no_5xx_and_gauges_back_to_zero(tmp_path) -> None:
    """Four clients over base and three adapters while a fourth is loaded and unloaded 10 times: every
    answer is a 200 (or a 404 for the fourth while unloaded), the active gauges end at 0 and all KV is free."""
    import asyncio
    import random

    eng = FakeEngine(enable_lora=True, max_loras=2, step_time_s=0.001, max_seqs=4,
                     lora_modules={n: _folder(tmp_path, n) for n in ("a1", "a2", "a3")})
    hot = _folder(tmp_path, "hot")
    statuses: dict[tuple[str, int], int] = {}

    async def client(c, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            model = rng.choice(["fake-model", "a1", "a2", "a3", "hot"])
            r = await c.post("/v1/completions", json={"model": model, "prompt": "abc", "max_tokens": 3,
                                                      "stream": rng.random() < 0.5})
            key = (model, r.status_code)
            statuses[key] = statuses.get(key, 0) + 1

    async def churn(c) -> None:
        for _ in range(10):
            assert (await c.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": hot})
                    ).status_code == 200
            await asyncio.sleep(0.002)
            assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})).status_code == 200

    async def go() -> None:
        async with asgi_client(eng) as c:
            await asyncio.gather(*(client(c, i) for i in range(4)), churn(c))
            from server.helpers import wait_idle

            await wait_idle(c.app, eng)
            for name in ("a1", "a2", "a3", "hot"):
                assert _metric(c, "stallfree_lora_requests_active", {"lora": name}) in (0, None)

    run(go())
    assert sum(statuses.values()) == 100
    assert all(s == 200 or (m == "hot" and s == 404) for m, s in statuses), statuses
    assert eng.scheduler.stats().num_running == 0 and eng.scheduler.kv_free == eng.scheduler.stats().kv_total


@pytest.mark.slow
def test_lora_soak_benchmark_short_run() -> None:
    """benchmarks/lora_soak.py for 8 s against the real engine: no 5xx, no transport or stream error, every
    gauge back to zero (the script's own checks, its exit code 0)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "lora_soak.py"), "--duration", "8",
                          "--clients", "2", "--max-tokens", "4", "--churn-interval", "2", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["num_5xx"] == 0 and report["loads"] >= 1
