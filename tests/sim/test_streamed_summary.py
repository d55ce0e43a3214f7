"""The summary's figures without the whole-run arrays (issue 53): the inter-token gaps' figures
(stallfree.sim.outputs.itl) equal numpy's on the array of every gap, bit for bit; a cluster's replicas
share one set of per-request arrays, and each replica's figures are still its own requests'."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs import itl
from stallfree.sim.outputs.report import _stats, latency_arrays, summarize_result
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.routers import make_router
from stallfree.sim.run.simulator import simulate

PCTS = (50, 90, 99, 99.9, 0, 100, 37.5)


def _workload(seed: int, n: int) -> Workload:
    rng = random.Random(seed)
    t, rows = 0.0, []
    for _ in range(n):
        t += rng.expovariate(20.0)
        rows.append((round(t, 4), rng.randint(1, 300), rng.randint(1, 120)))
    return Workload(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), name="rand")


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 127, 128, 129, 1000, 4099, 100_003])
@pytest.mark.parametrize("chunk", [128, 1000])
def test_pairwise_sum_is_numpys_sum(monkeypatch, n, chunk):
    """numpy's recursion with numpy summing each piece of at most CHUNK values: np.add.reduce's result."""
    monkeypatch.setattr(itl, "CHUNK", chunk)
    x = np.random.default_rng(n).random(n) * 1e-2
    assert itl.pairwise_sum(n, lambda lo, hi: x[lo:hi]) == float(np.add.reduce(x))


def test_pairwise_sum_leaves_nothing_for_the_garbage_collector(monkeypatch):
    """What `piece` reads is freed when the caller lets go of it, with the cycle collector off: a recursive
    closure would hold it in a cycle (a 1 M-request run's gaps, about 180 MB, until the next collection)."""
    import gc
    import weakref

    class Gaps:
        def __init__(self, x):
            self.x = x

        def piece(self, lo, hi):
            return self.x[lo:hi]

    monkeypatch.setattr(itl, "CHUNK", 128)
    gaps = Gaps(np.random.default_rng(3).random(1000))
    alive = weakref.ref(gaps)
    gc.disable()
    try:
        assert itl.pairwise_sum(1000, gaps.piece) == float(np.add.reduce(gaps.x))
        del gaps
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 5000])
def test_percentile_is_numpys(n):
    """From the k-th smallest value alone, np.percentile's linear interpolation to the last bit."""
    rng = np.random.default_rng(n)
    x = np.round(rng.random(n), 3)  # ties
    s = np.sort(x)
    for q in (*PCTS, 12.34, 66.6):
        assert itl.percentile(n, float(q), lambda k: float(s[k])) == float(np.percentile(x, q))


def _check_itl(res, monkeypatch):  # type: ignore[no-untyped-def]
    lat = latency_arrays(res)
    want = _stats("itl", lat["itl"], PCTS)
    # WHOLE_GAPS 0: the sums piece by piece (pairwise_sum), as beyond 2**21 gaps; else over one array.
    # HELD_STEPS 0: the per-step gaps and counts made piece by piece when read, as beyond 2**22 steps.
    for chunk, sort_pairs, whole, held in (
            (128, itl.SORT_PAIRS, 0, itl.HELD_STEPS), (1000, 0, 0, itl.HELD_STEPS),
            (itl.CHUNK, itl.SORT_PAIRS, 0, itl.HELD_STEPS), (itl.CHUNK, itl.SORT_PAIRS, itl.WHOLE_GAPS, itl.HELD_STEPS),
            (128, itl.SORT_PAIRS, 0, 0), (1000, 0, 0, 0), (itl.CHUNK, itl.SORT_PAIRS, itl.WHOLE_GAPS, 0),
            (777, 10**9, 0, 0)):
        monkeypatch.setattr(itl, "CHUNK", chunk)
        monkeypatch.setattr(itl, "SORT_PAIRS", sort_pairs)  # 0: the percentiles by radix selection
        monkeypatch.setattr(itl, "WHOLE_GAPS", whole)
        monkeypatch.setattr(itl, "HELD_STEPS", held)
        assert itl.itl_stats(res, lat["rids"], PCTS) == want, (chunk, sort_pairs, whole, held)
    return lat


def test_itl_figures_equal_numpys_on_every_gap(monkeypatch):
    """A regular run: the streamed figures equal numpy's mean, median, std and percentiles of all gaps."""
    res = simulate(_workload(1, 400), SchedulerConfig(50_000, 256, 64), LinearCostModel(0.005, 2e-5))
    lat = _check_itl(res, monkeypatch)
    assert len(lat["itl"]) > 10_000  # many pieces of 128


def test_itl_figures_with_preemptions_and_skips(monkeypatch):
    """A paged run on a tight cache (preempted requests: their gaps come from their own token times)."""
    work = _workload(9, 200)
    config = SchedulerConfig(kv_tokens=1024, token_budget=128, max_seqs=32, kv="paged", block_size=16)
    res = simulate(work, config, LinearCostModel(0.005, 2e-5, 1e-8))
    assert res.segments or res.skips
    _check_itl(res, monkeypatch)


def test_cluster_replicas_share_arrays_and_keep_their_own_figures(monkeypatch):
    """Replicas share one array per per-request field (not one per replica); each replica's latency
    arrays hold exactly the requests routed to it that finished, and its ITL figures are numpy's."""
    work = _workload(3, 300)
    c = simulate_cluster(work, SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5), 3,
                         make_router("round-robin"))
    assert all(r.first_step is c.replicas[0].first_step for r in c.replicas)
    assert all(r.finish_reason is c.replicas[0].finish_reason for r in c.replicas)
    total = 0
    for k, res in enumerate(c.replicas):
        lat = _check_itl(res, monkeypatch)
        assert lat["rids"].tolist() == [r for r in range(len(work)) if c.routed[r] == k]
        total += len(lat["rids"])
        assert summarize_result(res)["completed"] == len(lat["rids"])
    assert total == summarize_result(c.merged)["completed"] == len(work)
    _check_itl(c.merged, monkeypatch)


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_records_written_row_by_row_equal_the_whole_list(tmp_path, suffix):
    """write_records streams its rows, and the file is byte for byte what the whole list gave:
    json.dumps(rows, indent=1) or csv.DictWriter over the list (a cluster's, with its replica column)."""
    import csv
    import json

    from stallfree.sim.outputs.records import request_records, write_records

    work = _workload(4, 120)
    c = simulate_cluster(work, SchedulerConfig(2_000, 64, 8), LinearCostModel(0.005, 2e-5), 2,
                         make_router("least-outstanding"))
    rows = request_records(c.merged, c.routed)
    assert len(rows) == len(work) and rows[7]["replica"] == c.routed[7]
    got = tmp_path / f"r{suffix}"
    write_records(c.merged, got, c.routed)
    want = tmp_path / f"w{suffix}"
    if suffix == ".json":
        want.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    else:
        with open(want, "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    assert got.read_bytes() == want.read_bytes()


def test_finished_requests_leave_the_loop():
    """The loop holds a Request only while it is in flight: counted every 100 arrivals during a cluster
    run (the garbage collector's objects, read when the router is asked, which both the heap path and the
    replicas' runs apart between arrivals go through), the live Requests stay far below the workload's, and
    none is left after it (what a run keeps of a finished request is its entries in the compact arrays)."""
    import gc

    from stallfree.core.request import Request

    work = _workload(5, 800)
    gc.collect()
    # Requests another test of this process left alive are not this run's.
    before = sum(1 for o in gc.get_objects() if type(o) is Request)
    live: list[int] = []
    router = make_router("least-outstanding")
    calls = [0]

    class Counting(type(router)):  # type: ignore[misc]
        __slots__ = ()

        def route(self, request, replicas):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] % 100 == 0:
                gc.collect()
                live.append(sum(1 for o in gc.get_objects() if type(o) is Request) - before)
            return super().route(request, replicas)

    router.__class__ = Counting
    c = simulate_cluster(work, SchedulerConfig(20_000, 256, 64), LinearCostModel(0.005, 2e-5), 3, router)
    gc.collect()
    assert len(live) >= 5 and max(live) <= 3 * 64 + 50  # seats of 3 replicas, plus those waiting
    # At most `before`: a Request another test left in a cache may be let go during the run (seen once in the
    # compiled build's quick set), but none of this run's may stay.
    assert sum(1 for o in gc.get_objects() if type(o) is Request) <= before
    assert summarize_result(c.merged)["completed"] == len(work)


@pytest.mark.parametrize("sort_pairs", [itl.SORT_PAIRS, 0], ids=["sorted-at-once", "radix"])
def test_select_finds_weighted_order_statistics(monkeypatch, sort_pairs):
    """The selection over (value, count) pieces, all pairs sorted at once or by radix passes (beyond
    SORT_PAIRS): the k-th smallest of the expanded multiset (np.repeat, then sort), for values with ties,
    zeros and negatives, pieces of any size."""
    monkeypatch.setattr(itl, "SORT_PAIRS", sort_pairs)
    rng = np.random.default_rng(7)
    values = np.concatenate([np.round(rng.normal(0.02, 0.01, 3000), 5), [0.0, -0.0, 1e-300, -3.5, 7e3]])
    counts = rng.integers(0, 4, len(values))
    flat = np.sort(np.repeat(values, counts))
    ranks = sorted({0, 1, len(flat) // 2, len(flat) - 1, *rng.integers(0, len(flat), 20).tolist()})

    def pairs():  # type: ignore[no-untyped-def]
        for c in range(0, len(values), 333):
            yield values[c:c + 333], counts[c:c + 333]

    got = itl.select(ranks, pairs)
    assert [got[k] for k in ranks] == [float(flat[k]) for k in ranks]


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 5000])
def test_median_in_pieces_is_numpys(monkeypatch, n):
    """itl.median over pieces of at most CHUNK values: np.median of the whole array, ties and even counts too."""
    monkeypatch.setattr(itl, "CHUNK", 7)
    x = np.round(np.random.default_rng(n).random(n) * 1e-2, 4)
    assert itl.median(n, lambda lo, hi: x[lo:hi]) == float(np.median(x))
    monkeypatch.setattr(itl, "SORT_PAIRS", n // 2)  # more values than that: the radix selection at once
    assert itl.median(n, lambda lo, hi: x[lo:hi]) == float(np.median(x))
    with pytest.raises(ValueError, match="n must be >= 1"):
        itl.median(0, lambda lo, hi: x[lo:hi])


def _whole_array_step_figures(res):  # type: ignore[no-untyped-def]
    """The step figures as numpy gives them on whole arrays (what summarize_result reported before)."""
    end, start = np.frombuffer(res.step_end), np.asarray(list(res.step_start), dtype=np.float64)
    dur = end - start
    tokens, kv = np.asarray(res.step_tokens), np.asarray(res.step_kv_used)
    waiting, decodes = np.asarray(res.step_waiting), np.asarray(res.step_decodes)
    busy = float(dur.sum())
    return {
        "mean_tokens_per_step": float(tokens.mean()),
        "budget_utilization": float(tokens.mean() / res.config["token_budget"]),
        "queued_fraction": float((waiting > 0).mean()),
        "mean_kv_utilization": float((kv * dur).sum() / busy / res.kv_total),
        "max_kv_utilization": float(kv.max() / res.kv_total),
        "mean_running_decodes": float((decodes * dur).sum() / busy),
        "median_step_s": float(np.median(dur)),
    }


@pytest.mark.parametrize("chunk", [128, 1000, itl.CHUNK])  # numpy sums blocks of up to 128 itself
def test_step_figures_in_pieces_equal_numpys_on_whole_arrays(monkeypatch, chunk):
    """A cluster run (merged and each replica): the step figures and the median step duration, summed and
    selected in pieces, equal numpy's on the whole arrays, bit for bit."""
    from stallfree.sim.outputs.overload import median_step_s
    from stallfree.sim.outputs.report import _step_figures

    monkeypatch.setattr(itl, "CHUNK", chunk)
    work = _workload(5, 400)
    c = simulate_cluster(work, SchedulerConfig(2_000, 64, 4), LinearCostModel(0.005, 2e-5), 3,
                         make_router("least-outstanding"))
    assert c.merged.num_steps > 3 * 1000  # several pieces per replica
    for res in (c.merged, *c.replicas):
        want = _whole_array_step_figures(res)
        got = _step_figures(res)
        assert {k: got[k] for k in want if k != "median_step_s"} == {k: v for k, v in want.items()
                                                                     if k != "median_step_s"}
        assert median_step_s(res) == want["median_step_s"]
        assert 0 < want["queued_fraction"] < 1  # waiting rows of both kinds


def test_finish_reasons_are_shared_strings_and_large_blocks_map_their_own_pages():
    """A finished request's reason is one shared string per reason, not one per request; map_large_blocks
    takes a threshold of a page to 2**31 - 1 bytes (and a run after it gives the same figures)."""
    from stallfree.sim.run.memory import map_large_blocks

    work = _workload(4, 200)
    c = simulate_cluster(work, SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5), 2,
                         make_router("round-robin"))
    reasons = c.merged.finish_reason
    assert set(reasons) == {"length"}
    assert all(r is reasons[0] for r in reasons)
    for bad in (0, 4095, 2**31):
        with pytest.raises(ValueError, match="threshold"):
            map_large_blocks(bad)
    map_large_blocks()
    again = simulate_cluster(work, SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5), 2,
                             make_router("round-robin"))
    assert summarize_result(again.merged) | {"sim_wall_s": 0} == summarize_result(c.merged) | {"sim_wall_s": 0}


def test_decode_ticks_are_counted_from_the_decodes_not_stored():
    """SimResult.step_ticks: per step the steps with decodes so far, counted from step_decodes (numpy's
    cumsum of decodes > 0 on a paged run that preempts, merged and per replica); the rows' values given
    to append/extend are not kept; release() lets the counts go."""
    from array import array

    from stallfree.sim.run.result import DecodeTicks

    work = _workload(9, 200)
    config = SchedulerConfig(kv_tokens=1024, token_budget=128, max_seqs=32, kv="paged", block_size=16)
    c = simulate_cluster(work, config, LinearCostModel(0.005, 2e-5, 1e-8), 2, make_router("round-robin"))
    for res in (c.merged, *c.replicas):
        want = np.cumsum(np.asarray(res.step_decodes) > 0)
        assert len(res.step_ticks) == res.num_steps
        assert list(res.step_ticks) == want.tolist()
        assert res.step_ticks[-1] == int(want[-1]) and res.step_ticks[2:5] == array("i", want[2:5].tolist())
    decodes = array("i", [0, 3, 3, 0, 1])
    t = DecodeTicks(decodes)
    t.append(99)
    t.extend([7, 8])
    assert list(t) == [0, 1, 2, 2, 3]
    decodes.append(2)
    assert list(t) == [0, 1, 2, 2, 3, 4] and len(t) == 6
    t.release()
    assert t[5] == 4


@pytest.mark.parametrize("share", [0.0, 0.05, 0.5, 0.95, 1.0])
def test_decode_steps_either_way_are_the_steps_with_decodes(monkeypatch, share):
    """itl._DecodeSteps, held as the steps with decodes or as those without (whichever is shorter):
    count_le(s) is np.searchsorted(np.flatnonzero(dec), s, side="right"), step_of(j) its j-th entry."""
    monkeypatch.setattr(itl, "CHUNK", 128)
    rng = np.random.default_rng(int(share * 100))
    dec = np.where(rng.random(1000) < share, 0, rng.integers(1, 9, 1000)).astype(np.int32)
    d = np.flatnonzero(dec)
    steps = itl._DecodeSteps(dec)
    assert steps.explicit == (len(d) <= 1000 - len(d)) and len(steps) == len(d)
    s = np.arange(1000, dtype=np.int64)
    assert steps.count_le(s).tolist() == np.searchsorted(d, s, side="right").tolist()
    # step_of(j) = D[j], from D or from its complement.
    assert steps.step_of(np.arange(len(d))).tolist() == d.tolist()


def test_step_starts_keep_only_the_starts_that_are_not_the_previous_end():
    """StepStarts: the starts that differ (bit for bit) from the previous step's end are kept, the rest read
    from step_end; indexing, slices, iteration and the numpy reader (itl.step_starts) give the starts back.
    A cluster's merged and per-replica results hold one, equal to what one replica alone records."""
    from array import array

    from stallfree.sim.run.result import StepStarts

    start = array("d", [0.0, 0.0, 2.5, 3.0, -0.0, 5.0])
    end = array("d", [1.0, 2.0, 3.0, 0.0, 5.0, 8.0])
    st = StepStarts.of(start, end)
    assert list(st.at) == [0, 1, 2, 4] and list(st.value) == [0.0, 0.0, 2.5, -0.0]  # -0.0 is not 0.0
    assert list(st) == list(start) and len(st) == 6
    assert st[-1] == 5.0 and st[1:4] == array("d", [0.0, 2.5, 3.0])
    assert str(st[4]) == "-0.0"
    assert itl.step_starts(_Res(st, end), np.array([5, 0, 4, 1])).tolist() == [5.0, 0.0, -0.0, 0.0]
    with pytest.raises(IndexError, match="out of range"):
        st[6]
    with pytest.raises(ValueError, match="starts"):
        StepStarts(end, array("q", [0]), array("d"))
    work = _workload(2, 300)
    one = simulate(work, SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5))
    c = simulate_cluster(work, SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5), 1,
                         make_router("round-robin"))
    assert isinstance(c.merged.step_start, StepStarts) and len(c.merged.step_start.at) < c.merged.num_steps / 2
    assert list(c.merged.step_start) == list(one.step_start) == list(c.replicas[0].step_start)
    steps = np.arange(one.num_steps)
    assert itl.step_starts(c.merged, steps).tolist() == list(one.step_start)


class _Res:
    """The two step columns itl.step_starts reads."""

    def __init__(self, step_start, step_end):  # type: ignore[no-untyped-def]
        self.step_start, self.step_end = step_start, step_end


@pytest.mark.parametrize("rows", [1, 5, 64, 1 << 17])
def test_cluster_replicas_hold_their_starts_as_exceptions_as_they_run(monkeypatch, rows):
    """A cluster's replicas keeping every row reduce their starts to StepStarts' exceptions every
    _COMPACT_ROWS rows: the same exceptions (the same steps, the same floats) as StepStarts.of over the whole
    array one replica alone records, and the same summary whatever the interval."""
    from stallfree.sim.run import replica as replica_module
    from stallfree.sim.run.result import StepStarts

    monkeypatch.setattr(replica_module, "_COMPACT_ROWS", rows)  # the compiled build keeps its own: one interval
    work = _workload(4, 300)
    config, cost = SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5)
    one = simulate(work, config, cost)
    want = StepStarts.of(one.step_start, one.step_end)
    c = simulate_cluster(work, config, cost, 1, make_router("round-robin"))
    got = c.replicas[0].step_start
    assert isinstance(got, StepStarts)
    assert (list(got.at), list(got.value)) == (list(want.at), list(want.value))
    three = simulate_cluster(work, config, cost, 3, make_router("round-robin"))
    monkeypatch.setattr(replica_module, "_COMPACT_ROWS", 1 << 17)
    again = simulate_cluster(work, config, cost, 3, make_router("round-robin"))
    assert list(three.merged.step_start.at) == list(again.merged.step_start.at)
    assert list(three.merged.step_start) == list(again.merged.step_start)
    a, b = summarize_result(three.merged), summarize_result(again.merged)
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b


def test_step_counts_are_two_bytes_where_the_configuration_bounds_them():
    """step_tokens and step_decodes are array "H" (2 bytes) when the token budget and max_seqs are at most
    65,535, "i" otherwise; the rows are the same values either way, also in plain decode runs taken at once,
    where the two columns may be of different types."""
    from stallfree.core.scheduler import Scheduler
    from stallfree.sim.run.simulator import step_count_codes

    assert step_count_codes(Scheduler(2048, 256, 100_000)) == ("H", "H")
    assert step_count_codes(Scheduler(70_000, 256, 100_000)) == ("i", "H")
    assert step_count_codes(Scheduler(65_535, 65_536, 100_000)) == ("H", "i")
    assert step_count_codes(None) == ("i", "i")
    work = _workload(5, 200)  # prompts of at most 300 tokens: neither budget binds, so the runs are the same
    cost = LinearCostModel(0.005, 2e-5)
    # kv_tokens, token_budget, max_seqs; two lightly loaded replicas, which take runs of plain decode steps at once.
    narrow = simulate_cluster(work, SchedulerConfig(200_000, 65_535, 64), cost, 2, make_router("round-robin")).merged
    wide = simulate_cluster(work, SchedulerConfig(200_000, 70_000, 64), cost, 2, make_router("round-robin")).merged
    assert (narrow.step_tokens.typecode, narrow.step_decodes.typecode) == ("H", "H")
    assert (wide.step_tokens.typecode, wide.step_decodes.typecode) == ("i", "H")
    assert list(narrow.step_tokens) == list(wide.step_tokens) and list(narrow.step_decodes) == list(wide.step_decodes)
    assert max(narrow.step_decodes) > 1 and narrow.num_steps == wide.num_steps
    a, b = summarize_result(narrow), summarize_result(wide)
    for summary in (a, b):
        for key in ("sim_wall_s", "token_budget", "budget_utilization", "label"):
            summary.pop(key, None)
    assert a == b


def test_per_request_token_counts_are_c_ints_unless_a_length_needs_more():
    """plan_run's max_new and target: array "i" (4 bytes a request), "q" where a length reaches 2**31."""
    from stallfree.sim.run.simulator import plan_run

    config, cost = SchedulerConfig(20_000, 128, 32), LinearCostModel(0.005, 2e-5)
    work = Workload((0.0, 1.0), (10, 20), (5, 7), name="two")
    max_new, _, target, _, _ = plan_run(work, config, cost, None, None, False, None)
    assert (max_new.typecode, target.typecode, list(max_new), list(target)) == ("i", "i", [5, 7], [5, 7])
    max_new, _, target, _, _ = plan_run(work, config, cost, 6, None, False, None)
    assert (max_new.typecode, list(max_new), list(target)) == ("i", [6, 6], [5, 6])
    max_new, _, target, _, _ = plan_run(work, config, cost, 2**31, None, False, None)
    assert (max_new.typecode, target.typecode, list(max_new), list(target)) == ("q", "q", [2**31] * 2, [5, 7])
    huge = Workload((0.0,), (10,), (2**31,), name="huge")
    max_new, _, target, _, _ = plan_run(huge, config, cost, None, None, False, None)
    assert (max_new.typecode, list(target)) == ("q", [2**31])
