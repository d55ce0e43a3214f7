"""The bounds a workload's arrivals and a synthetic workload's turns are held to, whichever option spreads or
draws them: each refused with one line naming the flag and its value, exit 2, before anything runs."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.sim.inputs.options import SetupError, WorkloadOptions, build_workload, scaled_workload
from stallfree.sim.outputs.report import served_share

POISSON = ["--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none"]
SPAN = "arrival times must lie within 1e+08 s (about 3.2 years) of the first"


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a command that exits 2 with nothing on stdout."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    return err.rstrip("\n")


@pytest.mark.parametrize("command, slos", [("simulate", []), ("tune", ["--slo-ttft", "1s", "--slo-tpot", "50ms"]),
                                            ("plan", ["--slo-ttft", "1s"])])
def test_a_tiny_rate_is_refused_by_every_command(command, slos, capsys):
    """--rate 1e-15 spreads 30 Poisson arrivals over 3.5e16 s, where a step's milliseconds are lost (TPOT
    0.18 ms against 5.53 at --rate 2); the least rate that keeps them within the bound is named."""
    err = _refused([command, *POISSON, "--rate", "1e-15", *slos], capsys)
    assert err == (f"stallfree {command}: error: --rate 1e-15 spreads the 30 arrivals over 3.51e+16 s; {SPAN} "
                   "(3.52e-07 or more keeps them within it)")


def test_the_rate_named_as_enough_is(capsys):
    wl, scale = build_workload(WorkloadOptions(synthetic="poisson", rate=3.52e-7, num_requests=30))
    assert scaled_workload(wl, scale, WorkloadOptions(synthetic="poisson", rate=3.52e-7)).duration <= 1e8
    with pytest.raises(SetupError, match=r"^`rate`=3.51e-07 spreads"):
        opts = WorkloadOptions(synthetic="poisson", rate=3.51e-7, num_requests=30)
        scaled_workload(*build_workload(opts), opts)


def test_a_rate_so_small_its_arrivals_are_infinite_is_refused(capsys):
    err = _refused(["simulate", *POISSON, "--rate", "1e-320"], capsys)
    assert err == f"stallfree simulate: error: --rate 9.99989e-321 spreads the 30 arrivals over inf s; {SPAN}"


def _two_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_time,prompt_len,output_len\n0,100,50\n1,200,30\n", encoding="utf-8")
    return str(path)


def test_a_rate_scale_cannot_stretch_a_trace_past_the_readers_bound(tmp_path, capsys):
    """The trace reader refuses times more than 1e8 s apart; --rate-scale 1e-16 made 1 s into 1e16 s
    (TPOT 2.64 ms against 5.28)."""
    err = _refused(["simulate", "--trace", _two_rows(tmp_path), "--rate-scale", "1e-16", "--kernels", "none"],
                   capsys)
    assert err == (f"stallfree simulate: error: --rate-scale 1e-16 spreads the 2 arrivals over 1e+16 s; {SPAN} "
                   "(1e-08 or more keeps them within it)")


def test_every_rate_scale_of_a_sweep_is_held_to_both_bounds(tmp_path, capsys):
    """A sweep's --rate-scales are checked as --rate-scale is, each before any point runs: the span, and
    the offered rate (--rate-scales 1e9 ran, offering 1e9 requests/s)."""
    trace = _two_rows(tmp_path)
    err = _refused(["sweep", "--trace", trace, "--rate-scales", "1,1e-300", "--kernels", "none"], capsys)
    assert err == (f"stallfree sweep: error: --rate-scales 1e-300 spreads the 2 arrivals over 1e+300 s; {SPAN} "
                   "(1e-08 or more keeps them within it)")
    err = _refused(["sweep", "--trace", trace, "--rate-scales", "1e-16", "--kv-tokens", "10000,20000", "--kernels",
                    "none"], capsys)  # a KV sweep runs at its one rate scale: still named as given
    assert err == (f"stallfree sweep: error: --rate-scales 1e-16 spreads the 2 arrivals over 1e+16 s; {SPAN} "
                   "(1e-08 or more keeps them within it)")
    err = _refused(["sweep", "--trace", trace, "--rate-scales", "1,1e9", "--kernels", "none"], capsys)
    assert err == ("stallfree sweep: error: --rate-scales 1e+09 on 1 requests/s offers 1,000,000,000 requests/s, "
                   "past the bound of 100,000 requests/s of one simulation")


def test_a_rate_profile_past_the_span_is_refused(tmp_path, capsys):
    path = tmp_path / "profile.csv"
    path.write_text("t_s,rate\n0,0.000001\n10000000000,0.000001\n", encoding="utf-8")
    err = _refused(["simulate", "--rate-profile", str(path), "--kernels", "none"], capsys)
    assert err == f"stallfree simulate: error: --rate-profile {path} spreads the 10,060 arrivals over 1e+10 s; {SPAN}"


def test_sessions_are_held_to_the_synthetic_request_cap(capsys):
    """3,000 sessions of 10,000 turns are 30 M requests, past the 20 M a synthetic run draws: refused from
    the drawn counts, before a turn is laid out (it ran out of memory)."""
    err = _refused(["simulate", "--synthetic", "sessions", "--rate", "1", "--num-requests", "3000", "--turns",
                    "fixed:10000", "--kernels", "none"], capsys)
    assert err == ("stallfree simulate: error: --turns fixed:10000 over 3,000 sessions draws 30,000,000 turns, "
                   "more than a synthetic run draws (at most 20,000,000 requests)")


def test_turns_past_a_sessions_limit_are_refused_not_capped(capsys):
    """--turns fixed:20000 ran sessions of 10,000 turns while the header said 20000."""
    err = _refused(["simulate", "--synthetic", "sessions", "--rate", "1", "--num-requests", "5", "--turns",
                    "fixed:20000", "--kernels", "none"], capsys)
    assert err == ("stallfree simulate: error: --turns fixed:20000 draws a session of 20,000 turns; a session has "
                   "at most 10,000 turns")


def test_turns_never_sent_are_not_load():
    """A session's turns after one refused are recorded as "session_ended" and never sent: the share served
    is of the turns sent (1,635 of 1,640), as the rate it multiplies is."""
    summary = {"num_requests": 5000, "rejected": 3365,
               "rejected_by_reason": {"context_length": 5, "session_ended": 3360}}
    assert served_share(summary) == 1635 / 1640
    assert served_share({"num_requests": 10, "rejected": 2, "rejected_by_reason": {"context_length": 2}}) == 0.8


def test_a_session_runs_utilization_counts_the_turns_sent(capsys):
    """5 sessions of 1,000 turns of 200 + 200 tokens outgrow the 131,072-token context at turn 327: 5
    refused, 3,360 never sent, 1,635 served. The load is the turns sent per second over the capacity, less
    the 5 refused (it read 32% where the replica was 96% busy)."""
    assert main(["simulate", "--synthetic", "sessions", "--rate", "1", "--num-requests", "5", "--turns",
                 "fixed:1000", "--kernels", "none", "--no-range", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["rejected_by_reason"] == {"context_length": 5, "session_ended": 3360}
    assert run["load"] == pytest.approx(run["achieved_request_rate"] * 1635 / 1640 / run["capacity_req_s"])
    assert round(run["load"], 2) == 0.96
