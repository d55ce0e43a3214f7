"""Tenants on the server: the keys file, a key's tenant through to the scheduler, the access log, per-tenant
metrics, --max-waiting-tokens and the queue time limit (429 queue_timeout)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from server.fake_engine import FakeEngine
from server.helpers import asgi_client, run
from server.ops_helpers import ops_client
from stallfree.server.options import OpsConfig, ServerConfigError
from stallfree.server.tenants import (
    MAX_TENANT_LABELS,
    OTHER_TENANT,
    TokenRateLimiter,
    load_api_keys_file,
    tenant_label,
)

KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}


def _write(tmp_path, text: str):
    p = tmp_path / "keys.csv"
    p.write_text(text)
    return p


def test_keys_file_is_read(tmp_path):
    """Two keys of alice (weight 2) and one of bob (weight 1); blank lines are skipped."""
    p = _write(tmp_path, "key,tenant,weight\nsk-alice-1,alice,2\n\nsk-alice-2,alice,2\nsk-bob,bob,1\n")
    keys = load_api_keys_file(p)
    assert dict(keys.keys) == KEYS
    assert dict(keys.weights) == {"alice": 2.0, "bob": 1.0}
    assert "sk-" not in repr(keys)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("key,tenant\nsk-a,a\n", ":1: the header must be key,tenant,weight"),
        ("key,tenant,weight\nsk-a,a,1\nsk-a,b,1\n", ":3: this key is given twice"),
        ("key,tenant,weight\nsk-a,a\n", ":2: expected 3 fields"),
        ("key,tenant,weight\nsk-a,a,0\n", ":2: weight must be a finite number > 0, got '0'"),
        ("key,tenant,weight\nsk-a,a,-1\n", "got '-1'"),
        ("key,tenant,weight\nsk-a,a,nan\n", "got 'nan'"),
        ("key,tenant,weight\nsk-a,a,inf\n", "got 'inf'"),
        ("key,tenant,weight\nsk-a,a,heavy\n", "got 'heavy'"),
        ("key,tenant,weight\nsk a,a,1\n", ":2: the key must be visible ASCII"),
        ("key,tenant,weight\nsk-a,,1\n", ":2: tenant must be 1 to 128 characters"),
        ("key,tenant,weight\nsk-a,a,1\nsk-b,a,2\n", "tenant 'a' has weight 1 on an earlier row, 2 here"),
        ("key,tenant,weight\n", "no key"),
    ],
    ids=["header", "duplicate", "fields", "weight-0", "weight-neg", "weight-nan", "weight-inf", "weight-text",
         "key-space", "tenant-empty", "two-weights", "empty"],
)
def test_bad_keys_file_is_refused_naming_the_line_never_the_key(tmp_path, text, words):
    """Each bad file is one ServerConfigError naming the file and line, without the key itself."""
    with pytest.raises(ServerConfigError) as e:
        load_api_keys_file(_write(tmp_path, text))
    assert words in str(e.value)
    assert "sk-a," not in str(e.value) and "sk a" not in str(e.value)


def test_serve_exits_2_on_a_bad_keys_file_or_two_key_options(tmp_path, monkeypatch, capsys):
    """`serve --api-keys-file` with a duplicate key, or with --api-key as well, exits 2 before the model loads."""
    from stallfree import cli
    from stallfree.server import cli as serve_cli

    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    bad = _write(tmp_path, "key,tenant,weight\nsk-a,a,1\nsk-a,b,1\n")
    assert cli.main(["serve", "--api-keys-file", str(bad)]) == 2
    assert "this key is given twice" in capsys.readouterr().err
    good = _write(tmp_path, "key,tenant,weight\nsk-a,a,1\n")
    assert cli.main(["serve", "--api-keys-file", str(good), "--api-key", "sk-x"]) == 2
    assert "give one" in capsys.readouterr().err
    for argv in (["serve", "--fairness", "wfq"], ["serve", "--tenant-weights", "a=0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    assert "weight of tenant 'a': expected a number > 0, got '0'" in capsys.readouterr().err


def test_a_keys_tenant_reaches_the_scheduler_the_log_and_the_metrics(caplog):
    """A request with bob's key is added as tenant "bob" (the scheduler under fairness="vtc" counts its
    tokens), its access line ends with tenant=bob, and /metrics counts its served tokens: 2 prompt tokens at
    the first token, then 3 generated."""
    engine = FakeEngine(fairness="vtc", tenant_weights={"alice": 2.0})

    async def go():
        async with ops_client(engine, OpsConfig(api_keys=KEYS)) as c:
            r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 3},
                             headers={"Authorization": "Bearer sk-bob"})
            assert r.status_code == 200, r.text
            wrong = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"},
                                 headers={"Authorization": "Bearer sk-carol"})
            assert wrong.status_code == 401
            return (await c.get("/metrics")).text

    with caplog.at_level(logging.INFO, logger="stallfree.server.access"):
        metrics = run(go())
    assert list(engine.tenants.values()) == ["bob"]
    # Planned by the core: 2 prefill + 2 decodes (the first token comes from the prefill).
    assert engine.scheduler.stats().tenant_served_tokens == {"bob": 4}
    assert 'stallfree_tenant_served_tokens_total{model_name="fake-model",tenant="bob"} 5.0' in metrics
    assert 'stallfree_tenant_queued_tokens{model_name="fake-model",tenant="bob"} 0.0' in metrics
    lines = [r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage()]
    assert lines[0].endswith("tenant=bob") and "sk-bob" not in " ".join(lines)


def test_tenant_labels_are_bounded():
    """Past MAX_TENANT_LABELS tenants the metrics label the rest "other"."""
    known: set[str] = set()
    labels = [tenant_label(f"t{i}", known) for i in range(MAX_TENANT_LABELS + 3)]
    assert labels[:MAX_TENANT_LABELS] == [f"t{i}" for i in range(MAX_TENANT_LABELS)]
    assert labels[MAX_TENANT_LABELS:] == [OTHER_TENANT] * 3
    assert tenant_label("t0", known) == "t0"


def test_max_waiting_tokens_answers_429_queue_full():
    """--max-waiting-tokens 4: a 5-token prompt is refused (429 queue_full), a 4-token one is served, and
    nothing is left queued."""
    async def go():
        async with asgi_client(FakeEngine(), max_waiting_tokens=4) as c:
            big = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 2})
            small = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "hell", "max_tokens": 2})
            aeng = c.app.state.server.async_engine  # type: ignore[attr-defined]
            return big, small, aeng

    big, small, aeng = run(go())
    assert big.status_code == 429 and big.json()["error"]["code"] == "queue_full"
    assert "--max-waiting-tokens 4" in big.json()["error"]["message"]
    assert small.status_code == 200
    assert aeng.queued_tokens == 0


def test_queue_timeout_is_429_with_retry_after():
    """One slot, steps of 50 ms, a 0.1 s queue limit: a request queued behind a 20-token generation (about
    1 s) is shed with 429, code queue_timeout and Retry-After; the first completes; no KV is left."""
    engine = FakeEngine(max_seqs=1, step_time_s=0.05, max_queue_time_s=0.1, clock=time.monotonic)

    async def go():
        async with asgi_client(engine) as c:
            first = asyncio.ensure_future(c.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 20}))
            await asyncio.sleep(0.02)
            second = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "yo", "max_tokens": 2})
            return await first, second

    first, second = run(go())
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "queue_timeout"
    assert second.headers["retry-after"] == "1"


def test_token_bucket_by_hand():
    """600 tokens a minute (10 a second): a full bucket gives 500 then 100; the next 50 wait 5 s; after 5 s
    they pass; a request over a minute's allowance passes on a full bucket; tenants have their own."""
    now = [0.0]
    lim = TokenRateLimiter(600, clock=lambda: now[0])
    assert lim.take("a", 500) is None and lim.take("a", 100) is None
    assert lim.take("a", 50) == pytest.approx(5.0)
    assert lim.take("b", 600) is None
    now[0] = 5.0
    assert lim.take("a", 50) is None
    now[0] = 200.0
    assert lim.take("a", 10_000) is None
    with pytest.raises(ServerConfigError, match="tenant_tokens_per_minute must be an integer >= 1, got 0"):
        TokenRateLimiter(0)


def test_tenant_rate_limit_answers_429_rate_limited():
    """--tenant-tokens-per-minute 10: alice's first request (2 prompt + 3 max_tokens) and her second (with her
    other key) empty her bucket, her third is refused (429 rate_limited, Retry-After), bob's bucket is his own."""
    async def go():
        async with ops_client(FakeEngine(), OpsConfig(api_keys=KEYS), tenant_tokens_per_minute=10) as c:
            out = []
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}
            for key in ("sk-alice-1", "sk-alice-2", "sk-alice-1", "sk-bob"):
                out.append(await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}))
            return out

    a1, a2, a3, b = run(go())
    assert [r.status_code for r in (a1, a2, a3, b)] == [200, 200, 429, 200]
    assert a3.json()["error"]["code"] == "rate_limited" and int(a3.headers["retry-after"]) >= 1
