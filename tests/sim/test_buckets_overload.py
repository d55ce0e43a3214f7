"""Prompt-length buckets, the fluid burst detector and the overload verdict, on hand-worked cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stallfree.sim.outputs.buckets import PROMPT_BUCKETS, bucket_stats, prompt_bucket
from stallfree.sim.outputs.overload import fluid_bursts, overload, overload_line, queue_grows


def test_bucket_boundaries_are_half_open_at_powers_of_two():
    """1k = 1,024 tokens; each bucket holds lo <= prompt < hi."""
    assert [prompt_bucket(n) for n in (0, 1023, 1024, 4095, 4096, 32767, 32768, 10**6)] == [
        "<1k", "<1k", "1k-4k", "1k-4k", "4k-32k", "4k-32k", "32k+", "32k+"]
    assert [b[0] for b in PROMPT_BUCKETS] == ["<1k", "1k-4k", "4k-32k", "32k+"]
    with pytest.raises(ValueError, match="prompt_len must be >= 0 tokens, got -1"):
        prompt_bucket(-1)


def test_bucket_stats_split_requests_by_prompt_length():
    """Three short requests and one long: each bucket's median and p99 are its own requests'."""
    lat = {
        "rids": np.array([0, 1, 2, 3]),
        "ttft": np.array([0.1, 0.2, 0.3, 5.0]),
        "e2e": np.array([1.0, 1.0, 1.0, 9.0]),
        "tpot": np.array([0.02, 0.04]),  # rid 1 and rid 3; rids 0 and 2 emitted one token
        "tpot_rids": np.array([1, 3]),
    }
    stats = bucket_stats(lat, [10, 500, 1023, 40_000])
    assert list(stats) == ["<1k", "32k+"]
    short = stats["<1k"]
    assert short["requests"] == 3
    assert short["median_ttft_ms"] == pytest.approx(200.0)
    assert short["p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 * 100 (linear interpolation)
    assert short["median_tpot_ms"] == pytest.approx(20.0)
    assert stats["32k+"] == {"requests": 1, "median_ttft_ms": pytest.approx(5000.0),
                             "p99_ttft_ms": pytest.approx(5000.0), "median_tpot_ms": pytest.approx(40.0),
                             "p99_tpot_ms": pytest.approx(40.0), "median_e2el_ms": pytest.approx(9000.0),
                             "p99_e2el_ms": pytest.approx(9000.0)}


def test_fluid_bursts_finds_the_stretch_above_the_rate():
    """mu = 1 req/s; ten arrivals 0.1 s apart bring 10 s of work in 0.9 s: the backlog peaks at
    10 - 0.9 = 9.1 s at t = 0.9 and drains at 0.9 + 9.1 = 10.0 s. The lone arrivals at 20 and 40 s
    are busy periods of one request, no burst."""
    arrivals = [0.1 * k for k in range(10)] + [20.0, 40.0]
    (b,) = fluid_bursts(arrivals, 1.0, 0.5)
    assert (b.start_s, b.requests, b.busy_requests, b.first) == (0.0, 10, 10, 0)
    assert b.peak_s == pytest.approx(0.9)
    assert b.peak_backlog_s == pytest.approx(9.1)
    assert b.end_s == pytest.approx(10.0)
    # The stretch lasts 0.9 s: a minimum of 1 s leaves it out.
    assert fluid_bursts(arrivals, 1.0, 1.0) == []
    # At 20 req/s the ten arrivals (10 per s) never queue.
    assert fluid_bursts(arrivals, 20.0, 0.0) == []
    with pytest.raises(ValueError, match="rate must be a finite number"):
        fluid_bursts(arrivals, 0.0, 0.0)


def test_a_drain_inside_the_busy_period_counts_its_arrivals_too():
    """mu = 1: arrivals at 0, 0.5, 1.0 (peak W = 3 - 1 = 2 s at t = 1) then one at 2.5, before the
    backlog drains at 1 + 2 = 3.0: the busy period holds 4 requests, the burst's stretch 3."""
    (b,) = fluid_bursts([0.0, 0.5, 1.0, 2.5], 1.0, 0.0)
    assert (b.requests, b.busy_requests) == (3, 4)
    assert b.peak_backlog_s == pytest.approx(2.0)
    assert b.end_s == pytest.approx(4.0)  # W at 2.5 is (2 - 1.5) + 1 = 1.5, drained at 2.5 + 1.5


def test_queue_grows_when_late_waits_double_and_exceed_a_second():
    arrival = np.arange(16, dtype=float)
    flat = np.full(16, 0.5)
    assert not queue_grows(arrival, flat)
    rising = arrival * 0.5  # waits 0 .. 7.5 s: second quarter median 2.75 s, last 6.75 s
    assert queue_grows(arrival, rising)
    small = arrival * 0.05  # rises too, but the last quarter waits under 1 s
    assert not queue_grows(arrival, small)


class _Res:
    def __init__(self, arrival, config=None):
        self.arrival = tuple(arrival)
        self.config = config or {}


def test_overload_gives_the_rate_scale_and_replicas_that_fix_it():
    """Offered 10 req/s against a capacity of 4 req/s, no queue growth measured: the rate scale
    must fall below 2 x 4 / 10 = 0.8, or ceil(10 / 4) = 3 replicas serve it."""
    n = 8
    lat = {"rids": np.arange(n), "queue": np.zeros(n), "e2e": np.ones(n)}
    o = overload(_Res(np.arange(n) * 0.1), lat, {"capacity_req_s": 4.0}, 10.0, 2.0)
    assert o == {"offered_rate": 10.0, "sustained_rate": 4.0, "load": 2.5, "queue_grows": False,
                 "rate_scale_below": pytest.approx(0.8), "replicas_needed": 3}
    line = overload_line("chunked/2048", o)
    assert "10.00 req/s offered, the replica sustains ~4.00 (250%)" in line
    assert "--rate-scale below 0.8 or --replicas 3" in line
    # Under capacity and no growing queue: nothing to say.
    assert overload(_Res(np.arange(n) * 0.1), lat, {"capacity_req_s": 40.0}, 10.0, 2.0) is None


def test_summary_and_records_carry_the_buckets():
    """Steps of 1 s, budget 8000: a 100-token prompt and a 5,000-token one arrive at 0 and are both
    prefilled in step 1 (first tokens at 1 s), then decode one token each in step 2 (E2E 2 s)."""
    from stallfree.sim.inputs.workload import Workload
    from stallfree.sim.outputs.records import request_records
    from stallfree.sim.outputs.report import summarize_result
    from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
    from stallfree.sim.run.costs import LinearCostModel
    from stallfree.sim.run.simulator import simulate

    res = simulate(Workload((0.0, 0.0), (100, 5000), (2, 2)), SchedulerConfig(10_000, 8000, 4),
                   LinearCostModel(base_s=1.0, per_token_s=0.0))
    by = summarize_result(res)["by_prompt_len"]
    assert list(by) == ["<1k", "4k-32k"]
    for name in by:
        assert (by[name]["requests"], by[name]["median_ttft_ms"], by[name]["p99_e2el_ms"]) == (1, 1000.0, 2000.0)
        assert by[name]["median_tpot_ms"] == 1000.0
    assert [r["prompt_bucket"] for r in request_records(res)] == ["<1k", "4k-32k"]


def _trace(tmp_path, arrivals):
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{t:.6f},10,1\n" for t in arrivals))
    return str(path)


def test_simulate_warns_once_when_overloaded(tmp_path, capsys):
    """Steps of 1 s holding one request (--max-seqs 1): the replica serves 1 req/s; 20 arrivals 0.1 s
    apart offer 19 / 1.9 = 10 req/s, so the rate scale must fall below 1 x 1 / 10 = 0.1, or 10 replicas."""
    from stallfree.cli import main

    trace = _trace(tmp_path, [0.1 * k for k in range(20)])
    assert main(["simulate", "--trace", trace, "--linear-cost", "1000,0", "--max-num-seqs", "1"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "overloaded" in line]
    assert err == ["warning: chunked/2048: overloaded: 10.00 req/s offered, the replica sustains ~1.00 (1000%); the "
                   "queue grows through the run, so TTFT is mostly waiting: use --rate-scale below 0.1 or --replicas "
                   "10 (stallfree plan finds the count that meets the SLOs)"]


def test_simulate_names_the_burst_of_a_ttft_tail(tmp_path, capsys):
    """Steps of 100 ms, one request each: mu = 10 req/s. 100 arrivals 10 ms apart (0 to 0.99 s) bring
    10 s of work in 0.99 s, then 10 lone ones 100 s apart (0.109 req/s on average: no overload). The
    slowest requests are the burst's last: it is named with its 100 requests."""
    from stallfree.cli import main

    trace = _trace(tmp_path, [0.01 * k for k in range(100)] + [100.0 * k for k in range(1, 11)])
    assert main(["simulate", "--trace", trace, "--linear-cost", "100,0", "--max-num-seqs", "1", "--json"]) == 0
    captured = capsys.readouterr()
    run = json.loads(captured.out)["runs"][0]
    assert run["overload"] is None
    assert (run["tail_burst"]["requests"], run["tail_burst"]["start_s"]) == (100, 0.0)
    assert run["tail_burst"]["peak_s"] == pytest.approx(0.99)
    assert run["tail_burst"]["tail_in_burst"] == run["tail_burst"]["tail_requests"] == 2
    assert ("comes from a burst at 0.0-1.0 s: 100 requests arrived in 1.0 s (101.0 req/s against the ~10.00 "
            "sustained)") in captured.err
