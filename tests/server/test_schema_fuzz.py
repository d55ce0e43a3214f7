"""Property-based test of the HTTP API from its own OpenAPI schema (Schemathesis over Hypothesis): the
requests it generates from /openapi.json, valid and invalid, never get a 5xx. The server is a live
uvicorn over the fake engine; the checks that need the real engine run in test_engine_view.py.

The schema carries the list limits (maxItems of stop, stop_token_ids, messages and content parts), so the
negative mode also sends lists over them; the encoding cases send the same bodies re-encoded (UTF-16,
UTF-32, Latin-1, with a byte order mark) and arbitrary bytes. Each test prints its case counts."""

from __future__ import annotations

import collections

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (test extra)")

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from server.fake_engine import FakeEngine  # noqa: E402
from server.helpers import LiveServer  # noqa: E402

pytestmark = pytest.mark.slow

# Examples per operation and mode: schema-valid bodies (positive) and schema-violating ones (negative).
EXAMPLES = 40


def _server() -> LiveServer:
    """max_model_len 64 and 256 KV tokens: generated prompts often exceed them, so the length and capacity
    checks run as well as parsing."""
    eng = FakeEngine(token_budget=32, max_seqs=4, kv_tokens=256, max_model_len=64)
    return LiveServer(eng, max_waiting=8, max_request_bytes=64 * 1024)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_input_gets_a_5xx(mode):
    """Every generated request to POST /v1/completions, POST /v1/chat/completions, the LoRA load and unload
    routes (on a server without LoRA: refused, never a 5xx) and GET /v1/models (positive mode only: it takes
    no input) is answered below 500."""
    counts: collections.Counter[str] = collections.Counter()
    with _server() as srv:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]
        operations = [op for op in operations if op.path.startswith("/v1/")]
        assert sorted(f"{op.method.upper()} {op.path}" for op in operations) == [
            "GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/load_lora_adapter",
            "POST /v1/unload_lora_adapter"]
        for op in operations:
            if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
                continue  # /v1/models takes no input: there is nothing to get wrong

            @settings(max_examples=EXAMPLES, suppress_health_check=list(HealthCheck), deadline=None)
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call_and_validate(checks=[not_a_server_error], timeout=10)
                counts[f"{case.method.upper()} {case.path} {response.status_code}"] += 1

            check()
    print(f"\nschema fuzz ({mode.value}): {sum(counts.values())} requests: {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES


_BODY = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(0, 200), max_size=20))},
    optional={"max_tokens": st.integers(1, 8), "stop": st.lists(st.text(min_size=1, max_size=5), max_size=20),
              "model": st.text(max_size=10), "stop_token_ids": st.lists(st.integers(0, 9), max_size=300)},
)
_ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"]


def test_encodings_and_bytes_never_get_a_5xx():
    """Bodies re-encoded in UTF-16, UTF-32, Latin-1 or with a byte order mark, and arbitrary bytes, are
    answered below 500 with a JSON error object; only plain UTF-8 is ever served (200)."""
    import json

    counts: collections.Counter[str] = collections.Counter()
    with _server() as srv, httpx.Client(base_url=srv.url, timeout=10) as client:

        @settings(max_examples=3 * EXAMPLES, suppress_health_check=list(HealthCheck), deadline=None)
        @given(body=_BODY, encoding=st.sampled_from(_ENCODINGS), junk=st.binary(max_size=64),
               use_junk=st.booleans())
        def check(body, encoding, junk, use_junk):
            try:
                raw = junk if use_junk else json.dumps(body, ensure_ascii=False).encode(encoding)
            except UnicodeEncodeError:
                raw = json.dumps(body).encode(encoding)
            r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            kind = "bytes" if use_junk else encoding
            counts[f"{kind} {r.status_code}"] += 1
            assert r.status_code < 500, r.text
            if r.status_code != 200:
                assert set(r.json()) == {"error"}
            else:
                assert kind == "utf-8" or (kind != "bytes" and raw.decode("utf-8", "replace") == raw.decode("utf-8"))

        check()
    print(f"\nencoding fuzz: {sum(counts.values())} requests: {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES


def _list_case(field: str, n: int) -> tuple[str, dict]:
    """(path, body) with a list of n items in `field`."""
    msg = {"role": "user", "content": "hi"}
    if field == "stop":
        return "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["z"] * n}
    if field == "stop_token_ids":
        return "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [1] * n}
    if field == "messages":
        return "/v1/chat/completions", {"messages": [msg] * n, "max_tokens": 1}
    if field == "content":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * n}],
                                        "max_tokens": 1}
    return "/v1/completions", {"prompt": [1] * n, "max_tokens": 1}  # token ids: the limit is the context


def test_list_lengths_around_each_limit():
    """Lists drawn at, just under and just over each limit (and far over): a 400 naming the field when over
    it (or a 413 when the body is over 64 KiB first), never a 5xx; within it, any answer below 500 (the
    context may still refuse)."""
    from stallfree.server import body as limits

    bound = {"stop": limits.MAX_STOP, "stop_token_ids": limits.MAX_STOP_TOKEN_IDS, "messages": limits.MAX_MESSAGES,
             "content": limits.MAX_CONTENT_PARTS, "prompt": 64}
    counts: collections.Counter[str] = collections.Counter()
    with _server() as srv, httpx.Client(base_url=srv.url, timeout=10) as client:

        @settings(max_examples=3 * EXAMPLES, suppress_health_check=list(HealthCheck), deadline=None)
        @given(field=st.sampled_from(sorted(bound)), delta=st.one_of(st.integers(-2, 2), st.integers(3, 5000)))
        def check(field, delta):
            n = max(0, bound[field] + delta)
            path, body = _list_case(field, n)
            r = client.post(path, json=body)
            over = n > bound[field]
            counts[f"{field} {'over' if over else 'within'} {r.status_code}"] += 1
            assert r.status_code < 500, r.text
            if over and r.status_code != 413:  # 413: the body is over the 64 KiB limit first
                err = r.json()["error"]
                assert r.status_code == 400 and (err["param"] in (field, "messages", None)), err

        check()
    print(f"\nlist-length fuzz: {sum(counts.values())} requests: {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES
