"""Issue 37: one request cannot hurt the others. A fault in one request's sampling fails that request
alone; large inputs are refused before they cost much; bodies are strict (UTF-8 JSON, one framing);
prefix caches can be kept apart (cache_salt); every accepted field is honoured or refused."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.fake_engine import FakeEngine
from server.helpers import WAIT_S, LiveServer, sse_events


def _outcomes(text: str) -> dict[str, float]:
    """finished_reason -> count of stallfree_request_success_total in a /metrics body."""
    return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "stallfree_request_success_total"}


# ---------------------------------------------------------------- 1. a sampling fault fails its request alone


def test_sampling_fault_fails_one_request_beside_a_live_stream():
    """A request whose sampling fails (the engine's "error" output) is answered 500 (whole) or an error
    event (streamed), counted as one "error"; a stream running beside it gets all 40 of its tokens and
    finishes with "length"; KV is all free afterwards."""
    eng = FakeEngine(step_time_s=0.002)
    eng.fail_sampling = lambda p: p.temperature == 1.3
    with LiveServer(eng) as srv:
        got: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=WAIT_S,
                              json={"prompt": "hi", "max_tokens": 40, "stream": True}) as r:
                got["events"] = sse_events(r.read().decode())

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.02)
        whole = httpx.post(srv.url + "/v1/completions", timeout=WAIT_S,
                           json={"prompt": "x", "max_tokens": 4, "temperature": 1.3})
        streamed = httpx.post(srv.url + "/v1/chat/completions", timeout=WAIT_S,
                              json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                    "temperature": 1.3, "stream": True})
        t.join(WAIT_S)
        assert whole.status_code == 500
        assert whole.json()["error"]["message"] == "injected sampling failure"
        events = sse_events(streamed.text)
        assert events[-2]["error"]["message"] == "injected sampling failure" and events[-1] == "[DONE]"
        live = got["events"]
        assert live[-1] == "[DONE]" and live[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) for e in live[:-1]) == 40
        srv.wait_idle()
        assert _outcomes(httpx.get(srv.url + "/metrics", timeout=WAIT_S).text) == {"length": 1.0, "error": 2.0}
