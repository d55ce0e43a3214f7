"""Runs without records (simulate(records=False), `simulate --no-records`): the quantile sketch's bound
against numpy, every inter-token gap counted exactly once (as a multiset, bit for bit), and the summary
equal to the one from the records: counts exact, sums to 1e-9, percentiles within the sketch's ALPHA."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from stallfree.costmodel import CostModel, get_gpu, get_model
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.report import latency_arrays, summarize_result
from stallfree.sim.run import replica as replica_module
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.routers import make_router
from stallfree.sim.run.simulator import simulate
from stallfree.sim.run.tally import ALPHA, Moments, QuantileSketch, RunTally
from stallfree.sim.studies.cluster_study import cluster_summary

PCTS = (0, 1, 25, 50, 90, 99, 99.9, 100)
ROOFLINE = CostModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
LINEAR = LinearCostModel(0.01, 1e-5)
#: The overload, saturation and burst keys (stallfree.sim.outputs.overload.annotate): None without records.
ANALYSIS = ("overload", "saturated", "saturated_window_s", "saturated_by", "tail_burst")


def _workload(seed: int, n: int, rate: float = 30.0) -> Workload:
    rng = random.Random(seed)
    t, rows = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        rows.append((t, rng.randint(10, 5000), rng.randint(1, 300)))
    return Workload(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), name="rand")


#: (name, scheduler, cost model): plain decode runs (roofline pricing), preemptions (paged KV on a tight
#: cache: requests with several segments), skipped decodes (speculative tokens overflow the budget).
CASES = [
    ("reserve", ReplicaConfig.of(200_000, 2048, 64), ROOFLINE),
    ("paged", ReplicaConfig.of(60_000, 512, 64, kv_policy="paged", block_size=16), ROOFLINE),
    ("paged-linear", ReplicaConfig.of(30_000, 256, 128, kv_policy="paged", block_size=16), LINEAR),
    ("skips", ReplicaConfig.of(10**7, 8, 64, num_spec_tokens=2), LINEAR),
]


def _close(a: float, b: float, rel: float) -> bool:
    return a == b or abs(a - b) <= rel * abs(a)


def _assert_same_summary(exact: dict, streamed: dict, path: str = "") -> None:
    """Every key of `exact` in `streamed`: counts and strings equal, floats to 1e-9, percentiles and
    medians (ms) within ALPHA; wall times and the overload analysis (not run without records: None) apart."""
    for key, want in exact.items():
        if "wall" in key:
            continue
        if key in ANALYSIS:
            assert streamed[key] is None, key
            continue
        got = streamed[key]
        where = path + key
        if isinstance(want, dict):
            _assert_same_summary(want, got, where + ".")
        elif isinstance(want, list) and want and isinstance(want[0], dict):
            assert len(want) == len(got), where
            for i, (w, g) in enumerate(zip(want, got, strict=True)):
                _assert_same_summary(w, g, f"{where}[{i}].")
        elif isinstance(want, float) and isinstance(got, float):
            sketched = key.endswith("_ms") and (key.startswith("p") or key.startswith("median"))
            assert _close(want, got, ALPHA * (1 + 1e-9) if sketched else 1e-9), (where, want, got)
        else:
            assert want == got, (where, want, got)


def test_sketch_percentiles_within_alpha_of_numpys():
    """Lognormal values with ties and zeros, 1 to 20,000 of them: every percentile within ALPHA of
    np.percentile (linear), and the median the 50th."""
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 999, 20_000):
        x = np.round(rng.lognormal(-3, 1.5, n), 6)
        x[: n // 10] = 0.0
        s = QuantileSketch()
        s.add(x[: n // 2])
        s.add(x[n // 2:])
        assert s.n == n
        for q, got in zip(PCTS, s.percentiles(PCTS), strict=True):
            want = float(np.percentile(x, q))
            assert abs(got - want) <= ALPHA * want + 1e-300, (n, q, got, want)


def test_sketch_weights_merge_and_take_back():
    """Weighted adds equal repeated values; merging two equals adding both; a negative weight takes a
    value back; a negative value and a bad alpha are refused, naming the value."""
    a, b, c = QuantileSketch(), QuantileSketch(), QuantileSketch()
    a.add(np.array([0.5, 2.0]), np.array([3, 1]))
    b.add(np.array([0.5, 0.5, 0.5, 2.0]))
    assert a.percentiles(PCTS) == b.percentiles(PCTS)
    c.add(np.array([1e-3, 7.0]))
    a.merge(c)
    b.add(np.array([1e-3, 7.0]))
    assert a.n == b.n == 6 and a.percentiles(PCTS) == b.percentiles(PCTS)
    a.add(np.array([7.0]), np.array([-1]))
    assert a.n == 5 and a.percentiles([100])[0] == pytest.approx(2.0, rel=ALPHA)
    with pytest.raises(ValueError, match="-1.0"):
        a.add(np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="alpha"):
        QuantileSketch(0.0)


def test_moments_equal_numpy_mean_and_std():
    """Batches, weights and a merge with another shift: numpy's mean and population std to 1e-12."""
    rng = np.random.default_rng(3)
    x = 1e3 + rng.random(50_000) * 1e-3  # a small spread about a large mean
    m, other = Moments(), Moments()
    m.add(x[:10_000])
    other.add(x[30_000:] - 0.0)
    m.add(x[10_000:30_000:2], np.full(10_000, 2))
    m.merge(other)
    want = np.concatenate([x[:10_000], np.repeat(x[10_000:30_000:2], 2), x[30_000:]])
    assert m.n == len(want)
    assert _close(float(np.mean(want)), m.mean, 1e-12)
    assert _close(float(np.std(want)), m.std, 1e-9)


@pytest.mark.parametrize("fold_rows", [64, 1 << 15])
@pytest.mark.parametrize(("name", "config", "cost"), CASES, ids=[c[0] for c in CASES])
def test_every_gap_counted_once(monkeypatch, fold_rows, name, config, cost):
    """The gaps given to the tally, with their weights, are latency_arrays' gaps as a multiset, bit for bit:
    per-step counts, irregular requests' true gaps and the per-step ones taken back (folding the window
    every 64 rows, and in one piece)."""
    monkeypatch.setattr(replica_module, "_FOLD_ROWS", fold_rows)
    wl = _workload(1, 600)
    want = Counter(latency_arrays(simulate(wl, config, cost))["itl"].tolist())
    got: Counter[float] = Counter()

    def gaps(self, values, weights):  # type: ignore[no-untyped-def]
        for v, w in zip(np.asarray(values).tolist(), np.asarray(weights).tolist(), strict=True):
            got[v] += w

    monkeypatch.setattr(RunTally, "gaps", gaps)
    res = simulate(wl, config, cost, records=False)
    assert len(res.step_end) == 0  # every row folded
    assert +got == want and not -got


@pytest.mark.parametrize(("name", "config", "cost"), CASES, ids=[c[0] for c in CASES])
def test_summary_without_records_equals_the_one_with(monkeypatch, name, config, cost):
    """One replica and a cluster of three, with SLOs: the same keys and values (module docstring)."""
    monkeypatch.setattr(replica_module, "_FOLD_ROWS", 256)
    wl = _workload(2, 1500)
    slo = {"slo_ttft": 0.5, "slo_tpot": 0.02}
    exact = summarize_result(simulate(wl, config, cost), **slo)
    streamed = summarize_result(simulate(wl, config, cost, records=False, **slo), **slo)
    assert streamed["percentile_relative_error"] == ALPHA
    _assert_same_summary(exact, streamed)
    c_exact = simulate_cluster(wl, config, cost, 3, make_router("least-outstanding"))
    c_streamed = simulate_cluster(wl, config, cost, 3, make_router("least-outstanding"), records=False, **slo)
    _assert_same_summary(cluster_summary(c_exact, **slo), cluster_summary(c_streamed, **slo))
    assert c_streamed.step_base == c_exact.step_base  # each replica's steps counted


def test_refusals_name_what_needs_records():
    """A closed loop and tenants are refused; a summary against other SLOs than the run counted is refused."""
    wl = _workload(3, 20)
    config = ReplicaConfig.of(100_000, 512, 16)
    with pytest.raises(ValueError, match="closed-loop load"):
        simulate(wl, config, LINEAR, closed_loop=ClosedLoop(2, 0.0), records=False)
    tenants = Workload(wl.arrivals, wl.prompt_lens, wl.output_lens, "t", tenants=("a",) * len(wl))
    with pytest.raises(ValueError, match="tenants"):
        simulate(tenants, config, LINEAR, records=False)
    res = simulate(wl, config, LINEAR, records=False, slo_ttft=1.0)
    with pytest.raises(ValueError, match="slo_ttft=1.0"):
        summarize_result(res)
    assert summarize_result(res, slo_ttft=1.0)["completed"] == 20


def test_cli_no_records(capsys):
    """`simulate --no-records --json` runs a cluster with the same keys as with records (plus
    percentile_relative_error) and says that no overload analysis ran; --records with it is refused."""
    from stallfree.cli import main

    base = ["simulate", "--synthetic", "poisson", "--rate", "20", "--num-requests", "300", "--replicas", "2",
            "--kernels", "none", "--no-range", "--json"]
    assert main(base) == 0
    exact = json.loads(capsys.readouterr().out)["runs"][0]
    assert main([*base, "--no-records"]) == 0
    out = capsys.readouterr()
    streamed = json.loads(out.out)["runs"][0]
    assert "run without records" in out.err
    assert math.isfinite(streamed["p99_ttft_ms"])
    _assert_same_summary(exact, streamed)
    assert main([*base, "--no-records", "--records", "r.csv"]) == 2
    assert "--no-records keeps no records, and --records" in capsys.readouterr().err
