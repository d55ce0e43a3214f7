"""Property-based test of the HTTP API from its own OpenAPI schema (Schemathesis over Hypothesis): the
requests it generates from /openapi.json, valid and invalid, never get a 5xx. The server is a live
uvicorn over the fake engine; the checks that need the real engine run in test_engine_view.py."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (test extra)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from server.fake_engine import FakeEngine  # noqa: E402
from server.helpers import LiveServer  # noqa: E402

pytestmark = pytest.mark.slow

# Examples per operation and mode: schema-valid bodies (positive) and schema-violating ones (negative).
EXAMPLES = 40


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_input_gets_a_5xx(mode):
    """Every generated request to POST /v1/completions, POST /v1/chat/completions and GET /v1/models (the
    last in positive mode only: it takes no input) is answered below 500. max_model_len 64 and 256 KV
    tokens: generated prompts often exceed them, so the length and capacity checks run as well as parsing."""
    eng = FakeEngine(token_budget=32, max_seqs=4, kv_tokens=256, max_model_len=64)
    with LiveServer(eng, max_waiting=8, max_request_bytes=64 * 1024) as srv:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]
        operations = [op for op in operations if op.path.startswith("/v1/")]
        assert sorted(f"{op.method.upper()} {op.path}" for op in operations) == [
            "GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions"]
        for op in operations:
            if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
                continue  # /v1/models takes no input: there is nothing to get wrong

            @settings(max_examples=EXAMPLES, suppress_health_check=list(HealthCheck), deadline=None)
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                case.call_and_validate(checks=[not_a_server_error], timeout=10)

            check()
