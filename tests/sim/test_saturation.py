"""Saturation said out loud: `saturated`, `saturated_window_s` and the header line (stallfree.sim.outputs.overload)."""

from __future__ import annotations

import json
from array import array

import numpy as np
import pytest

from stallfree.sim.outputs.overload import SATURATION_LOAD, saturation, saturation_line
from stallfree.sim.studies.ranges import STEP_TIME_HIGH


class _Res:
    """The fields of a SimResult that saturation reads: arrivals and 100 ms steps."""

    def __init__(self, arrival):
        self.arrival = tuple(arrival)
        self.step_start = array("d", [0.1 * k for k in range(len(arrival))])
        self.step_end = array("d", [0.1 * (k + 1) for k in range(len(arrival))])


def _lat(n):
    return {"rids": np.arange(n), "queue": np.zeros(n), "e2e": np.ones(n), "ttft": np.ones(n)}


def test_saturation_load_is_the_rate_sustained_at_the_slow_end_of_the_error_model():
    """The threshold is 1 / STEP_TIME_HIGH of the sustained rate: steps that much slower sustain no more."""
    assert SATURATION_LOAD == pytest.approx(1 / STEP_TIME_HIGH)
    assert 0.8 < SATURATION_LOAD < 0.95


def test_a_run_offered_above_the_threshold_is_saturated_through_the_run():
    """Evenly spaced arrivals (no burst): capacity 4 req/s, offered 3.9 req/s (97.5% >= the threshold) is
    saturated by load over its whole arrival window; offered 2 req/s (50%) is not."""
    arrivals = [k / 3.9 for k in range(40)]
    s = saturation(_Res(arrivals), _lat(40), {"capacity_req_s": 4.0}, 3.9, None)
    assert s == {"saturated": True, "saturated_window_s": [0.0, pytest.approx(39 / 3.9)], "saturated_by": "load"}
    arrivals = [k / 2.0 for k in range(40)]
    assert saturation(_Res(arrivals), _lat(40), {"capacity_req_s": 4.0}, 2.0, None) == {
        "saturated": False, "saturated_window_s": None, "saturated_by": None}


def test_every_overloaded_run_is_saturated():
    """An overload (offered past the sustained rate) implies saturation, whatever the capacity says."""
    s = saturation(_Res([0.0, 1.0]), _lat(2), {"capacity_req_s": 100.0}, 1.0, {"load": 1.2})
    assert (s["saturated"], s["saturated_by"], s["saturated_window_s"]) == (True, "overload", [0.0, 1.0])


def test_every_request_at_one_instant_is_saturated():
    """All arrivals at 0 s: the queue is the whole of the tail."""
    s = saturation(_Res([0.0] * 5), _lat(5), {"capacity_req_s": 1.0}, None, None)
    assert (s["saturated"], s["saturated_by"], s["saturated_window_s"]) == (True, "one instant", [0.0, 0.0])


def _trace(tmp_path, arrivals):
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{t:.6f},10,1\n" for t in arrivals))
    return str(path)


def test_simulate_marks_the_window_whose_queue_grows(tmp_path, capsys):
    """Steps of 100 ms, one request each: mu = 10 req/s, the threshold rate 10 / STEP_TIME_HIGH. 100 arrivals
    10 ms apart then 10 lone ones 100 s apart (0.109 req/s on average): not overloaded, but the burst's fluid
    backlog at the threshold rate peaks at 100 x STEP_TIME_HIGH / 10 - 0.99 s and drains at
    100 x STEP_TIME_HIGH / 10 s (Lindley's recursion by hand): that window is saturated."""
    from stallfree.cli import main

    trace = _trace(tmp_path, [0.01 * k for k in range(100)] + [100.0 * k for k in range(1, 11)])
    args = ["simulate", "--trace", trace, "--linear-cost", "100,0", "--max-num-seqs", "1", "--no-range"]
    assert main([*args, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["overload"] is None
    assert run["saturated"] is True
    assert run["saturated_by"] == "window"
    assert run["saturated_window_s"] == [0.0, pytest.approx(100 * STEP_TIME_HIGH / 10)]
    assert main(args) == 0
    out = capsys.readouterr().out
    end = run["saturated_window_s"][1]
    # The window's 100 arrivals over its 12.31 s are 8.12 req/s, 81% of the 10 req/s capacity, however light
    # the run's mean load (110 requests over 1,000 s against 10 req/s: 1%).
    assert round(100 / end / run["capacity_req_s"], 2) == 0.81 and round(SATURATION_LOAD, 2) == 0.81
    assert (f"warning: chunked/2048: saturated at 0.0-{end:,.1f} s (arrivals there average 81% of capacity, "
            f"against {run['load']:.0%} over the run): TTFT and queueing tails there are unreliable") in out
    assert "; requests were left waiting after " in out and "% of the steps" in out


def test_simulate_of_a_light_even_load_is_not_saturated(tmp_path, capsys):
    """Steps of 100 ms, one request each (10 req/s sustained), arrivals 1 s apart: 10% load, no line."""
    from stallfree.cli import main

    trace = _trace(tmp_path, [1.0 * k for k in range(30)])
    args = ["simulate", "--trace", trace, "--linear-cost", "100,0", "--max-num-seqs", "1", "--no-range"]
    assert main([*args, "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert (run["saturated"], run["saturated_window_s"], run["saturated_by"]) == (False, None, None)
    assert main(args) == 0
    assert "warning" not in capsys.readouterr().out


def test_saturation_line_names_the_window_and_the_reason():
    """The line of a window, and of a load, as the header prints them."""
    line = saturation_line("x", {"saturated_window_s": [1.0, 12.5], "saturated_by": "window", "load": 0.69})
    assert line.startswith("warning: x: saturated at 1.0-12.5 s (arrivals there average 81% of capacity, against "
                           "69% over the run): TTFT and queueing tails there are unreliable, as steps 23.1% slower")
    line = saturation_line("x", {"saturated_window_s": [1.0, 12.5], "saturated_by": "window"})
    assert line.startswith("warning: x: saturated at 1.0-12.5 s (arrivals there average 81% of capacity): ")
    line = saturation_line("x", {"saturated_window_s": [0.0, 9.0], "saturated_by": "load", "load": 0.9})
    assert line.startswith(f"warning: x: saturated through the run (offered 90% of capacity, at or above "
                           f"{SATURATION_LOAD:.0%})")


def test_saturation_line_points_to_the_range_only_when_there_is_one():
    """With a range (simulate's default) the line says to read it; without (--no-range), how to get it."""
    run = {"saturated_window_s": [0.0, 9.0], "saturated_by": "load", "load": 0.9}
    assert saturation_line("x", {**run, "range": {"p99_ttft_ms": [1.0, 2.0]}}).endswith("; read the range")
    assert saturation_line("x", run).endswith("; run without --no-range to see the range")


def test_a_burst_the_batch_absorbs_is_not_a_saturated_window():
    """50 arrivals 20 ms apart, then lone ones 100 s apart; capacity 10 req/s. Against 10 / STEP_TIME_HIGH
    req/s the fluid backlog peaks at 50 x STEP_TIME_HIGH / 10 - 0.98 s (over 1 s), but where the replay never
    queued (every wait 0: the batch took the burst in) the window is not saturated; where its requests waited
    2 s it is, from the first arrival to the drain at 50 x STEP_TIME_HIGH / 10 s."""
    arrivals = [0.02 * k for k in range(50)] + [100.0 * k for k in range(1, 11)]
    n = len(arrivals)
    lat = _lat(n)
    offered = n / arrivals[-1]
    assert saturation(_Res(arrivals), lat, {"capacity_req_s": 10.0}, offered, None)["saturated"] is False
    lat["queue"] = np.where(np.arange(n) < 50, 2.0, 0.0)
    s = saturation(_Res(arrivals), lat, {"capacity_req_s": 10.0}, offered, None)
    assert (s["saturated"], s["saturated_by"]) == (True, "window")
    assert s["saturated_window_s"] == [0.0, pytest.approx(50 * STEP_TIME_HIGH / 10)]
