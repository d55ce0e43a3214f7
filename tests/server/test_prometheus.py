"""ServerMetrics: TTFT, ITL, TPOT and E2E from request timestamps (the B25 scenario), and the stats line."""

from __future__ import annotations

import pytest

from server.fake_engine import FakeEngine, FakeSamplingParams
from stallfree.engine.outputs import EngineStats
from stallfree.server.async_engine import RequestRecord
from stallfree.server.prometheus import ServerMetrics


def _feed(m: ServerMetrics, rec: RequestRecord, times: list[float]) -> None:
    for t in times:
        m.on_tokens(rec, 1, t)
        if rec.first_token_time is None:
            rec.first_token_time = t
        rec.last_token_time = t
        rec.num_generated += 1
    rec.finish_time = times[-1]
    rec.finish_reason = "stop"
    m.on_finish(rec)


def test_b25_ttft_itl_tpot_by_hand():
    """Tokens at 0.50, 0.55, 0.62, 0.70 and a one-token request at 0.30: TTFT sum 0.80, ITL 0.05+0.07+0.08,
    one TPOT of 0.2/3, E2E sum 1.00."""
    m = ServerMetrics("m")
    _feed(m, RequestRecord("a", 0.0, num_prompt_tokens=5), [0.50, 0.55, 0.62, 0.70])
    _feed(m, RequestRecord("b", 0.0, num_prompt_tokens=3), [0.30])
    get = m.registry.get_sample_value
    lab = {"model_name": "m"}
    assert get("stallfree_time_to_first_token_seconds_count", lab) == 2
    assert get("stallfree_time_to_first_token_seconds_sum", lab) == pytest.approx(0.80)
    assert get("stallfree_inter_token_latency_seconds_count", lab) == 3
    assert get("stallfree_inter_token_latency_seconds_sum", lab) == pytest.approx(0.20)
    assert get("stallfree_time_per_output_token_seconds_count", lab) == 1  # the 1-token request has none
    assert get("stallfree_time_per_output_token_seconds_sum", lab) == pytest.approx(0.2 / 3)
    assert get("stallfree_e2e_request_latency_seconds_sum", lab) == pytest.approx(1.00)
    assert get("stallfree_generation_tokens_total", lab) == 5
    assert get("stallfree_prompt_tokens_total", lab) == 8
    assert get("stallfree_request_success_total", {**lab, "finished_reason": "stop"}) == 2
    # ITL buckets (cumulative): none <= 0.04; 0.05 and 0.07 <= 0.075; all three <= 0.1.
    assert get("stallfree_inter_token_latency_seconds_bucket", {**lab, "le": "0.04"}) == 0
    assert get("stallfree_inter_token_latency_seconds_bucket", {**lab, "le": "0.075"}) == 2
    assert get("stallfree_inter_token_latency_seconds_bucket", {**lab, "le": "0.1"}) == 3


def test_gauges_and_stats_line():
    """A snapshot of running 1, waiting 1 and 48 of 64 KV tokens free: gauges and the log line say so."""
    stats = EngineStats(num_running=1, num_waiting=1, num_will_wait=1, kv_free_tokens=48, kv_total_tokens=64,
                        num_preemptions=0, last_step_tokens=10)
    m = ServerMetrics("m")
    m.on_step(stats, 0.01)
    get = m.registry.get_sample_value
    assert get("stallfree_num_requests_running", {"model_name": "m"}) == 1
    assert get("stallfree_num_requests_waiting", {"model_name": "m"}) == 1
    assert get("stallfree_kv_cache_usage_ratio", {"model_name": "m"}) == 0.25
    assert get("stallfree_tokens_per_step_sum", {"model_name": "m"}) == 10
    line = m.stats_line()
    assert "running 1 | waiting 1 | KV usage 25.0%" in line


def test_fake_engine_stats_after_a_step():
    """The fake's snapshot after one step of "a" (10 + 6 tokens, admitted) and "b" (60 + 4, waits: 16 + 64
    > 64 KV tokens): running 1, waiting 1 of which 1 will wait, 48 KV tokens free, 10 tokens (a's prompt)."""
    eng = FakeEngine(kv_tokens=64, max_model_len=128)
    eng.add_request("a", "x" * 10, FakeSamplingParams(max_tokens=6))
    eng.add_request("b", "x" * 60, FakeSamplingParams(max_tokens=4))
    eng.step()
    assert eng.stats() == EngineStats(num_running=1, num_waiting=1, num_will_wait=1, kv_free_tokens=48,
                                      kv_total_tokens=64, num_preemptions=0, last_step_tokens=10)


def _stats(preemptions: int) -> EngineStats:
    return EngineStats(0, 0, 0, 10, 10, preemptions, 0)


def test_preemptions_counted_from_the_engine_total():
    """The engine's num_preemptions total becomes increments of stallfree_preemptions_total."""
    m = ServerMetrics("m")
    m.on_step(_stats(2), 0.0)
    m.on_step(_stats(5), 0.0)
    assert m.registry.get_sample_value("stallfree_preemptions_total", {"model_name": "m"}) == 5
