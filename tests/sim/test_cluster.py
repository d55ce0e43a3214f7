"""Tests of stallfree.sim.run.cluster: routers worked by hand, the one-replica cluster against the
single-replica simulator, a seeded randomized every-request-finishes-once test, and bad input."""

from __future__ import annotations

import json
import random

import pytest

from stallfree.cli import main
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.result import ClusterError
from stallfree.sim.run.routers import (
    LeastKVRouter,
    LeastOutstandingRouter,
    PrefixAffinityRouter,
    RandomRouter,
    RoundRobinRouter,
    make_router,
)
from stallfree.sim.run.simulator import simulate
from stallfree.sim.studies.cluster_study import cluster_summary

ONE_SECOND = LinearCostModel(base_s=1.0, per_token_s=0.0)


def wl(*rows: tuple[float, int, int]) -> Workload:
    """A workload from (arrival, prompt_len, output_len) rows."""
    return Workload(
        tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), name="hand"
    )


def cfg(budget: int = 8, kv: int = 100, kv_policy: str = "reserve") -> SchedulerConfig:
    """A small scheduler config."""
    return SchedulerConfig(kv_tokens=kv, token_budget=budget, max_seqs=16, kv=kv_policy, block_size=4)


# Two replicas, every step 1 s, budget 8, KV 100 tokens each (reserve: prompt + output at admission).
#   r0 (0.0 s, prompt 4, 1 token)   r1 (0.0 s, prompt 2, 5 tokens)   r2 (0.5 s, prompt 8, 1 token)
#   r3 (1.5 s, prompt 4, 1 token)   r4 (1.6 s, prompt 4, 1 token)
HAND = wl((0.0, 4, 1), (0.0, 2, 5), (0.5, 8, 1), (1.5, 4, 1), (1.6, 4, 1))


def ttfts(res) -> list[float]:  # type: ignore[no-untyped-def]
    """First-token time minus arrival of every request, s."""
    return [res.step_end[res.first_step[r]] - res.arrival[r] for r in range(res.num_requests)]


def test_round_robin_by_hand():
    """Round robin: r0, r2, r4 to replica 0; r1, r3 to replica 1.

    Replica 0: [0,1] r0 prefill (done); [1,2] r2's 8-token prefill (r2 waited from 0.5 s: TTFT 1.5);
    r4 arrives at 1.6 during it and prefills in [2,3] (TTFT 1.4).
    Replica 1: [0,1] r1 prefill (token 1 at 1); [1,2] decode; r3 (1.5 s) joins at 2: [2,3] decode
    + r3 prefill (TTFT 1.5); r1's tokens 4, 5 at 4 and 5 s (TPOT (5 - 1) / 4 = 1 s).
    """
    c = simulate_cluster(HAND, cfg(), ONE_SECOND, 2, RoundRobinRouter())
    assert c.routed == [0, 1, 0, 1, 0]
    assert ttfts(c.merged) == pytest.approx([1.0, 1.0, 1.5, 1.5, 1.4])
    assert c.merged.token_times(1) == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])
    s = cluster_summary(c)
    assert s["completed"] == 5 and s["num_requests"] == 5
    assert [r["num_requests"] for r in s["replicas"]] == [3, 2]
    assert s["mean_tpot_ms"] == pytest.approx(1000.0)


def test_least_outstanding_by_hand():
    """Least outstanding: at 1.5 s replica 0 holds r2 (in flight) and replica 1 holds r1: a tie, so
    r3 goes to replica 0; at 1.6 s replica 0 holds r2 and r3, replica 1 holds r1: r4 to replica 1.
    r3 prefills on replica 0 in [2,3] (TTFT 1.5); r4 joins r1's decodes on replica 1 in [2,3] (TTFT 1.4)."""
    c = simulate_cluster(HAND, cfg(), ONE_SECOND, 2, LeastOutstandingRouter())
    assert c.routed == [0, 1, 0, 0, 1]
    assert ttfts(c.merged) == pytest.approx([1.0, 1.0, 1.5, 1.5, 1.4])


def test_least_kv_by_hand():
    """Most free KV (reserve: prompt + output reserved). r1: replica 0 has r0 pending (5 tokens):
    95 against 100, so replica 1. r2: 95 (r0) against 93 (r1): replica 0. r3 at 1.5 s: replica 0
    reserves r2's 9, replica 1 r1's 7: 91 against 93, replica 1. r4 at 1.6 s: 91 against 93 - 5
    (r3 pending) = 88: replica 0."""
    c = simulate_cluster(HAND, cfg(), ONE_SECOND, 2, LeastKVRouter())
    assert c.routed == [0, 1, 0, 1, 0]


def test_random_router_follows_its_seed():
    """The random router draws replica indices from random.Random(seed), one per arrival."""
    rng = random.Random(7)
    expected = [rng.randrange(3) for _ in range(5)]
    c = simulate_cluster(HAND, cfg(), ONE_SECOND, 3, RandomRouter(7))
    assert c.routed == expected
    assert c.merged.finish_step.count(-1) == 0


def test_prefix_affinity_without_caching_routes_as_least_outstanding():
    """Schedulers without a prefix cache report 0 cached tokens, so prefix-affinity falls back."""
    a = simulate_cluster(HAND, cfg(), ONE_SECOND, 2, PrefixAffinityRouter())
    assert a.routed == [0, 1, 0, 0, 1]


def test_prefix_cache_hit_rate_by_hand():
    """Prefix caching on (paged, 4-token blocks): r0 (0 s) and r1 (5 s, after r0 is done) have
    9-token prompts whose first two blocks are equal (prefix ids 1, 2). r1 can hit 2 blocks (the cap
    is (9 - 1) // 4 = 2): 8 tokens of the 18 prompt tokens looked up, a hit rate and a bound of 8/18.
    - round-robin on 2 replicas: r1 goes to replica 1, which never saw the prefix: hit rate 0, each
      replica's bound 0 (one request each), the cluster's bound still 8/18 (one cache, all requests).
    - prefix-affinity (threshold 4): replica 0 holds 8 > 4 cached tokens and loads are 0 and 0 (cap
      4): r1 goes to replica 0 and hits 8 tokens: 8/18 on replica 0 and in the cluster.
    - one replica: the same figures as simulate, key for key."""
    w = Workload((0.0, 5.0), (9, 9), (2, 2), "hand", prefix_ids=((1, 2, 3), (1, 2, 4)), prefix_block=4)
    paged = SchedulerConfig(kv_tokens=64, token_budget=16, max_seqs=4, kv="paged", block_size=4,
                            watermark=0.0, prefix_caching=True)
    keys = ("prefix_cache_hit_rate", "prefix_cache_hit_rate_bound", "prefix_cache_evictions")
    rr = cluster_summary(simulate_cluster(w, paged, ONE_SECOND, 2, RoundRobinRouter()))
    assert [rr[k] for k in keys] == [0.0, pytest.approx(8 / 18), 0]
    assert [(r["prefix_cache_hit_rate"], r["prefix_cache_hit_rate_bound"]) for r in rr["replicas"]] == [
        (0.0, 0.0), (0.0, 0.0)
    ]
    pa = simulate_cluster(w, paged, ONE_SECOND, 2, PrefixAffinityRouter(threshold=4))
    assert pa.routed == [0, 0]
    s = cluster_summary(pa)
    assert s["prefix_cache_hit_rate"] == pytest.approx(8 / 18)
    assert s["replicas"][0]["prefix_cache_hit_rate"] == pytest.approx(8 / 18)
    assert s["replicas"][1]["prefix_cache_hit_rate"] == 0.0
    one = cluster_summary(simulate_cluster(w, paged, ONE_SECOND, 1))
    single = summarize_result(simulate(w, paged, ONE_SECOND))
    assert [one[k] for k in keys] == [single[k] for k in keys] == [pytest.approx(8 / 18)] * 2 + [0]
    # Without caching: no hit rate and no bound (None) and no evictions, as in a single run.
    off = cluster_summary(simulate_cluster(HAND, cfg(), ONE_SECOND, 2))
    assert [off[k] for k in keys] == [None, None, 0]
    assert off["replicas"][0]["prefix_cache_hit_rate"] is None


def test_prefix_cache_bounds_leave_out_a_request_refused_for_its_length():
    """The same two requests plus a 40-token prompt refused at arrival (max_model_len 30, routed -1): each
    replica's figures are those of the requests routed to it, as without the refused one."""
    w = Workload((0.0, 1.0, 5.0), (9, 40, 9), (2, 2, 2), "hand", prefix_ids=((1, 2, 3), tuple(range(7, 17)), (1, 2, 4)),
                 prefix_block=4)
    paged = SchedulerConfig(kv_tokens=64, token_budget=16, max_seqs=4, kv="paged", block_size=4,
                            watermark=0.0, prefix_caching=True)
    res = simulate_cluster(w, paged, ONE_SECOND, 2, PrefixAffinityRouter(threshold=4), max_model_len=30)
    assert res.routed == [0, -1, 0]
    s = cluster_summary(res)
    assert s["replicas"][0]["prefix_cache_hit_rate"] == pytest.approx(8 / 18)
    assert s["replicas"][0]["prefix_cache_hit_rate_bound"] == pytest.approx(8 / 18)
    assert s["replicas"][1]["prefix_cache_hit_rate_bound"] == 0.0


def test_one_replica_cluster_is_the_simulator():
    """With one replica the cluster reproduces simulate step for step and summary for summary."""
    rng = random.Random(3)
    rows = [(round(rng.uniform(0, 20), 3), rng.randint(1, 40), rng.randint(1, 12)) for _ in range(60)]
    w = wl(*sorted(rows))
    cost = LinearCostModel(base_s=0.01, per_token_s=0.001)
    single = simulate(w, cfg(budget=16, kv=300), cost)
    cl = simulate_cluster(w, cfg(budget=16, kv=300), cost, 1)
    assert list(cl.merged.step_end) == list(single.step_end)
    assert list(cl.merged.first_step) == single.first_step and list(cl.merged.finish_step) == single.finish_step
    a, b = summarize_result(single), cluster_summary(cl)
    for key in ("completed", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "mean_kv_utilization"):
        assert a[key] == pytest.approx(b[key])


@pytest.mark.parametrize("seed", range(6))
def test_every_request_finishes_exactly_once(seed):
    """Seeded random workloads, routers, replica counts and KV policies (invariants checked each
    step): every request not rejected finishes on exactly one replica, with nothing left anywhere."""
    rng = random.Random(seed)
    rows = [(round(rng.uniform(0, 5), 3), rng.randint(1, 60), rng.randint(1, 20)) for _ in range(80)]
    w = wl(*sorted(rows))
    name = ["round-robin", "least-outstanding", "least-kv", "prefix-affinity", "random"][seed % 5]
    policy = "paged" if seed % 2 else "reserve"
    n = 1 + seed % 4
    c = simulate_cluster(
        w, cfg(budget=24, kv=120, kv_policy=policy), LinearCostModel(0.01, 0.001), n,
        make_router(name, seed=seed), check=True,
    )
    rejected = {rid for rid, _ in c.merged.rejected}
    for rid in range(len(w)):
        # The replicas share their per-request arrays; a request's entries are its replica's (owns).
        finished_on = [k for k, r in enumerate(c.replicas) if r.owns(rid) and r.finish_step[rid] >= 0]
        assert finished_on == ([] if rid in rejected else [c.routed[rid]])
        if rid not in rejected:
            assert c.merged.num_tokens(rid) == w.output_lens[rid]
    # check=True ran each replica's end-of-run check: no request left, all KV returned.


def test_bad_input():
    """Zero replicas, an unknown router, a negative threshold and a router out of range are refused."""
    with pytest.raises(ClusterError, match="replicas must be an integer >= 1, got 0"):
        simulate_cluster(HAND, cfg(), ONE_SECOND, 0)
    with pytest.raises(ClusterError, match="unknown router 'fastest'"):
        make_router("fastest")
    with pytest.raises(ClusterError, match="threshold must be an integer >= 0 tokens, got -1"):
        PrefixAffinityRouter(-1)
    with pytest.raises(ClusterError, match="load factor must be a number >= 1, got 0.5"):
        PrefixAffinityRouter(load_factor=0.5)
    with pytest.raises(ClusterError, match="load margin must be an integer >= 0 requests, got -1"):
        PrefixAffinityRouter(load_margin=-1)

    class Broken:
        def route(self, request, replicas):  # type: ignore[no-untyped-def]
            return 5

    with pytest.raises(ClusterError, match="returned replica 5"):
        simulate_cluster(HAND, cfg(), ONE_SECOND, 2, Broken())


def test_cli_bad_replicas_and_router(capsys):
    """`--replicas 0` and an unknown router exit 2 with a message naming the flag and the value."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--replicas", "0"])
    assert exc.value.code == 2
    assert "--replicas: expected an integer in [1, 4096], got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--replicas", "2", "--router", "fastest", "--num-requests", "10"])
    assert exc.value.code == 2
    assert "--router: invalid choice: 'fastest'" in capsys.readouterr().err


def test_cli_records_and_steps_have_a_replica_column(tmp_path, capsys, monkeypatch):
    """`--replicas 2 --records --out`: the requests CSVs say which replica served each request, the steps
    CSV which replica ran each step, its step counted per replica."""
    import csv

    from stallfree.sim.outputs import plots

    for name in ("plot_cdfs", "plot_timeline", "plot_replica_timeline"):
        monkeypatch.setattr(plots, name, lambda *a, **kw: None)
    rec, out = tmp_path / "r.csv", tmp_path / "out"
    assert main(["simulate", "--replicas", "2", "--router", "round-robin", "--num-requests", "10", "--linear-cost",
                 "5,50", "--records", str(rec), "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    for path in (rec, out / "requests-chunked-reserve.csv"):
        rows = list(csv.DictReader(path.read_text().splitlines()))
        assert [r["replica"] for r in rows] == ["0", "1"] * 5
    steps = list(csv.DictReader((out / "steps-chunked-reserve.csv").read_text().splitlines()))
    assert {r["replica"] for r in steps} == {"0", "1"}
    assert [r["step"] for r in steps if r["replica"] == "1"][0] == "0"


def test_cli_json_runs0_is_the_cluster(capsys):
    """`simulate --replicas 2 --json`: runs[0] has the single-run keys plus a replicas list."""
    import json

    assert main(["simulate", "--replicas", "2", "--router", "round-robin", "--num-requests", "40", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["num_requests"] == 40 and run["completed"] == 40 and run["rejected"] == 0
    assert "p99_ttft_ms" in run and run["router"] == "round-robin"
    assert [r["num_requests"] for r in run["replicas"]] == [20, 20]


def test_cli_out_draws_a_timeline_line_per_replica(capsys, tmp_path, monkeypatch):
    """`--replicas 3 --out`: timeline.png has one line per replica (the single-run plots are stubbed:
    their drawing is tested with the single-run --out); a per-replica timeline needs labels to match."""
    from stallfree.sim.outputs import plots

    calls: list[tuple[int, list[str] | None]] = []
    monkeypatch.setattr(plots, "plot_cdfs", lambda results, path, context=None: path.write_bytes(b""))
    monkeypatch.setattr(plots, "plot_timeline", lambda results, path, context=None, **kw: calls.append(
        (len(results), kw.get("labels"))))
    argv = ["simulate", "--replicas", "3", "--num-requests", "30", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["runs"][0]["num_requests"] == 30  # stdout is the JSON alone
    assert captured.err.startswith(f"wrote {tmp_path}/summary.json")
    # A lone cluster run's timeline has a line per replica; the merged steps are not drawn.
    assert calls == [(3, ["replica 0", "replica 1", "replica 2"])]
    with pytest.raises(ValueError, match="2 labels for 3 replicas"):
        plots.plot_replica_timeline([object()] * 3, tmp_path / "t.png", labels=["a", "b"])  # type: ignore[list-item]


def test_docs_example_runs(capsys):
    """The ```python example of docs/cluster.md runs as written and prints."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "cluster.md:example", "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.strip()
