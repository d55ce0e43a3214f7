"""Asynchronous scheduling in the event loop (SchedulerConfig.async_scheduling; stallfree.sim.run.loop,
"Asynchronous scheduling"): traces worked by hand, the option off against on, the two loop paths, a
cluster, closed-loop load, and the command line."""

from __future__ import annotations

import random

import pytest

from stallfree.sim import LinearCostModel, Workload
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.config import make_scheduler
from stallfree.sim.run.disagg import simulate_disaggregated
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, PassGate
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import ClusterError
from stallfree.sim.run.simulator import new_result, plan_run, request_maker, simulate
from stallfree.validate.compare import latencies

#: 1 s a step plus 0.1 s a token.
COST = LinearCostModel(1.0, 0.1)


def cfg(async_scheduling: bool, **kw: object) -> SchedulerConfig:
    return SchedulerConfig(10_000, 64, 8, async_scheduling=async_scheduling, **kw)  # type: ignore[arg-type]


def lat(res: object) -> dict[int, tuple[float | None, float | None]]:
    return {int(k): (v.ttft, v.e2e) for k, v in latencies(res.timelines()).items()}  # type: ignore[attr-defined]


def test_a_request_arriving_mid_step_runs_one_step_later():
    """Request 0 (10 prompt tokens, 3 out) arrives at 0 to an idle engine; request 1 (the same) at 0.5,
    while step 0 runs.

    Synchronous: step 0 [0, 2.0) (10 tokens); step 1 [2.0, 4.1) (r0's decode + r1's 10: 11 tokens), r1's
    TTFT 4.1 - 0.5 = 3.6; step 2 [4.1, 5.3) (two decodes), r0 done; step 3 [5.3, 6.4), r1 done, E2E 5.9.

    Asynchronous: step 1 was planned when step 0 started, before r1 arrived: step 1 [2.0, 3.1) is r0's
    decode alone; step 2 [3.1, 5.2) takes r1 (11 tokens), TTFT 5.2 - 0.5 = 4.7 (+1.1 s: the step it
    waited); r0's last token at 5.2; steps 3 [5.2, 6.3) and 4 [6.3, 7.4), r1's E2E 7.4 - 0.5 = 6.9."""
    wl = Workload([0.0, 0.5], [10, 10], [3, 3], name="t")
    sync, lagged = simulate(wl, cfg(False), COST), simulate(wl, cfg(True), COST)
    assert list(sync.step_start) == pytest.approx([0.0, 2.0, 4.1, 5.3])
    assert list(sync.step_end) == pytest.approx([2.0, 4.1, 5.3, 6.4])
    assert sync.admit_step == [0, 1]
    assert list(lagged.step_start) == pytest.approx([0.0, 2.0, 3.1, 5.2, 6.3])
    assert list(lagged.step_end) == pytest.approx([2.0, 3.1, 5.2, 6.3, 7.4])
    assert lagged.admit_step == [0, 2]
    assert list(lagged.step_tokens) == [10, 1, 11, 1, 1]
    s, a = lat(sync), lat(lagged)
    assert s[0] == pytest.approx((2.0, 5.3)) and s[1] == pytest.approx((3.6, 5.9))
    assert a[0] == pytest.approx((2.0, 5.2)) and a[1] == pytest.approx((4.7, 6.9))
    assert lagged.label.endswith("/async") and lagged.config["async_scheduling"] is True
    assert "async_scheduling" not in sync.config


def test_a_request_finding_the_engine_idle_or_with_nothing_else_to_run_is_not_delayed():
    """Request 1 arrives at 0.5 during request 0's only step ([0, 2.0), one output token): the plan made
    at that step's start had nothing to run, so request 1 starts its step at 2.0 either way (TTFT 3.5 s);
    request 2 arrives at 10 to an idle engine: TTFT 2.0 s either way."""
    wl = Workload([0.0, 0.5, 10.0], [10, 10, 10], [1, 2, 1], name="t")
    sync, lagged = simulate(wl, cfg(False), COST), simulate(wl, cfg(True), COST)
    assert lat(lagged) == lat(sync)
    assert lat(lagged)[1][0] == pytest.approx(3.5) and lat(lagged)[2] == pytest.approx((2.0, 2.0))
    assert list(lagged.step_start) == list(sync.step_start)


def random_workload(seed: int) -> Workload:
    """Seeded: 60 requests over 10 s, prompts 1-60 tokens, outputs 1-15."""
    rng = random.Random(seed)
    arr = sorted(rng.uniform(0.0, 10.0) for _ in range(60))
    return Workload(arr, [rng.randint(1, 60) for _ in arr], [rng.randint(1, 15) for _ in arr], name=f"r{seed}")


def _loop(wl: Workload, sc: SchedulerConfig, solo: bool, closed: ClosedLoop | None = None) -> list[tuple]:
    """One replica through the loop's single-replica path (solo) or the general one; the rows."""
    cost = LinearCostModel(0.05, 0.01)
    max_new, too_long, target, config, _ = plan_run(wl, sc, cost, None, None, False, None, closed)
    inner = make_scheduler(sc)
    res = new_result("x", wl, config, target, max_new, inner)
    rep = Replica(0, inner, inner, res, cost, sc.async_scheduling)
    arrivals = Arrivals(wl, closed)
    entry = Entry([rep], None, request_maker(wl, max_new, inner, arrivals.times), too_long, arrivals)
    loop = EventLoop([rep], arrivals, entry, arrivals.on_finish if closed else None,
                     PassGate(arrivals.ended if closed else None))
    loop.solo = loop.arrivals_at_step_ends = solo
    loop.run()
    return [tuple(res.step_start), tuple(res.step_end), tuple(res.step_tokens), tuple(res.admit_step),
            tuple(res.first_step), tuple(res.finish_step)]


@pytest.mark.parametrize("seed", [1, 2])
def test_the_loop_paths_agree_and_async_only_delays(seed):
    """The single-replica path and the general one give the same rows with the option on (open and closed
    loop); with it on no request is admitted earlier than with it off, and some later (a busy trace)."""
    wl = random_workload(seed)
    on, off = cfg(True, kv="paged"), cfg(False, kv="paged")
    assert _loop(wl, on, True) == _loop(wl, on, False)
    closed = ClosedLoop(3, 0.02)
    assert _loop(wl, on, True, closed) == _loop(wl, on, False, closed)
    a, s = simulate(wl, on, LinearCostModel(0.05, 0.01)), simulate(wl, off, LinearCostModel(0.05, 0.01))
    ta, ts = lat(a), lat(s)
    assert sum(ta[i][0] for i in ta) > sum(ts[i][0] for i in ts)  # type: ignore[misc]
    first_a = [a.step_start[k] for k in a.admit_step]
    first_s = [s.step_start[k] for k in s.admit_step]
    assert sum(first_a) > sum(first_s)


def test_off_matches_the_default_config_and_a_one_replica_cluster_matches_simulate():
    """async_scheduling=False is the default config's run, row for row; a one-replica cluster with the
    option on gives simulate's rows with it on (the same admission)."""
    wl = random_workload(3)
    cost = LinearCostModel(0.05, 0.01)
    a, b = simulate(wl, SchedulerConfig(10_000, 64, 8), cost), simulate(wl, cfg(False), cost)
    assert (list(a.step_start), list(a.step_end), a.admit_step) == (list(b.step_start), list(b.step_end), b.admit_step)
    solo = simulate(wl, cfg(True), cost)
    clus = simulate_cluster(wl, cfg(True), cost, 1).replicas[0]
    assert (list(clus.step_start), list(clus.step_end), list(clus.admit_step)) == \
        (list(solo.step_start), list(solo.step_end), solo.admit_step)


def test_closed_loop_a_request_sent_at_a_step_end_waits_for_the_step_planned_then():
    """Closed loop, two clients, no think time. A (10 prompt tokens, 1 out) and B (10, 5 out) at 0: step 0
    [0, 3.0) (20 tokens), A done; C (10, 2 out) is sent at 3.0.

    Synchronous: step 1 [3.0, 5.1) takes C (B's decode + 10), C's TTFT 2.1 s.
    Asynchronous: at 3.0 vLLM processes step 0's outputs and plans step 2 before C comes (C is sent
    because of those outputs), and step 1 was planned at 0: steps 1 [3.0, 4.1) and 2 [4.1, 5.2) are B's
    decodes alone; step 3 [5.2, 7.3) takes C, TTFT 7.3 - 3.0 = 4.3 s; step 4 [7.3, 8.5) ends both."""
    wl = Workload([0.0, 0.0, 0.0], [10, 10, 10], [1, 5, 2], name="t")
    closed = ClosedLoop(2, 0.0)
    sync = simulate(wl, cfg(False), COST, closed_loop=closed)
    lagged = simulate(wl, cfg(True), COST, closed_loop=closed)
    assert sync.arrival == lagged.arrival == (0.0, 0.0, 3.0)
    assert lat(sync)[2] == pytest.approx((2.1, 3.3))
    assert list(lagged.step_start) == pytest.approx([0.0, 3.0, 4.1, 5.2, 7.3])
    assert lagged.admit_step[2] == 3
    assert lat(lagged)[2] == pytest.approx((4.3, 5.5))
    assert lat(lagged)[1] == pytest.approx((3.0, 8.5)) and lat(sync)[1] == pytest.approx((3.0, 8.5))


def test_bad_values_and_disaggregation_are_refused():
    with pytest.raises(ValueError, match="async_scheduling must be True or False, got 'yes'"):
        SchedulerConfig(1000, async_scheduling="yes")  # type: ignore[arg-type]
    wl = Workload([0.0], [10], [2], name="t")
    with pytest.raises(ClusterError, match="decode_scheduler: async_scheduling=True is not modelled"):
        simulate_disaggregated(wl, cfg(False), cfg(True), COST, COST, 1, 1, 0)


def test_command_line_flag(capsys):
    """`simulate --async-scheduling` runs the option (its label says so); off by default."""
    import json

    from stallfree.cli import main

    base = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--kernels", "none", "--num-requests", "4",
            "--json"]
    main([*base, "--async-scheduling"])
    on = capsys.readouterr().out
    main(base)
    off = capsys.readouterr().out
    assert "/async" in on and "/async" not in off
    json.loads(off)


def test_command_line_refuses_async_with_disaggregation(capsys):
    """simulate --disaggregate and plan (which searches disaggregated splits) refuse --async-scheduling
    (exit 2, the error naming the flags) rather than run the splits synchronously."""
    from stallfree.cli import main

    common = ["--num-requests", "4", "--linear-cost", "5,50", "--async-scheduling"]
    assert main(["simulate", *common, "--disaggregate", "1:1"]) == 2
    assert "--async-scheduling is not modelled with --disaggregate" in capsys.readouterr().err
    assert main(["plan", *common, "--slo-ttft", "1s"]) == 2
    assert "add --no-disaggregate" in capsys.readouterr().err


def test_tune_runs_its_candidates_with_the_option():
    """tune(async_scheduling=True) simulates each candidate with it: on the first trace above the mean
    TTFT is (2.0 + 3.6) / 2 = 2.8 s without and (2.0 + 4.7) / 2 = 3.35 s with it."""
    from stallfree.sim.studies.tune import tune

    wl = Workload([0.0, 0.5], [10, 10], [3, 3], name="t")
    off = tune(wl, 10_000, COST, 100.0, 100.0, budgets=[64], max_seqs=8).rows[0]
    on = tune(wl, 10_000, COST, 100.0, 100.0, budgets=[64], max_seqs=8, async_scheduling=True).rows[0]
    assert (off["mean_ttft_ms"], on["mean_ttft_ms"]) == pytest.approx((2800.0, 3350.0))
    assert on["label"] == "chunked/64/async"
