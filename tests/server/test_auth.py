"""--api-key: every /v1 route needs `Authorization: Bearer KEY` (401 with OpenAI's error object
otherwise), /health stays open, /metrics too unless --protect-metrics; the key is never echoed or
logged; the official openai client works with the key and gets AuthenticationError without it."""

from __future__ import annotations

import logging

import openai
import pytest

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, run
from server.ops_helpers import OpsLiveServer, ops_client
from stallfree.server.options import OpsConfig, ops_from_args, resolve_api_key

KEY = "sk-stallfree-test-5f1c2a"
GOOD = {"Authorization": f"Bearer {KEY}"}
BODY = {"prompt": "hi", "max_tokens": 3}


def test_missing_and_wrong_key_are_401_with_openai_error():
    """No header, a wrong key, another scheme: 401, invalid_api_key, a Bearer challenge, no key echoed."""

    async def go():
        async with ops_client(FakeEngine(), OpsConfig(api_key=KEY)) as c:
            cases = [({}, "Missing API key", 'Bearer realm="stallfree"'),
                     ({"Authorization": "Bearer sk-wrong-guess"}, "Incorrect API key provided",
                      'Bearer realm="stallfree", error="invalid_token"'),
                     ({"Authorization": f"Bearer {KEY}x"}, "Incorrect API key provided",
                      'Bearer realm="stallfree", error="invalid_token"'),
                     ({"Authorization": f"Basic {KEY}"}, "Bearer scheme",
                      'Bearer realm="stallfree", error="invalid_request"')]
            for headers, needle, challenge in cases:
                r = await c.post("/v1/completions", json=BODY, headers=headers)
                assert r.status_code == 401
                err = r.json()["error"]
                assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)
                assert needle in err["message"]
                assert r.headers["www-authenticate"] == challenge
                assert KEY not in r.text and "sk-wrong-guess" not in r.text
            assert c.app.state.server.async_engine.num_steps == 0  # nothing reached the engine

    run(go())


def test_right_key_serves_and_scheme_is_case_insensitive():
    """With the key every /v1 route answers (completions, chat, models); `bearer` works as `Bearer`."""

    async def go():
        async with ops_client(FakeEngine(), OpsConfig(api_key=KEY)) as c:
            r = await c.post("/v1/completions", json=BODY, headers=GOOD)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "r t"
            r = await c.post("/v1/chat/completions", headers={"Authorization": f"bearer {KEY}"},
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            r = await c.get("/v1/models", headers=GOOD)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
            assert (await c.get("/v1/models")).status_code == 401
            # An unknown /v1 route is a 401 without the key (the key guards the route list), a 404 with it.
            assert (await c.get("/v1/nothing")).status_code == 401
            assert (await c.get("/v1/nothing", headers=GOOD)).status_code == 404

    run(go())


@pytest.mark.parametrize("protect", [False, True], ids=["metrics-open", "metrics-protected"])
def test_health_open_metrics_open_unless_protected(protect):
    """/health never needs the key; /metrics needs it only with protect_metrics."""

    async def go():
        async with ops_client(FakeEngine(), OpsConfig(api_key=KEY, protect_metrics=protect)) as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.get("/metrics")
            assert r.status_code == (401 if protect else 200)
            r = await c.get("/metrics", headers=GOOD)
            assert r.status_code == 200 and "stallfree_requests_refused_total" in r.text

    run(go())


def test_key_is_never_logged(caplog):
    """Requests with the right and a wrong key leave neither in any log record; repr hides the key."""
    caplog.set_level(logging.DEBUG)

    async def go():
        async with ops_client(FakeEngine(), OpsConfig(api_key=KEY)) as c:
            await c.post("/v1/completions", json=BODY, headers=GOOD)
            await c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sk-wrong-guess"})

    run(go())
    assert "stallfree.server.access" in {r.name for r in caplog.records}  # the access lines were logged
    assert KEY not in caplog.text and "sk-wrong-guess" not in caplog.text
    assert KEY not in repr(OpsConfig(api_key=KEY)) and "<set>" in repr(OpsConfig(api_key=KEY))


def test_flag_wins_over_environment_and_bad_keys_are_refused_without_echo():
    """--api-key beats STALLFREE_API_KEY; an empty env var is unset; a key with a space is refused
    naming its source, not its value; --protect-metrics without a key is refused."""
    env = {"STALLFREE_API_KEY": "sk-from-env"}
    assert resolve_api_key("sk-flag", env) == ("sk-flag", "--api-key")
    assert resolve_api_key(None, env) == ("sk-from-env", "STALLFREE_API_KEY")
    assert resolve_api_key(None, {"STALLFREE_API_KEY": ""}) == (None, "none")
    with pytest.raises(ValueError, match="STALLFREE_API_KEY must be visible ASCII") as info:
        resolve_api_key(None, {"STALLFREE_API_KEY": "sk secret"})
    assert "sk secret" not in str(info.value)
    with pytest.raises(ValueError, match="--api-key is empty"):
        resolve_api_key("", env)

    from stallfree import cli

    args = cli.build_parser().parse_args(["serve", "--protect-metrics"])
    assert ops_from_args(args, {}) == (None, "--protect-metrics needs --api-key or STALLFREE_API_KEY")


def test_serve_refuses_a_bad_key_before_loading(monkeypatch, capsys):
    """`serve --api-key 'two words'` exits 2 before the model loads, without printing the key."""
    from stallfree import cli
    from stallfree.server import cli as serve_cli

    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--api-key", "two words"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stallfree serve: error: --api-key must be visible ASCII") and "two words" not in err


def test_openai_client_with_and_without_the_key():
    """The official client: with api_key=KEY completions stream and return; a wrong key raises
    AuthenticationError (401, code invalid_api_key); /health answers without a key."""
    import httpx

    with OpsLiveServer(FakeEngine(), OpsConfig(api_key=KEY)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
        assert client.completions.create(model="fake-model", prompt="hi", max_tokens=3).choices[0].text == "r t"
        text = "".join(c.choices[0].text for c in
                       client.completions.create(model="fake-model", prompt="hi", max_tokens=3, stream=True))
        assert text == "r t"
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong-guess", max_retries=0, timeout=WAIT_S)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert "sk-wrong-guess" not in str(info.value.body)
        assert httpx.get(srv.url + "/health", timeout=WAIT_S).status_code == 200
