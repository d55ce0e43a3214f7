"""Tests of stallfree.sim.run.disagg: one request worked by hand under a linear cost model, KV held on
the prefill side until its transfer ends, a seeded every-request-finishes-once test, bad input."""

from __future__ import annotations

import json
import random

import pytest

from stallfree.cli import main
from stallfree.core.plan import StepPlan
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.outputs.disagg_report import disagg_summary
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.disagg import parse_disaggregate, simulate_disaggregated
from stallfree.sim.run.disagg_link import Interconnect
from stallfree.sim.run.result import ClusterError

PREFILL = LinearCostModel(base_s=0.010, per_token_s=0.001)
DECODE = LinearCostModel(base_s=0.010, per_token_s=0.001, per_context_token_s=1e-5)
LINK = Interconnect("test", bandwidth_bytes_per_s=1e6, latency_s=0.005)


def cfg(kv: int = 1000) -> SchedulerConfig:
    """A scheduler with budget 256."""
    return SchedulerConfig(kv_tokens=kv, token_budget=256, max_seqs=8)


def test_one_request_by_hand():
    """Prompt 100, 4 tokens, 1,000 KV bytes per token, link 1 MB/s + 5 ms.

    Prefill: one step of 100 tokens, 10 + 100 x 1 = 110 ms: TTFT 110 ms.
    Transfer: 5 ms + 100 x 1,000 B / 1e6 B/s = 105 ms, from 110 to 215 ms.
    Decode: the first token fed (1 token, 10 + 1 = 11 ms): token 2 at 226 ms; then decodes with
    context 101 and 102: 10 + 1 + 1.01 = 12.01 ms and 12.02 ms: tokens 3 and 4 at 238.01, 250.03 ms.
    TPOT = (250.03 - 110) / 3 = 46.6767 ms.
    """
    w = Workload((0.0,), (100,), (4,), "hand")
    r = simulate_disaggregated(w, cfg(), cfg(), PREFILL, DECODE, 1, 1, 1000, LINK)
    (tl,) = r.timelines
    assert tl.token_times == pytest.approx((0.110, 0.226, 0.23801, 0.25003))
    assert r.transfer_end[0] - r.transfer_start[0] == pytest.approx(0.105)
    s = disagg_summary(r, 1)
    assert s["mean_ttft_ms"] == pytest.approx(110.0)
    assert s["mean_transfer_ms"] == pytest.approx(105.0)
    assert s["mean_tpot_ms"] == pytest.approx((250.03 - 110.0) / 3)
    assert [x["role"] for x in s["replicas"]] == ["prefill", "decode"]
    # TTFT 110 ms: within a 200 ms SLO, not within a 100 ms one.
    assert disagg_summary(r, 1, slo_ttft=0.2)["slo_attainment"] == 1.0
    assert disagg_summary(r, 1, slo_ttft=0.1)["slo_attainment"] == 0.0
    assert s["slo_attainment"] is None


class PerDecodeCost:
    """DECODE's prices read decode by decode (as the kernel tables' decode attention reads each decode's
    start, not decode_context_sum): 10 ms + 1 ms per token + 0.01 ms per token of each decode's context."""

    def step_time(self, plan: StepPlan) -> float:
        return 0.010 + 0.001 * plan.num_tokens + 1e-5 * sum(plan.decode_starts)


def test_one_request_by_hand_priced_decode_by_decode():
    """The hand request above under a cost model that reads each decode's start: the same token times
    (contexts 101 and 102 on the decode side, not the decode replica's step numbers 1 and 2)."""
    w = Workload((0.0,), (100,), (4,), "hand")
    r = simulate_disaggregated(w, cfg(), cfg(), PREFILL, PerDecodeCost(), 1, 1, 1000, LINK)
    (tl,) = r.timelines
    assert tl.token_times == pytest.approx((0.110, 0.226, 0.23801, 0.25003))


def test_shifted_cost_shows_each_decode_its_true_context():
    """A decode replica's step 10: decodes a (offset 0: scheduler start 10) and b (offset 5: start 15),
    prompts 1,000 and 200, and the 1-token first chunk of c (prompt 50). The cost model sees starts
    1,010 and 215 (sum 1,225; offsets sorted 205, 1,000) and the chunk at 50; the next step, with the
    same decodes (the scheduler's same offsets tuple), the same shifted tuple object: starts 1,011, 216."""
    from stallfree.core.plan import ScheduledChunk
    from stallfree.sim.run.disagg import _ShiftedCost

    seen: list[StepPlan] = []

    class Record:
        def step_time(self, plan: StepPlan) -> float:
            seen.append(plan)
            return 0.0

    cost = _ShiftedCost(Record(), {"a": 1000, "b": 200, "c": 50})  # type: ignore[arg-type]
    offs = (0, 5)
    cost.step_time(StepPlan(10, ("a", "b"), offs, (ScheduledChunk("c", 1, True, 0, True),), 3, 25, 256))
    cost.step_time(StepPlan(11, ("a", "b"), offs, (), 2, 27, 256))
    first, second = seen
    assert first.decode_starts == (1010, 215) and first.decode_context_sum == 1225
    assert first.decode_offsets_sorted == (205, 1000)
    assert [c.start for c in first.prefills] == [50]
    assert second.decode_starts == (1011, 216) and second.decode_context_sum == 1227
    assert second.decode_offsets is first.decode_offsets


def test_each_side_states_its_step_figures(capsys):
    """The hand request's per-step figures, per side (`sides`; the table's "P x | D y" cells, not "-"):
    prefill 1 step of 100 tokens (budget 256: 39.1%); decode 3 steps of 1 token (0.4%), the first
    feeding the first token (11 ms, no decode), then 1 decode for 12.01 + 12.02 ms: running decodes
    24.03 / 35.03 = 0.686 on time average; no preemption."""
    from stallfree.sim.outputs.table import print_table

    w = Workload((0.0,), (100,), (4,), "hand")
    s = disagg_summary(simulate_disaggregated(w, cfg(), cfg(), PREFILL, DECODE, 1, 1, 1000, LINK), 1)
    p, d = s["sides"]["prefill"], s["sides"]["decode"]
    assert (p["num_steps"], p["mean_tokens_per_step"], p["budget_utilization"]) == (1, 100.0, 100 / 256)
    assert (d["num_steps"], d["mean_tokens_per_step"], d["budget_utilization"]) == (3, 1.0, 1 / 256)
    assert d["mean_running_decodes"] == pytest.approx(24.03 / 35.03) and p["mean_running_decodes"] == 0.0
    assert p["num_preemptions"] == d["num_preemptions"] == 0
    # Its prompt (100 tokens) in the bucket <1k: TTFT 110 ms, TPOT 46.68 ms, E2E 250.03 ms.
    b = s["by_prompt_len"]
    assert list(b) == ["<1k"] and b["<1k"]["requests"] == 1
    assert (b["<1k"]["median_ttft_ms"], b["<1k"]["p99_tpot_ms"], b["<1k"]["median_e2el_ms"]) == pytest.approx(
        (110.0, (250.03 - 110.0) / 3, 250.03))
    aggregated = {"label": "aggregated", "prefix_cache_hit_rate": 0.5, "prefix_cache_evictions": 3}
    print_table([aggregated, s | {"label": "disagg 1P:1D"}])
    table = capsys.readouterr().out
    assert "P 1 | D 3" in table and "P 39.1% | D 0.4%" in table and "P 0.0 | D 0.7" in table
    assert "110 | 110" in table  # the bucket row of TTFT p50 | p99
    hit = next(line for line in table.splitlines() if "prefix cache hit rate" in line)
    assert [c.strip() for c in hit.split("│")[2:4]] == ["50.0%", "not modelled"]  # not under disaggregation


def test_records_by_hand():
    """The hand request above as a record: prefilled on replica 0, decoded on replica 0, transfer
    110 -> 215 ms, decode admitted at 215 ms, tokens at 110 ... 250.03 ms. Two prefill and two decode
    replicas (least-outstanding): a second request (arriving with the first) goes to replica 1 on each
    side; a third, too long for the context, is rejected with no replica."""
    from stallfree.sim.outputs.disagg_report import RECORD_FIELDS, disagg_records

    w = Workload((0.0, 0.0, 0.0), (100, 100, 900), (4, 4, 4), "hand")
    r = simulate_disaggregated(w, cfg(), cfg(), PREFILL, DECODE, 2, 2, 1000, LINK, max_model_len=500)
    rows = disagg_records(r, w)
    assert [list(x) for x in rows] == [list(RECORD_FIELDS)] * 3
    a, b, c = rows
    assert (a["prefill_replica"], a["decode_replica"], b["prefill_replica"], b["decode_replica"]) == (0, 0, 1, 1)
    assert a["transfer_start_s"] == pytest.approx(0.110) and a["transfer_end_s"] == pytest.approx(0.215)
    assert a["transfer_ms"] == pytest.approx(105.0) and a["decode_admitted_s"] == pytest.approx(0.215)
    assert a["ttft_ms"] == pytest.approx(110.0) and a["finish_s"] == pytest.approx(0.25003)
    assert a["tpot_ms"] == pytest.approx((250.03 - 110.0) / 3) and a["e2el_ms"] == pytest.approx(250.03)
    assert a["queue_ms"] == 0.0 and a["output_tokens"] == 4 and a["finish_reason"] == "length"
    assert a["rejected"] is None and b == {**a, "rid": 1, "prefill_replica": 1, "decode_replica": 1}
    assert c["prefill_replica"] is None and c["rejected_reason"] == "context_length" and c["ttft_ms"] is None
    with pytest.raises(ValueError, match="the workload has 1 requests; the result 3"):
        disagg_records(r, Workload((0.0,), (5,), (2,), "other"))


def test_prefill_holds_kv_until_the_transfer_ends():
    """Prefill KV of 150 tokens holds one 101-token request: the second waits for the first's
    transfer to end (215 ms), then prefills in 110 ms: TTFT 325 ms. Steps record the gate's KV."""
    w = Workload((0.0, 0.0), (100, 100), (4, 4), "hand")
    r = simulate_disaggregated(w, cfg(150), cfg(), PREFILL, DECODE, 1, 1, 1000, LINK)
    first = {tl.rid: tl.token_times[0] for tl in r.timelines}
    assert first[0] == pytest.approx(0.110)
    assert first[1] == pytest.approx(0.325)
    # The recorded KV is the gate's: each prefill step ends holding its request's 101 tokens (the
    # scheduler itself has freed them); the decode side's first step holds r0's 100 + 4.
    assert list(r.prefill[0].step_kv_used) == [101, 101]
    assert r.decode[0].step_kv_used[0] == 104


def test_single_token_request_moves_nothing():
    """A request with one output token finishes on the prefill side with no transfer."""
    w = Workload((0.0,), (10,), (1,), "hand")
    r = simulate_disaggregated(w, cfg(), cfg(), PREFILL, DECODE, 1, 1, 1000, LINK)
    assert r.timelines[0].token_times == pytest.approx((0.020,))
    assert r.decode_of == [-1]


@pytest.mark.parametrize("seed", range(4))
def test_every_request_finishes_exactly_once(seed):
    """Seeded random workloads on P:D in {1..3}:{1..3} with invariants checked: every request not
    rejected has exactly its tokens, its first on one prefill replica, the rest on one decode replica."""
    rng = random.Random(seed)
    rows = sorted((round(rng.uniform(0, 3), 3), rng.randint(1, 60), rng.randint(1, 15)) for _ in range(60))
    w = Workload(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), "rand")
    p, d = 1 + seed % 3, 1 + (seed * 2) % 3
    r = simulate_disaggregated(w, cfg(200), cfg(200), PREFILL, DECODE, p, d, 100, LINK, check=True)
    rejected = {rid for rid, _ in r.rejected}
    done = {tl.rid: tl for tl in r.timelines}
    assert set(done) | rejected == set(range(len(w))) and not set(done) & rejected
    for rid, tl in done.items():
        assert len(tl.token_times) == w.output_lens[rid]
        assert sum(res.finish_step[rid] >= 0 for res in r.prefill) == 1
        assert sum(res.finish_step[rid] >= 0 for res in r.decode) == (1 if w.output_lens[rid] > 1 else 0)


def test_bad_input():
    """P:D must be two integers >= 1; a link needs a positive bandwidth."""
    assert parse_disaggregate("3:5") == (3, 5)
    for text in ("0:2", "2", "a:b", "1:2:3", "2:-1"):
        with pytest.raises(ClusterError, match="`disaggregate` wants P:D"):
            parse_disaggregate(text)
    with pytest.raises(ClusterError, match="link bandwidth must be > 0"):
        Interconnect("x", 0.0, 0.0)
    w = Workload((0.0,), (10,), (2,), "hand")
    with pytest.raises(ClusterError, match="decode replicas must be an integer >= 1, got 0"):
        simulate_disaggregated(w, cfg(), cfg(), PREFILL, DECODE, 1, 0, 10, LINK)


@pytest.mark.parametrize("value", ["serach", "0:4", "4"])
def test_cli_misspelt_disaggregate_with_replicas(capsys, value):
    """A value that is neither P:D nor search is named for itself, before --replicas (which goes with
    search) is refused: the user is told to fix the value, not to drop flags."""
    argv = ["simulate", "--disaggregate", value, "--replicas", "4", "--slo-ttft", "1s", "--slo-tpot", "50ms"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"stallfree simulate: error: --disaggregate wants P:D with P, D >= 1 replicas, or search; "
                   f"got '{value}'\n")


@pytest.mark.parametrize(("argv", "said"), [
    (["--disaggregate", "100000:100000"],
     "--disaggregate 100000:100000: P + D is 200,000 replicas, more than the 4,096 allowed"),
    (["--disaggregate", "4096:1"], "--disaggregate 4096:1: P + D is 4,097 replicas, more than the 4,096 allowed"),
    (["--disaggregate", "search", "--replicas", "65", "--slo-ttft", "1s"],
     "--replicas 65: --disaggregate search simulates every P:D split of the replicas over a grid of budgets, so "
     "it takes at most 64 replicas (`stallfree plan` searches larger fleets)"),
], ids=["P:D", "P:D-one-over", "search"])
def test_cli_too_many_disaggregated_replicas(capsys, argv, said):
    """More replicas than a run or a search takes: exit 2 and one line naming the flag and the value, before
    any replica is built (100,000:100,000 ran past 45 s on 30 requests; a search's work grows as N squared,
    65 replicas ran past 20 s on 30 requests)."""
    code = main(["simulate", "--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none",
                 "--no-range", *argv])
    captured = capsys.readouterr()
    assert (code, captured.err, captured.out) == (2, f"stallfree simulate: error: {said}\n", "")


def test_cli_valid_disaggregate_with_replicas(capsys):
    """A valid P:D with --replicas is refused for --replicas, which P:D sets."""
    assert main(["simulate", "--disaggregate", "2:2", "--replicas", "4"]) == 2
    err = capsys.readouterr().err
    assert "--disaggregate P:D sets the replicas" in err and "drop --compare, --replicas" in err


def test_cli_disaggregate(capsys, tmp_path, monkeypatch):
    """`--disaggregate 0:2` exits 2 naming the value; `1:1 --json` gives runs[0] with a replicas list,
    and --records and --out write the per-request records (with each side's replica), each replica's
    steps and the plots (a timeline line per replica; the drawing itself is plot_timeline's and
    _plot_cdf_panels', tested with the single-run --out, so it is stubbed here to keep this fast)."""
    import csv

    from stallfree.sim.outputs import plots

    drawn: dict[str, list[str]] = {}

    def cdf(series, path, context=None):  # type: ignore[no-untyped-def]
        drawn["cdf"] = [label for label, _, _ in series]
        path.write_bytes(b"")

    def timeline(reps, path, context=None, labels=None):  # type: ignore[no-untyped-def]
        drawn["timeline"] = list(labels)
        path.write_bytes(b"")

    monkeypatch.setattr(plots, "plot_cdf_series", cdf)
    monkeypatch.setattr(plots, "plot_replica_timeline", timeline)
    assert main(["simulate", "--disaggregate", "0:2"]) == 2
    assert "--disaggregate wants P:D with P, D >= 1 replicas, or search; got '0:2'" in capsys.readouterr().err
    argv = ["simulate", "--disaggregate", "1:1", "--num-requests", "30", "--json",
            "--records", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    records = json.loads((tmp_path / "r.json").read_text())
    assert len(records) == 30 and {(x["prefill_replica"], x["decode_replica"]) for x in records} == {(0, 0)}
    with open(tmp_path / "out" / "requests-disagg.csv") as fh:
        assert [float(x["ttft_ms"]) for x in csv.DictReader(fh)] == pytest.approx([x["ttft_ms"] for x in records])
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["cdf.png", "requests-disagg.csv", "steps-decode0.csv", "steps-prefill0.csv", "summary.json",
                     "timeline.png"]
    assert drawn == {"cdf": ["disagg 1P:1D"], "timeline": ["prefill#0", "decode#0"]}
    run = out["runs"][0]
    assert run["num_requests"] == 30 and run["completed"] == 30
    assert [x["role"] for x in run["replicas"]] == ["prefill", "decode"]
    assert out["header"]["interconnect"] == "ib-ndr" and run["num_gpus"] == 8
    # --disaggregate search --replicas 2 with grids: 3 aggregated budgets (the default grid) and 1 split
    # x 2 prefill budgets x 1 decode budget = 5 runs, each group best first in goodput per GPU (to
    # 0.001), each labelled with its budgets; a list of budgets for a P:D run is refused.
    from stallfree.sim.studies.disagg_search import DEFAULT_AGGREGATED_BUDGETS

    argv = ["simulate", "--disaggregate", "search", "--replicas", "2", "--num-requests", "10", "--slo-ttft", "1s",
            "--prefill-budget", "512,4096", "--decode-budget", "64", "--json"]
    assert main(argv) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    aggs, rows = runs[:3], runs[3:]
    assert sorted(r["token_budget"] for r in aggs) == sorted(DEFAULT_AGGREGATED_BUDGETS)
    assert sorted((r["prefill_budget"], r["decode_budget"]) for r in rows) == [(512, 64), (4096, 64)]
    assert {r["label"] for r in rows} == {"disagg 1P:1D b512/64", "disagg 1P:1D b4096/64"}
    for group in (aggs, rows):
        per_gpu = [round(r["goodput_per_gpu"], 3) for r in group]
        assert per_gpu == sorted(per_gpu, reverse=True)
    assert all(r["num_gpus"] == 8 and r["completed"] == 10 for r in runs)
    assert main(["simulate", "--disaggregate", "1:1", "--prefill-budget", "512,1024", "--num-requests", "5"]) == 2
    assert "--prefill-budget: one budget for a P:D run, got 512,1024" in capsys.readouterr().err


def test_front_end_added_to_ttft_and_e2e():
    """The hand request above with an engine profile of a 5 ms front end on both sides: TTFT 110 + 5 =
    115 ms and E2E 250.03 + 5 ms, as a single run's report adds it; TPOT and the steps are unchanged."""
    from stallfree.sim.inputs.engine_profile import EngineProfile, ProfiledCostModel
    from stallfree.sim.outputs.disagg_report import disagg_records

    prof = EngineProfile("fe", frontend_s=0.005)
    w = Workload((0.0,), (100,), (4,), "hand")
    r = simulate_disaggregated(w, cfg(), cfg(), ProfiledCostModel(PREFILL, prof), ProfiledCostModel(DECODE, prof),
                               1, 1, 1000, LINK)
    (tl,) = r.timelines
    assert r.frontend_s == 0.005 and tl.token_times == pytest.approx((0.110, 0.226, 0.23801, 0.25003))
    s = disagg_summary(r, 1)
    assert s["mean_ttft_ms"] == pytest.approx(115.0)
    assert s["mean_tpot_ms"] == pytest.approx((250.03 - 110.0) / 3)
    (rec,) = disagg_records(r, w)
    assert rec["ttft_ms"] == pytest.approx(115.0) and rec["e2el_ms"] == pytest.approx(255.03)


def test_disaggregate_search_lines_at_a_light_load_keep_two_significant_digits(capsys):
    """At rate scale 0.0001 every configuration serves 0.000015 req/s/GPU: the comparison lines, the best-of
    line and the verdict write that (wording.rate_text), where three decimals said 0.000 throughout."""
    argv = ["simulate", "--disaggregate", "search", "--replicas", "2", "--num-requests", "10", "--slo-ttft", "1s",
            "--rate-scale", "0.0001"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.lstrip().startswith(("aggregated x2 b", "disagg 1P:1D b"))]
    assert len(rows) == 7 and all(": 0.000015 req/s/GPU (goodput 0.00012 req/s, " in line for line in rows)
    assert any(line.startswith("best aggregated: 0.000015 req/s/GPU (aggregated x2 b2048); best disaggregated: "
                               "0.000015 req/s/GPU") for line in lines)
    verdict = next(line for line in lines if line.startswith("verdict: "))
    assert "0.000015 req/s/GPU against best aggregated x2 b2048 0.000015 (" in verdict
    assert "0.000 " not in verdict.replace("+/-0.000 req/s/GPU", "")
