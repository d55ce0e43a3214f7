"""Tests of stallfree.sim.run.autoscale: a step in the rate worked by hand on a linear cost (the new
replica's first request at t0 + interval + delay, the queueing before it), routers seeing serving
replicas only, scale to zero, draining, the policies, and bad input."""

from __future__ import annotations

import pytest

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.autoscale import (
    AutoscaleConfig,
    AutoscaleError,
    ScalePolicy,
    parse_autoscale,
    parse_policy,
    runner,
)
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.routers import LeastOutstandingRouter, RoundRobinRouter

ONE_SECOND = LinearCostModel(base_s=1.0, per_token_s=0.0)


def cfg() -> SchedulerConfig:
    """Budget 10 and 10-token prompts: one request per 1 s step."""
    return SchedulerConfig(kv_tokens=1000, token_budget=10, max_seqs=16, kv="reserve", block_size=4)


def step_workload(t0: float = 20.0, end: float = 45.0) -> Workload:
    """One request every 2 s from 0 to t0 (exclusive), then every 0.5 s from t0 to `end` (inclusive);
    each a 10-token prompt and 1 output token."""
    arr = [2.0 * k for k in range(int(t0 / 2))] + [t0 + 0.5 * j for j in range(int((end - t0) / 0.5) + 1)]
    return Workload(tuple(arr), (10,) * len(arr), (1,) * len(arr), name="step")


def run(conf: AutoscaleConfig, wl: Workload, router=None):  # type: ignore[no-untyped-def]
    """The autoscaled cluster and its Fleet."""
    fleets: list = []
    c = simulate_cluster(wl, cfg(), ONE_SECOND, conf.max_replicas, router or LeastOutstandingRouter(),
                         group=runner(conf, fleets))
    return c, fleets[0]


def ttft(res, rid: int) -> float:  # type: ignore[no-untyped-def]
    """Request rid's first-token time minus its arrival, s."""
    return res.step_end[res.first_step[rid]] - res.arrival[rid]


def test_step_in_rate_by_hand():
    """Rate 0.5/s to t0 = 20 s, then 2/s; each request takes one 1 s step; inflight:4, interval 10 s,
    scale-up delay d = 15 s, scale-down delay 0, 1:2 replicas.

    Decisions at 10, 20, 30, ... s (from the first arrival, 0 s), each after the steps ending then and
    before the arrivals then. At 20 s nothing is in flight (the request of 18 s ended at 19 s): 1 replica.
    Requests j = 0, 1, ... of the step arrive at 20 + 0.5 j; replica 0 serves one per second from 20 s,
    so request j ends at 21 + j: TTFT 1 + 0.5 j, queueing 0.5 j. At 30 s, 20 have arrived (20 to 29.5 s)
    and 10 ended (21 to 30 s): 10 in flight, ceil(10 / 4) = 3, capped at 2: one replica loads from 30 s
    and serves from 30 + 15 = 45 s = t0 + interval + d. Requests 0 to 49 (20 to 44.5 s) all go to
    replica 0, though the loading replica holds nothing (the router sees serving replicas only);
    request 50, at 45 s, is the new replica's first (TTFT 1 s). Replica 0's last request (49) ends at
    70 s; at the decision of 70 s nothing is in flight, the target falls to MIN and replica 1, idle,
    leaves at once. Replica-seconds: 1 x 30 + 2 x 15 (loading counts) + 2 x 25 = 110.
    """
    conf = AutoscaleConfig(1, 2, ScalePolicy("inflight", 4), interval_s=10, up_delay_s=15, down_delay_s=0)
    c, fleet = run(conf, step_workload())
    base = 10  # the requests before t0
    step = [rid - base for rid in range(base, base + 51)]
    assert [c.routed[base + j] for j in step] == [0] * 50 + [1]
    assert fleet.served_from == [[0.0], [45.0]]
    res = c.merged
    assert [ttft(res, base + j) for j in range(50)] == pytest.approx([1 + 0.5 * j for j in range(50)])
    assert ttft(res, base + 50) == pytest.approx(1.0)
    assert all(ttft(res, k) == pytest.approx(1.0) for k in range(base))
    assert fleet.timeline == [[0.0, 1, 0], [30.0, 1, 1], [45.0, 2, 0], [70.0, 1, 0]]
    assert fleet.end_s == pytest.approx(70.0)
    assert fleet.replica_s == pytest.approx(110.0)
    assert [(t, want) for t, _, want, _ in fleet.decisions][:4] == [(10.0, 1), (20.0, 1), (30.0, 2), (40.0, 2)]


def test_scale_up_delay_zero_serves_at_the_decision():
    """d = 0: the replica added at 30 s serves at once; the arrival of 30 s (request 20 of the step)
    is its first (least outstanding: 0 against replica 0's 10)."""
    conf = AutoscaleConfig(1, 2, ScalePolicy("inflight", 4), interval_s=10, up_delay_s=0, down_delay_s=1000)
    c, fleet = run(conf, step_workload())
    assert fleet.served_from[1] == [30.0]
    assert c.routed.index(1) == 10 + 20


def test_min_equals_max_is_the_static_run():
    """With MIN == MAX no decision is made and every figure equals the static fleet's."""
    wl = step_workload()
    conf = AutoscaleConfig(2, 2, ScalePolicy("inflight", 4), interval_s=10)
    c, fleet = run(conf, wl, RoundRobinRouter())
    s = simulate_cluster(wl, cfg(), ONE_SECOND, 2, RoundRobinRouter())
    assert c.routed == s.routed
    assert list(c.merged.step_end) == list(s.merged.step_end)
    assert fleet.decisions == [] and fleet.timeline == [[0.0, 2, 0]]
    assert fleet.replica_s == pytest.approx(2 * max(s.merged.step_end))


def test_scale_to_zero_holds_requests_at_the_router():
    """MIN 0: the requests of 0 and 2 s wait at the router; the decision of 10 s sees 2 in flight (held),
    adds a replica that serves from 10 + 5 = 15 s; both are routed then and served in order, one per
    1 s step (ends 16 and 17 s: TTFT 16 and 15 s); the request of 16 s finds it serving and runs after
    them (ends 18 s: TTFT 2 s)."""
    wl = Workload((0.0, 2.0, 16.0), (10, 10, 10), (1, 1, 1), name="zero")
    conf = AutoscaleConfig(0, 1, ScalePolicy("inflight", 4), interval_s=10, up_delay_s=5, down_delay_s=0)
    c, fleet = run(conf, wl)
    assert fleet.served_from == [[15.0]]
    assert [ttft(c.merged, r) for r in range(3)] == pytest.approx([16.0, 15.0, 2.0])
    assert fleet.timeline[:3] == [[0.0, 0, 0], [10.0, 0, 1], [15.0, 1, 0]]


def test_draining_replica_takes_nothing_and_leaves_when_done():
    """2:2 is static; with 1:2 and a burst, a replica drains: it takes no request after the decision that
    drains it and leaves at its last request's end (a timeline row then)."""
    arr = [0.5 * j for j in range(40)] + [60.0 + 5.0 * k for k in range(6)]
    wl = Workload(tuple(arr), (10,) * len(arr), (1,) * len(arr), name="burst")
    conf = AutoscaleConfig(1, 2, ScalePolicy("inflight", 2), interval_s=10, up_delay_s=0, down_delay_s=0)
    c, fleet = run(conf, wl)
    # Every request finished once.
    assert sum(1 for r in c.routed if r >= 0) == len(arr)
    rows = fleet.timeline
    assert rows[0] == [0.0, 1, 0] and max(r[1] for r in rows) == 2 and rows[-1][1] == 1
    leave = next(r[0] for r in rows[1:] if r[1] == 1)
    # After the replica left, nothing is routed to it.
    assert all(c.routed[i] == 0 for i, t in enumerate(arr) if t > leave)


def test_queue_policy_scales_on_waiting():
    """queue:2 on the step: replica 0's waiting count passes 2 per replica, so a second replica comes."""
    conf = AutoscaleConfig(1, 2, parse_policy("queue:2"), interval_s=10, up_delay_s=15, down_delay_s=1000)
    _, fleet = run(conf, step_workload())
    # At 30 s, 10 in flight on replica 0: 9 waiting (one running): ceil(1 x 9 / 2) = 5, capped at 2.
    assert fleet.served_from[1] == [45.0]


@pytest.mark.parametrize(("text", "want"), [
    ("1:8", (1, 8)), ("0:3", (0, 3)), ("4:4", (4, 4)), ("1:4096", (1, 4096)),
])
def test_parse_autoscale(text, want):
    """MIN:MAX, MIN may be 0."""
    assert parse_autoscale(text) == want


@pytest.mark.parametrize(("text", "words"), [
    ("5:2", "MIN 5 is more than MAX 2"), ("-1:2", "MIN must be >= 0"), ("0:0", "MAX must be >= 1"),
    ("x", "expected MIN:MAX"), ("1:2:3", "expected MIN:MAX"),
    ("1:4097", "MAX must be <= 4,096 replicas"),
])
def test_parse_autoscale_refuses(text, words):
    """Bad MIN:MAX: one message naming the flag and the value."""
    with pytest.raises(AutoscaleError, match=words) as exc:
        parse_autoscale(text)
    assert f"--autoscale {text}" in str(exc.value)


def test_parse_policy():
    """Both shapes parse; targets of 0 and bad shapes are refused naming the flag."""
    assert parse_policy("inflight:32") == ScalePolicy("inflight", 32.0)
    assert parse_policy("queue:4,kv:0.8") == ScalePolicy("queue", 4.0, 0.8)
    for bad in ("inflight:0", "queue:0", "queue:2,kv:0", "queue:2,kv:1.5", "lru:3", "inflight", "inflight:x"):
        with pytest.raises(AutoscaleError, match=f"--scale-policy {bad}"):
            parse_policy(bad)


def test_config_refuses_negative_delays():
    """A negative delay or a zero interval names its flag."""
    pol = ScalePolicy("inflight", 4)
    with pytest.raises(AutoscaleError, match="--scale-up-delay -1"):
        AutoscaleConfig(1, 2, pol, up_delay_s=-1)
    with pytest.raises(AutoscaleError, match="--scale-down-delay -5"):
        AutoscaleConfig(1, 2, pol, down_delay_s=-5)
    with pytest.raises(AutoscaleError, match="--scale-interval 0"):
        AutoscaleConfig(1, 2, pol, interval_s=0)


def test_the_stabilisation_window_keeps_only_its_candidates():
    """Decisions every 10 ms with a 1,000 s scale-down delay: the window holds the decisions that can still
    be its largest (each larger than every later one), not every decision of the last 1,000 s; a decision
    scanned all of them, so an interval of 1 ms made a 30-request run take 11 s. The fleet grows to 2 and,
    the delay not over, stays there."""
    conf = AutoscaleConfig(1, 2, ScalePolicy("inflight", 4), interval_s=0.01, up_delay_s=0, down_delay_s=1000)
    _, fleet = run(conf, step_workload())
    assert len(fleet.decisions) == 4801
    assert [d for _, d in fleet._recent] == [2, 1]
    assert [row[1:] for row in fleet.timeline] == [[1, 0], [2, 0]]


def test_a_run_past_the_decision_limit_stops(monkeypatch):
    """Work left after SCALE_DECISION_LIMIT decisions (here 10, every second from 0 s) stops the run with
    one line naming --scale-interval and the value; a run that needs no more than the limit runs."""
    from stallfree.sim.run import autoscale

    monkeypatch.setattr(autoscale, "SCALE_DECISION_LIMIT", 10)
    conf = AutoscaleConfig(1, 2, ScalePolicy("inflight", 4), interval_s=1, up_delay_s=0, down_delay_s=0)
    with pytest.raises(AutoscaleError) as exc:
        run(conf, step_workload())
    assert str(exc.value) == ("--scale-interval 1: more than 10 scaling decisions, with work left 10.00 s after "
                              "the first arrival: give a longer interval")
    monkeypatch.setattr(autoscale, "SCALE_DECISION_LIMIT", 48)  # the run's own 48 decisions, 1 s to 48 s
    _, fleet = run(conf, step_workload())
    assert len(fleet.decisions) == 48
