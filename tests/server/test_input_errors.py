"""Each a clear error, never a 500 nor an echo: integers too long to print, unbounded priorities, values
quoted back whole, a 500's id and log line, bodies not declared JSON, /metrics under salt isolation."""

from __future__ import annotations

import argparse
import json
import logging

import httpx
import pytest

from server.fake_engine import FakeEngine
from server.helpers import run
from server.ops_helpers import ops_app
from stallfree.server.options import OpsConfig, isolate_metrics
from stallfree.server.request_id import RequestIdFilter

BIG = "x" * 1_900_000
CHAT = [{"role": "user", "content": "hi"}]


async def _post(app, path: str, raw: bytes, ctype: str | None = "application/json", rid: str = "req-1"):
    headers = {"X-Request-Id": rid} | ({"Content-Type": ctype} if ctype else {})
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.post(path, content=raw, headers=headers)


def _app(**engine):
    return ops_app(FakeEngine(**engine), OpsConfig(log_access=False))


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "priority", "seed", "n"])
def test_integer_of_thousands_of_digits_is_a_400(field):
    """4,300 nines in any integer field: a 400 naming the digit count and the limit (was a 500 with no
    X-Request-Id for max_tokens, "sampling failed" for top_k, an echo of 4,000 digits for priority)."""
    raw = b'{"prompt": "hi", "max_tokens": 2, "' + field.encode() + b'": ' + b"9" * 4300 + b"}"
    r = run(_post(_app(), "/v1/completions", raw))
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-1"
    assert r.json()["error"]["message"] == ("the request body holds an integer of 4300 digits; integers may have "
                                            "at most 20 digits")


def test_digits_inside_a_string_are_text():
    """A long digit run in a prompt string is text: served (200)."""
    r = run(_post(_app(), "/v1/completions", json.dumps({"prompt": "1" * 50, "max_tokens": 2}).encode()))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value", "param"), [
    ("priority", -10**7, "priority"), ("priority", 10**7, "priority"), ("top_k", 2**40, "top_k"),
    ("max_tokens", 2**40, "max_tokens"), ("stop_token_ids", [2**40], "stop_token_ids")])
def test_integer_fields_are_bounded(field, value, param):
    """priority within +-1,000,000 (under --scheduling-policy priority -10**4000 was always first),
    top_k, max_tokens and stop token ids within 2**31 - 1: past them a 400 naming the field."""
    app = _app(scheduling_policy="priority")
    r = run(_post(app, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, field: value}).encode()))
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    ok = run(_post(app, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "priority": -10**6}).encode()))
    assert ok.status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "model": BIG}),
    ("/v1/completions", {"prompt": "hi", "suffix": BIG}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 1000: 1.0}}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"x": BIG}]}),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": BIG}),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": BIG}}),
], ids=["model", "suffix", "logit_bias", "tools", "tool_choice", "response_format"])
def test_errors_quote_at_most_60_characters_of_a_value(path, body):
    """A 1.9 MB value is quoted back cut to 60 characters with its length (it came back whole: 1.9 MB)."""
    r = run(_post(_app(), path, json.dumps(body).encode()))
    msg = r.json()["error"]["message"]
    assert r.status_code in (400, 404) and len(msg) < 250, msg[:300]
    assert "characters)" in msg


def test_unhandled_error_is_a_json_500_with_the_request_id_logged_under_it(caplog):
    """An exception out of a route: a JSON 500 carrying X-Request-Id, and the error line logged under that
    request's id (it came from outside the id layer: no header, access status 0, the id of none)."""
    app = _app()
    handler_filter = RequestIdFilter()
    caplog.handler.addFilter(handler_filter)

    def boom(*a, **k):
        raise RuntimeError("injected")

    app.state.server.engine.encode = boom
    with caplog.at_level(logging.ERROR, logger="stallfree.server"):
        r = run(_post(app, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', rid="req-boom"))
    caplog.handler.removeFilter(handler_filter)
    assert r.status_code == 400  # a tokenizer library error on input is the client's 400
    app.state.server.engine.apply_chat_template = boom  # not caught by the route: a bug
    with caplog.at_level(logging.ERROR, logger="stallfree.server"):
        caplog.handler.addFilter(handler_filter)
        r = run(_post(app, "/v1/chat/completions", json.dumps({"messages": CHAT}).encode(), rid="req-boom"))
        caplog.handler.removeFilter(handler_filter)
    assert r.status_code == 500 and r.headers["x-request-id"] == "req-boom"
    assert r.json()["error"]["message"] == ("internal server error (RuntimeError); the server log has the "
                                            "details")
    errors = [rec for rec in caplog.records if rec.levelno == logging.ERROR]
    assert [rec.request_id for rec in errors] == ["req-boom"]


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_body_not_declared_json_is_415(ctype):
    """A web page can POST text/plain, a form or a typeless body to localhost without a preflight: such
    bodies are refused 415 naming the type (they were served)."""
    r = run(_post(_app(), "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', ctype=ctype))
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8",
                                   "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_are_served(ctype):
    """application/json in any case, with a UTF-8 charset, or a +json type: served."""
    r = run(_post(_app(), "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', ctype=ctype))
    assert r.status_code == 200, r.text


def test_salt_isolation_protects_metrics_or_is_refused_without_a_key():
    """--prefix-cache-isolation salt implies --protect-metrics with a key, and is refused without one."""
    keyed, problem = isolate_metrics(OpsConfig(api_key="sk-k"), "salt")
    assert problem is None and keyed is not None and keyed.protect_metrics
    none, problem = isolate_metrics(OpsConfig(), "salt")
    assert none is None and problem is not None and problem.startswith("--prefix-cache-isolation salt needs")
    same, problem = isolate_metrics(OpsConfig(), "none")
    assert problem is None and same == OpsConfig()


def test_serve_refuses_salt_isolation_without_a_key(capsys, monkeypatch):
    """`stallfree serve --prefix-cache-isolation salt` with no key: exit 2 and one line, before any load."""
    from stallfree.server.cli import register

    monkeypatch.delenv("STALLFREE_API_KEY", raising=False)
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    args = p.parse_args(["serve", "--prefix-cache-isolation", "salt", "--device", "cpu"])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stallfree serve: error: --prefix-cache-isolation salt needs")
