"""Latency metrics on hand-computed timelines."""

from __future__ import annotations

import math

import pytest

from stallfree.core.metrics import (
    RequestTimeline,
    e2e,
    goodput,
    itl,
    meets_slo,
    parse_duration,
    percentile,
    queueing_delay,
    stats_ms,
    summarize,
    tpot,
    ttft,
)

# Request 0: arrives at 0, admitted at 0.25, tokens at 0.5, 0.75, 1.25.
A = RequestTimeline(rid=0, arrival=0.0, token_times=(0.5, 0.75, 1.25), prompt_len=10, admitted=0.25)
# Request 1: arrives at 1.0, admitted at once, one token at 3.0.
B = RequestTimeline(rid=1, arrival=1.0, token_times=(3.0,), prompt_len=6, admitted=1.0)


def test_ttft_tpot_itl_e2e_by_hand():
    """TTFT, TPOT, ITL, E2E and queueing delay match the hand computation."""
    assert ttft(A) == 0.5
    assert tpot(A) == pytest.approx((1.25 - 0.5) / 2)
    assert itl(A) == [0.25, 0.5]
    assert e2e(A) == 1.25
    assert queueing_delay(A) == 0.25


def test_one_token_request_has_no_tpot():
    """A one-token request has a TTFT and E2E but no TPOT and no ITL."""
    assert ttft(B) == 2.0
    assert tpot(B) is None
    assert itl(B) == []
    assert e2e(B) == 2.0


def test_finish_after_last_token_counts_in_tpot_and_e2e():
    """An explicit finish later than the last token is used for TPOT and E2E."""
    tl = RequestTimeline(rid=2, arrival=0.0, token_times=(1.0, 2.0), finish=4.0)
    assert tpot(tl) == 3.0
    assert e2e(tl) == 4.0


def test_percentile_interpolates_linearly():
    """Percentiles interpolate between order statistics like numpy's default."""
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("bad", [[], [1.0]], ids=["empty", "q-out-of-range"])
def test_percentile_rejects_bad_input(bad):
    """An empty sample or a q outside [0, 100] raises ValueError."""
    with pytest.raises(ValueError):
        percentile(bad, 101 if bad else 50)


def test_stats_ms_population_std_and_keys():
    """stats_ms reports mean, median, population std and percentiles in ms under vLLM-style keys."""
    out = stats_ms("ttft", [0.1, 0.3], percentiles=(99,))
    assert out["mean_ttft_ms"] == pytest.approx(200.0)
    assert out["median_ttft_ms"] == pytest.approx(200.0)
    assert out["std_ttft_ms"] == pytest.approx(100.0)
    assert out["p99_ttft_ms"] == pytest.approx(298.0)
    assert stats_ms("tpot", []) == dict.fromkeys(
        ["mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms"]
    )


def test_meets_slo_judges_one_token_requests_on_ttft_alone():
    """A one-token request meets a TPOT objective vacuously; TTFT is still enforced."""
    assert meets_slo(B, slo_ttft=2.0, slo_tpot=0.001)
    assert not meets_slo(B, slo_ttft=1.9)
    assert meets_slo(A, slo_ttft=0.5, slo_tpot=0.375)
    assert not meets_slo(A, slo_tpot=0.374)
    assert not meets_slo(RequestTimeline(rid=3, arrival=0.0, token_times=()))


def test_summarize_by_hand():
    """summarize gives the vLLM serving-benchmark keys with hand-computed values."""
    s = summarize([A, B], slo_ttft=1.0)
    duration = 3.0  # first arrival 0 to last finish 3.0
    assert s["completed"] == 2
    assert s["total_input_tokens"] == 16
    assert s["total_output_tokens"] == 4
    assert s["duration_s"] == duration
    assert s["request_throughput"] == pytest.approx(2 / duration)
    assert s["output_throughput"] == pytest.approx(4 / duration)
    assert s["total_token_throughput"] == pytest.approx(20 / duration)
    assert s["request_goodput"] == pytest.approx(1 / duration)  # B's TTFT of 2 s misses 1 s
    assert s["mean_ttft_ms"] == pytest.approx(1250.0)
    assert s["median_tpot_ms"] == pytest.approx(375.0)
    assert s["mean_itl_ms"] == pytest.approx(375.0)
    assert s["p99_e2el_ms"] == pytest.approx(1250 + 0.99 * 750)
    assert s["mean_queue_ms"] == pytest.approx(125.0)


def test_goodput_without_slo_counts_every_finished_request():
    """With no objective every finished request is good."""
    assert goodput([A, B]) == pytest.approx(2 / 3.0)
    assert summarize([A, B])["request_goodput"] is None


def test_timeline_rejects_time_going_backwards():
    """A token earlier than arrival or than the previous token raises ValueError naming it."""
    with pytest.raises(ValueError, match=r"token_times\[1\]"):
        RequestTimeline(rid=0, arrival=0.0, token_times=(1.0, 0.5))
    with pytest.raises(ValueError, match="arrival"):
        RequestTimeline(rid=0, arrival=2.0, token_times=(1.0,))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("200ms", 0.2), ("0.5s", 0.5), ("200", 0.2), (" 1.5S ", 1.5), ("0", 0.0)],
    ids=["ms", "s", "bare-ms", "upper-s", "zero"],
)
def test_parse_duration(text, seconds):
    """Durations take ms or s suffixes; a bare number is ms."""
    assert math.isclose(parse_duration(text), seconds)


@pytest.mark.parametrize("text", ["fast", "-5ms", "nan", "1h"], ids=["word", "negative", "nan", "hours"])
def test_parse_duration_rejects_bad_text(text):
    """A non-duration raises ValueError quoting the text."""
    with pytest.raises(ValueError, match=repr(text)):
        parse_duration(text)
