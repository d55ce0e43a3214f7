"""Tests of stallfree.sim.inputs.diurnal: the inverse cumulative rate worked by hand on linear segments, the
diurnal curve's mean and peak, seeded counts against the curve, the profile file's errors, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from stallfree.cli import main
from stallfree.sim.inputs.diurnal import DAY_S, diurnal_profile, profile_times, profile_workload, read_rate_profile
from stallfree.sim.inputs.synthetic import parse_length_spec


def test_profile_times_by_hand():
    """Rate 1 -> 3 over 100 s: R(t) = t + t^2 / 100, so s = 50 maps to t^2 + 100 t - 5000 = 0,
    t = (-100 + sqrt(30000)) / 2 = 36.6025 s. A constant rate of 2: s / 2. A falling rate 3 -> 0
    over 100 s: R(t) = 3 t - 0.015 t^2, s = 100 at t = (3 - sqrt(3)) / 0.03 = 42.2650 s; s = 150 (the
    total) and beyond are dropped."""
    assert profile_times([(0, 1), (100, 3)], [50.0]) == pytest.approx([(-100 + math.sqrt(30000)) / 2])
    assert profile_times([(0, 2), (10, 2)], [1.0, 3.0]) == pytest.approx([0.5, 1.5])
    assert profile_times([(0, 3), (100, 0)], [100.0, 150.0, 160.0]) == pytest.approx([(3 - math.sqrt(3)) / 0.03])


def test_profile_times_skip_a_zero_segment():
    """A stretch of rate 0 gets no arrival: 10 s at 1/s, 10 s at 0 (ramping down then up), 10 s at 1/s.
    R = 5 at 10 s (the ramp 1 -> 0 over 10 s), stays 5 to 20 s, then s = 6 is 1 request into a ramp
    0 -> 1 over 10 s: t^2 / 20 = 1, t = 20 + sqrt(20)."""
    pts = [(0, 1), (10, 0), (20, 0), (30, 1)]
    assert profile_times(pts, [6.0]) == pytest.approx([20 + math.sqrt(20)])


def test_diurnal_curve_mean_and_peak():
    """The curve's mean over the day (trapezoids) is the rate, its busiest point peak_ratio times its
    quietest, at peak_hour."""
    pts = diurnal_profile(2.0, 4.0, 10.0)
    mean = sum((a[1] + b[1]) / 2 * (b[0] - a[0]) for a, b in zip(pts, pts[1:], strict=False)) / DAY_S
    assert mean == pytest.approx(2.0, rel=1e-12)
    top = max(pts, key=lambda p: p[1])
    assert top[0] == pytest.approx(10 * 3600)
    assert top[1] / min(r for _, r in pts) == pytest.approx(4.0)
    assert top[1] == pytest.approx(2.0 * (1 + 3 / 5))


def test_seeded_day_follows_the_curve():
    """Seed 0, mean 0.2/s, peak ratio 3 at 14 h: the day's count is within 4 standard deviations of
    17,280, and the busiest hour holds about 3 times the quietest hour's requests (expected
    0.2 x 1.5 x 3600 = 1,080 against 360; Poisson noise of a few percent)."""
    fixed = parse_length_spec("fixed:10")
    wl = profile_workload(diurnal_profile(0.2, 3.0, 14.0), fixed, fixed, seed=0)
    n = len(wl)
    assert abs(n - 17_280) < 4 * math.sqrt(17_280)
    per_hour = [0] * 24
    for t in wl.arrivals:
        per_hour[min(int(t // 3600), 23)] += 1
    assert per_hour[13] + per_hour[14] > 2.4 * (per_hour[1] + per_hour[2])
    assert list(wl.arrivals) == sorted(wl.arrivals) and wl.arrivals[-1] <= DAY_S
    again = profile_workload(diurnal_profile(0.2, 3.0, 14.0), fixed, fixed, seed=0)
    assert again.arrivals == wl.arrivals


def test_gamma_gaps_are_burstier():
    """Burstiness 0.25 draws the same mean count but a larger spread of requests per minute."""
    fixed = parse_length_spec("fixed:10")
    pts = [(0.0, 2.0), (3600.0, 2.0)]
    counts = {}
    for b in (1.0, 0.25):
        wl = profile_workload(pts, fixed, fixed, burstiness=b, seed=3)
        per_min = [0] * 60
        for t in wl.arrivals:
            per_min[min(int(t // 60), 59)] += 1
        m = sum(per_min) / 60
        counts[b] = (len(wl), sum((c - m) ** 2 for c in per_min) / 60)
    assert abs(counts[1.0][0] - 7200) < 4 * math.sqrt(7200)
    assert counts[0.25][1] > 2 * counts[1.0][1]


@pytest.mark.parametrize(("text", "words"), [
    ("t,rate\n0,1\n", "expected a header"),
    ("t_s,rate\n0,1\n", "at least two points"),
    ("t_s,rate\n0,1\n5,x\n", "row 3"),
    ("t_s,rate\n0,1\n0,2\n", "row 3: t_s=0 must be >= 0 and above"),
    ("t_s,rate\n0,1\n5,-1\n", "rate=-1 must be"),
    ("t_s,rate\n0,0\n5,0\n", "every rate is 0"),
])
def test_read_rate_profile_refuses(tmp_path, text, words):
    """A bad profile: one message naming the flag, the file and the row."""
    p = tmp_path / "p.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=words) as exc:
        read_rate_profile(p)
    assert "--rate-profile" in str(exc.value)


def test_cli_rate_profile(tmp_path, capsys):
    """`simulate --rate-profile` with the expected count (1 -> 3 over 100 s, 3 -> 0 over 100 s: 350)."""
    p = tmp_path / "p.csv"
    p.write_text("t_s,rate\n0,1\n100,3\n200,0\n")
    code = main(["simulate", "--rate-profile", str(p), "--kernels", "none", "--no-range", "--prompt-len", "fixed:50",
                 "--output-len", "fixed:5", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    n = out["header"]["requests"]
    assert abs(n - 350) < 4 * math.sqrt(350)
    assert out["header"]["workload"].startswith("rate-profile(p.csv")


@pytest.mark.parametrize(("argv", "words"), [
    (["--rate-profile", "P", "--rate", "2"], "drop --rate"),
    (["--rate-profile", "P", "--synthetic", "poisson"], "--rate-profile gives the arrivals: drop --synthetic"),
    (["--synthetic", "poisson", "--peak-hour", "3"], "--peak-hour applies to --synthetic diurnal"),
    (["--rate-profile", "/no/such/file.csv"], "cannot read it"),
])
def test_cli_bad_input(capsys, argv, words):
    """Bad diurnal or profile input: exit 2 and one line naming the flag."""
    code = main(["simulate", "--kernels", "none", "--no-range", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1


def test_profile_refuses_a_ratio_below_1_or_an_hour_past_the_day():
    """The library checks what the flags' types refuse while parsing (tests/test_cli.py): a peak ratio
    under 1 and an hour outside [0, 24], named as their flags."""
    with pytest.raises(ValueError, match=r"--peak-ratio 0\.5: must be a number >= 1"):
        diurnal_profile(1.0, 0.5, 14.0)
    with pytest.raises(ValueError, match=r"--peak-hour 25: must be an hour in \[0, 24\]"):
        diurnal_profile(1.0, 3.0, 25)
