"""`stallfree simulate --autoscale`: MIN:MIN against --replicas MIN (every figure but wall times) on the
default trace and under every router, the report's keys and cost, the plot, and bad input (exit 2)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stallfree.cli import main
from stallfree.sim.run.routers import ROUTERS

#: Keys only the autoscaled run has.
AUTOSCALE_KEYS = {"autoscale", "replicas_timeline", "replicas_peak", "gpus_per_replica", "gpu_hours",
                  "usd_per_gpu_hour", "cost_usd", "slo_attainment_by_window", "static", "gpu_hours_saved",
                  "slo_attainment_lost"}
SMALL = ["--synthetic", "poisson", "--rate", "20", "--num-requests", "300", "--prompt-len", "uniform:100,2000",
         "--output-len", "uniform:10,200", "--kernels", "none", "--no-range", "--json"]


def strip(d: Any) -> Any:
    """`d` without wall times and the autoscaled run's own keys."""
    if isinstance(d, dict):
        return {k: strip(v) for k, v in d.items() if "wall" not in k and k not in AUTOSCALE_KEYS}
    if isinstance(d, list):
        return [strip(x) for x in d]
    return d


def run_json(capsys: Any, argv: list[str]) -> dict[str, Any]:
    """The --json output of `simulate argv` (exit 0)."""
    assert main(["simulate", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_min_equals_max_is_replicas_on_the_default_trace(capsys):
    """`--autoscale 2:2` and `--replicas 2` on the bundled trace: the same JSON but wall times and the
    autoscale keys, and the static comparison is the run itself (nothing saved, nothing lost)."""
    a = run_json(capsys, ["--autoscale", "2:2", "--no-range", "--json"])
    b = run_json(capsys, ["--replicas", "2", "--no-range", "--json"])
    assert strip(a) == strip(b)
    run = a["runs"][0]
    assert run["gpu_hours_saved"] == 0 and run["slo_attainment_lost"] is None
    assert run["replicas_timeline"] == [[0.0, 2, 0]]


@pytest.mark.parametrize("router", ROUTERS)
def test_min_equals_max_is_replicas_under_every_router(capsys, router):
    """N:N with each router against --replicas N with it, 3 replicas of a small synthetic load."""
    a = run_json(capsys, [*SMALL, "--autoscale", "3:3", "--router", router])
    b = run_json(capsys, [*SMALL, "--replicas", "3", "--router", router])
    assert strip(a) == strip(b)


def test_report_keys_cost_and_plot(capsys, tmp_path):
    """1:3 on a load that needs more than one replica: the timeline starts at 1 serving, the static fleet
    is 3, GPU hours are replica-seconds x 4 GPUs / 3600 and the cost is GPU hours x the price; --out
    writes autoscale.png."""
    argv = [*SMALL, "--rate", "60", "--autoscale", "1:3", "--scale-interval", "1", "--scale-up-delay", "2",
            "--scale-down-delay", "5", "--scale-policy", "inflight:8", "--gpu-price", "h100-sxm=2.5",
            "--slo-ttft", "2s", "--window", "2", "--out", str(tmp_path)]
    out = run_json(capsys, argv)
    run = out["runs"][0]
    rows = run["replicas_timeline"]
    assert rows[0][1:] == [1, 0] and run["replicas_peak"] == 3
    assert any(r[2] > 0 for r in rows)  # some replica loaded
    span = [(a[0], b[0] if b else None, a[1] + a[2]) for a, b in zip(rows, [*rows[1:], None], strict=True)]
    assert run["gpus_per_replica"] == 4
    assert run["cost_usd"] == pytest.approx(run["gpu_hours"] * 2.5)
    st = run["static"]
    assert st["replicas"] == 3 and st["gpu_hours"] > run["gpu_hours"]
    assert st["cost_usd"] == pytest.approx(st["gpu_hours"] * 2.5)
    assert run["gpu_hours_saved"] == pytest.approx(st["gpu_hours"] - run["gpu_hours"])
    wins = run["slo_attainment_by_window"]
    assert sum(w["requests"] for w in wins) == 300
    assert all(0 <= w["slo_attainment"] <= 1 for w in wins if w["requests"])
    assert (tmp_path / "autoscale.png").stat().st_size > 0
    assert span[0][2] == 1


def test_header_says_the_capacity_is_the_most_replicas(capsys):
    """1:4 on a load one replica serves: the autoscaler never runs 4, and the header's capacity (the label's
    x4, four replicas' saturated throughput) is said to be at 4 replicas, beside the peak it did run."""
    argv = [*SMALL, "--autoscale", "1:4"]
    run = run_json(capsys, argv)["runs"][0]
    single = run_json(capsys, [*SMALL])["runs"][0]
    assert run["replicas_peak"] < 4
    assert run["capacity_req_s"] == pytest.approx(4 * single["capacity_req_s"], rel=1e-9)
    assert main(["simulate", *[a for a in argv if a != "--json"]]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{run['label']}: "))
    assert line.startswith(f"{run['label']}: utilization {run['load']:.0%} of capacity "
                           f"(~{run['capacity_req_s']:,.1f} req/s when saturated) at 4 replicas, the autoscaler's "
                           f"maximum (its peak: {run['replicas_peak']}); requests were left waiting")


@pytest.mark.parametrize(("argv", "words"), [
    (["--autoscale", "3:2"], "--autoscale 3:2: MIN 3 is more than MAX 2"),
    (["--autoscale", "-1:2"], "--autoscale -1:2: MIN must be >= 0"),
    (["--autoscale", "0:0"], "--autoscale 0:0: MAX must be >= 1"),
    (["--autoscale", "1:2", "--scale-up-delay", "-5"], "--scale-up-delay -5: must be a duration >= 0"),
    (["--autoscale", "1:2", "--scale-down-delay", "-1s"], "--scale-down-delay -1s: must be a duration >= 0"),
    (["--autoscale", "1:2", "--scale-interval", "0"], "--scale-interval 0: must be a duration > 0"),
    (["--autoscale", "1:2", "--scale-policy", "inflight:0"], "--scale-policy inflight:0: the target must be"),
    (["--autoscale", "1:2", "--scale-policy", "queue:0,kv:0.5"], "--scale-policy queue:0,kv:0.5"),
    (["--autoscale", "1:2", "--replicas", "2"], "drop --replicas"),
    (["--autoscale", "1:2", "--disaggregate", "1:1"], "--autoscale does not compose with --disaggregate"),
    (["--autoscale", "1:2", "--gpu-price", "h200=3"], "no price for the run's GPU, h100-sxm"),
    (["--scale-up-delay", "60"], "--scale-up-delay applies to --autoscale MIN:MAX"),
    (["--gpu-price", "h100-sxm=2"], "--gpu-price applies to --autoscale MIN:MAX"),
])
def test_bad_input(capsys, argv, words):
    """Bad autoscaling input: exit 2, one line naming the flag and the value, before anything runs."""
    code = main(["simulate", "--kernels", "none", "--no-range", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("auto_hours", "auto_att", "words"),
    [(0.5, 0.9, "autoscaling saves 0.50 (50%); SLO attainment 90.00% against 100.00% (10.00 points lost)"),
     (3.0, 1.0, "autoscaling costs 2.00 GPU hours more (200% more: its run lasts longer); SLO attainment "
                "100.00% against 90.00% (10.00 points gained)")],
    ids=["saves", "costs-more"],
)
def test_static_fleet_line_words_either_sign(auto_hours, auto_att, words):
    """The line beside the static fleet of 1.0 GPU hours says what autoscaling saves, or what it costs more
    (a slow scale-up keeps the run going: "saves -2.00 (-200%)" read as a gain), and points lost or gained."""
    import io

    from stallfree.sim.commands.autoscale import print_lines

    static_att = 1.0 if auto_att < 1 else 0.9
    summary = {"autoscale": {"min": 0, "max": 2, "policy": "rate", "scale_interval_s": 30.0,
                             "scale_up_delay_s": 60.0, "scale_up_delay_source": "given", "scale_down_delay_s": 300.0},
               "replicas_peak": 2, "gpu_hours": auto_hours, "gpu_hours_saved": 1.0 - auto_hours,
               "slo_attainment": auto_att, "cost_usd": None,
               "static": {"replicas": 2, "gpu_hours": 1.0, "slo_attainment": static_att, "cost_usd": None}}
    out = io.StringIO()
    print_lines(summary, out)
    assert out.getvalue().splitlines()[1] == "static fleet of 2 replicas: 1.00 GPU hours; " + words


#: 30 requests at 2 req/s: the arrivals span 17.57 s, the autoscaled run 18.24 s.
THIRTY = ["simulate", "--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none",
          "--no-range", "--autoscale", "1:2"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--window", "1e-9"],
     "--window 1e-9: 17,567,356,926 SLO attainment windows over the arrivals' 17.57 s, more than the 1,000,000 "
     "allowed: give --window 1.76e-05 or more (more still if the run outlasts its arrivals)"),
    (["--scale-interval", "1e-9"],
     "--scale-interval 1e-9: 17,567,356,925 scaling decisions over the arrivals' 17.57 s, more than the 1,000,000 "
     "allowed: give --scale-interval 1.76e-05 or more (more still if the run outlasts its arrivals)"),
    # Past the arrivals: the run's own span, after the run and before anything is printed or written.
    (["--window", "1.76e-05"],
     "--window 1.76e-05: 1,036,511 SLO attainment windows over the run's 18.24 s, more than the 1,000,000 "
     "allowed: give --window 1.83e-05 or more"),
], ids=["window", "interval", "window-past-the-arrivals"])
def test_a_duration_that_makes_too_many_windows_or_decisions_is_refused(capsys, tmp_path, argv, said):
    """A --window or --scale-interval that makes more than a million windows or decisions (the run's span
    over it) exits 2 with one line naming the flag, the value and the shortest allowed, and writes nothing;
    a nanosecond window asked numpy for 136 GiB (exit 1), a nanosecond interval ran for hours."""
    out = tmp_path / "out"
    code = main([*THIRTY, *argv, "--out", str(out)])
    captured = capsys.readouterr()
    assert (code, captured.err, captured.out) == (2, f"stallfree simulate: error: {said}\n", "")
    assert not out.exists()


def test_too_many_decisions_past_the_arrivals_exit_2(capsys, monkeypatch):
    """An interval that the check over the arrivals lets through, but whose run goes on past the decision
    limit (the backlog after the last arrival), stops with exit 2 and one line (the limit lowered to 1,000 to
    keep the run short: 998 decisions over the arrivals, 1,036 over the run)."""
    from stallfree.sim.commands import autoscale as autoscale_cli
    from stallfree.sim.run import autoscale

    monkeypatch.setattr(autoscale, "SCALE_DECISION_LIMIT", 1000)
    monkeypatch.setattr(autoscale_cli, "SCALE_DECISION_LIMIT", 1000)
    code = main([*THIRTY, "--scale-interval", "0.0176"])
    captured = capsys.readouterr()
    assert (code, captured.err, captured.out) == (
        2, "stallfree simulate: error: --scale-interval 0.0176: more than 1,000 scaling decisions, with work left "
        "17.60 s after the first arrival: give a longer interval\n", "")


def test_more_than_4096_replicas_is_refused(capsys):
    """--autoscale's MAX is at most 4,096 replicas (every slot is a simulated engine built up front: 100,000 of
    them ran past 45 s on 30 requests)."""
    assert main([*THIRTY[:-1], "1:4097"]) == 2
    assert capsys.readouterr().err == ("stallfree simulate: error: --autoscale 1:4097: MAX must be <= 4,096 replicas "
                                       "(every slot is built up front)\n")
