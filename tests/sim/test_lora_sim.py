"""LoRA adapters in the simulator: adapter sizes, loads over the host link, traces, records, router and flags."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace

import pytest

from stallfree.cli import main
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.request import Request
from stallfree.costmodel.hardware import get_gpu
from stallfree.costmodel.host_link import HostLink
from stallfree.costmodel.lora import lora_shape
from stallfree.costmodel.model import get_model
from stallfree.sim.inputs.traces import load_trace
from stallfree.sim.inputs.workload import TraceError, Workload
from stallfree.sim.outputs.records import request_records
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.lora import STORAGE_READ_BPS, AdapterCache, LoraCost, assign_loras, parse_popularity
from stallfree.sim.run.routers import AdapterAffinityRouter, make_router
from stallfree.sim.run.simulator import new_result, simulate

SHAPE = lora_shape(get_model("llama-3.3-70b"), get_gpu("h100-sxm"), 4, 16)
LINK = HostLink(64e9, 10e-6)


def test_adapter_size_of_llama_70b_rank_16():
    """Rank 16, all-linear, Llama 3.3 70B: 16 x 161,792 x 80 parameters, 16 x 83,456 x 80 per GPU on TP 4.

    Worked by hand: per layer d_in + d_out over q (8192+8192), k and v (8192+1024 each), o (8192+8192),
    gate and up (8192+28672 each), down (28672+8192) = 161,792; per GPU, column layers keep A whole
    (8192 + d_out/4) and row layers B whole (d_in/4 + 8192): 10,240 + 8,448 x 2 + 10,240 + 15,360 x 3 = 83,456.
    """
    assert SHAPE.params_total == 16 * 161_792 * 80 == 207_093_760
    assert SHAPE.params_per_gpu == 16 * 83_456 * 80
    assert SHAPE.bytes_total == 414_187_520 and SHAPE.bytes_per_gpu == 213_647_360
    assert SHAPE.modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_gemm_time_is_the_roofline_of_flops_and_adapter_bytes():
    """One decode token: memory-bound (adapter bytes / bandwidth); 100,000 tokens: compute-bound."""
    gpu = get_gpu("h100-sxm")
    assert SHAPE.gemm_time(0, 0) == 0.0
    assert SHAPE.gemm_time(1, 2) == pytest.approx(2 * 213_647_360 / gpu.mem_bw_bytes_per_s)
    assert SHAPE.gemm_time(100_000, 1) == pytest.approx(2 * 106_823_680 * 100_000 / gpu.bf16_flops_per_s)


def _plan(step, decodes=(), prefills=()):
    return StepPlan(step, tuple(decodes), tuple(0 for _ in decodes), tuple(prefills),
                    len(decodes) + sum(c.num_tokens for c in prefills), 0, 100)


def _bound(names, gpu_slots=2, cpu_slots=3):
    wl = Workload(tuple(0.0 for _ in names), tuple(4 for _ in names), tuple(2 for _ in names), loras=tuple(names))
    res = new_result("t", wl, {}, [2] * len(names), [2] * len(names), None)
    cost = LoraCost(LinearCostModel(0.01, 0.0), SHAPE, LINK, gpu_slots, cpu_slots)
    return cost, cost.bind_replica(res), res


def test_a_cold_adapter_loads_from_storage_then_from_host_memory():
    """First use: storage read + host copy; after eviction from the GPU but not from host memory: the copy alone;
    in a GPU slot: nothing. Each step also pays its LoRA GEMMs."""
    cost, bound, res = _bound(["A", "B", "C", "A"])
    copy = 10e-6 + 213_647_360 / 64e9
    from_disk = copy + 414_187_520 / STORAGE_READ_BPS
    assert cost.load_time(True) == pytest.approx(from_disk) and cost.load_time(False) == pytest.approx(copy)
    t0 = bound.step_time(_plan(0, prefills=[ScheduledChunk(0, 4, True, 0, True)]))
    assert t0 == pytest.approx(0.01 + from_disk + SHAPE.gemm_time(4, 1))
    assert res.lora_load_s[0] == pytest.approx(from_disk)
    bound.step_time(_plan(1, prefills=[ScheduledChunk(1, 4, True, 0, True)]))  # B: GPU holds A, B
    bound.step_time(_plan(2, prefills=[ScheduledChunk(2, 4, True, 0, True)]))  # C evicts A from the GPU
    t3 = bound.step_time(_plan(3, prefills=[ScheduledChunk(3, 4, True, 0, True)]))  # A: back from host memory
    assert t3 == pytest.approx(0.01 + copy + SHAPE.gemm_time(4, 1))
    assert (res.lora_loads, res.lora_storage_loads) == (4, 3)
    t4 = bound.step_time(_plan(4, decodes=[3, 2]))  # both resident: no load
    assert t4 == pytest.approx(0.01 + SHAPE.gemm_time(2, 2))


def test_the_cache_never_evicts_an_adapter_of_the_step():
    """With every GPU slot held by the step's adapters, the least recently used outside the step goes."""
    cache = AdapterCache(2, 2)
    assert cache.bring({"A", "B"}) == [("A", True), ("B", True)]
    assert cache.bring({"B", "C"}) == [("C", True)]
    assert list(cache.gpu) == ["B", "C"] and list(cache.cpu) == ["B", "C"]


def test_max_cpu_loras_below_max_loras_is_refused():
    """max_cpu_loras < max_loras is refused, naming both."""
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoraCost(LinearCostModel(0.01, 0.0), SHAPE, LINK, 4, 2)


def test_zipf_popularity_draws_the_stated_shares():
    """zipf:1 over 32 adapters: lora-0 has 1/H_32 = 24.6% of the requests (20,000 drawn, within 1.5 points);
    arrivals and lengths are those of the workload, and the same seed draws the same names."""
    n = 20_000
    wl = Workload(tuple(float(i) for i in range(n)), (5,) * n, (3,) * n)
    got = assign_loras(wl, 32, 1.0, seed=3)
    share = got.loras.count("lora-0") / n
    assert share == pytest.approx(1 / sum(1 / k for k in range(1, 33)), abs=0.015)
    assert got.arrivals == wl.arrivals and got.prompt_lens == wl.prompt_lens
    assert got.loras == assign_loras(wl, 32, 1.0, seed=3).loras
    assert set(assign_loras(wl, 3, 0.0).loras) == {"lora-0", "lora-1", "lora-2"}


@pytest.mark.parametrize("text", ["zipf", "zipf:x", "zipf:-1", "uniform:1", "zipf:nan"])
def test_bad_popularity_is_refused(text):
    """A popularity other than zipf:S (0 <= S <= 10) is refused, quoting it."""
    with pytest.raises(ValueError, match="zipf:S"):
        parse_popularity(text)


def test_trace_lora_column_and_field(tmp_path):
    """A CSV lora column (empty: the base model) and a JSONL lora field are read and kept with their rows
    when the rows are sorted by arrival; a non-string lora is a malformed row."""
    p = tmp_path / "t.csv"
    p.write_text("arrival_time,prompt_len,output_len,lora\n2,10,5,sql\n1,20,5,\n3,30,5,chat\n")
    wl = load_trace(p)
    assert wl.prompt_lens == (20, 10, 30) and wl.loras == (None, "sql", "chat")
    assert load_trace(p).head(2).loras == (None, "sql")
    q = tmp_path / "t.jsonl"
    q.write_text('{"arrival_time": 0, "prompt_len": 5, "output_len": 2, "lora": "a"}\n'
                 '{"arrival_time": 1, "prompt_len": 5, "output_len": 2}\n')
    assert load_trace(q).loras == ("a", None)
    q.write_text('{"arrival_time": 0, "prompt_len": 5, "output_len": 2, "lora": 7}\n')
    with pytest.raises(TraceError, match="lora must be a string"):
        load_trace(q)
    r = tmp_path / "plain.csv"
    r.write_text("arrival_time,prompt_len,output_len\n0,5,2\n")
    assert load_trace(r).loras is None


def _lora_run(check=True, max_loras=2):
    wl = assign_loras(Workload(tuple(i * 0.01 for i in range(120)), (40,) * 120, (8,) * 120), 8, 1.0, seed=1)
    cfg = ReplicaConfig.of(20_000, 64, 16, max_loras=max_loras, max_lora_passes=4)
    cost = LoraCost(LinearCostModel(0.005, 1e-5), SHAPE, LINK, max_loras, 4)
    return wl, simulate(wl, cfg, cost, check=check)


def test_simulated_run_keeps_the_limit_and_records_loads():
    """A checked run (every plan at most max_loras adapters) finishes every request; each cold start's
    lora_load_s is one or more loads (copy >= 3.3 ms), warm starts have 0; loads add up to the count."""
    wl, res = _lora_run()
    assert all(f >= 0 for f in res.finish_step)
    loads = [x for x in res.lora_load_s if x > 0]
    copy = 10e-6 + 213_647_360 / 64e9
    assert loads and min(loads) >= copy - 1e-12
    assert res.lora_loads >= len(set(wl.loras)) and res.lora_storage_loads <= res.lora_loads
    rows = request_records(res)
    assert list(rows[0])[-2:] == ["lora", "lora_load_s"]
    assert [r["lora"] for r in rows] == list(wl.loras)


def test_records_have_no_lora_columns_without_adapters():
    """A run without adapters writes the records it wrote before LoRA existed."""
    wl = Workload((0.0, 0.1), (10, 10), (3, 3))
    res = simulate(wl, ReplicaConfig.of(1000, 64, 4), LinearCostModel(0.01, 0.0))
    assert "lora" not in request_records(res)[0] and res.lora is None


@dataclass
class _Rep:
    num_outstanding: int


def test_adapter_affinity_router_keeps_an_adapter_on_its_replica():
    """A's second request joins the replica A went to; B goes to the least loaded; a replica over the
    load cap loses its adapter's request to the least loaded, which then holds A too."""
    router = AdapterAffinityRouter(slots=2, load_factor=1.5, load_margin=1)
    reps = [_Rep(0), _Rep(0), _Rep(0)]
    a = Request(rid=0, prompt_len=4, max_new=2, lora="A")
    assert router.route(a, reps) == 0
    reps[0].num_outstanding = 1
    assert router.route(replace(a, rid=1), reps) == 0
    reps[0].num_outstanding = 2
    assert router.route(Request(rid=2, prompt_len=4, max_new=2, lora="B"), reps) == 1
    reps[1].num_outstanding = 1
    assert router.route(Request(rid=3, prompt_len=4, max_new=2), reps) == 2  # base model: least loaded
    reps[0].num_outstanding = 5  # cap: max(1.5 x 0, 0 + 1) = 1
    assert router.route(replace(a, rid=4), reps) == 2
    assert "A" in router.held[2] and "A" in router.held[0]
    assert isinstance(make_router("adapter-affinity", adapter_slots=4), AdapterAffinityRouter)


@pytest.mark.parametrize("argv", [
    ["--lora-popularity", "zipf:1"],
    ["--loras", "4", "--lora-popularity", "pareto:1", "--max-loras", "2"],
    ["--loras", "4", "--max-loras", "4", "--max-cpu-loras", "2"],
    ["--max-cpu-loras", "8"],
    ["--max-loras", "2"],
    ["--loras", "4", "--max-loras", "0"],
    ["--loras", "4", "--max-loras", "2", "--compare"],
    ["--loras", "4", "--max-loras", "2", "--max-lora-passes", "-1"],
    ["--loras", "4", "--max-loras", "2", "--synthetic", "sessions"],
], ids=["popularity-alone", "bad-popularity", "cpu-below-gpu", "cpu-alone", "no-adapters", "zero", "compare",
        "negative-passes", "sessions"])
def test_lora_flag_errors_exit_2(argv, capsys):
    """Each LoRA flag out of range or without what it applies to is an input error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["simulate", "--synthetic", "poisson", "--num-requests", "5", "--kernels", "none",
                               *argv]))
    assert info.value.code == 2


def test_simulate_json_reports_lora_figures(capsys, tmp_path):
    """simulate --json: the header's lora record, the run's lora_loads and cold/warm TTFT; --records gets the
    lora and lora_load_s columns."""
    rec = tmp_path / "r.csv"
    argv = ["simulate", "--synthetic", "poisson", "--rate", "2", "--num-requests", "60", "--kernels", "none",
            "--loras", "8", "--max-loras", "2", "--json", "--records", str(rec)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["lora"]["max_loras"] == 2 and out["header"]["lora"]["lora_rank"] == 16
    lora = out["runs"][0]["lora"]
    assert lora["lora_loads"] >= 1 and lora["cold_requests"] + lora["warm_requests"] == 60
    assert out["header"]["scheduler_config"]["max_loras"] == 2
    with rec.open() as fh:
        header = next(csv.reader(fh))
    assert header[-2:] == ["lora", "lora_load_s"]


@pytest.mark.parametrize(("names", "hits"), [(("A", "A"), True), (("A", "B"), False), (("A", None), False)],
                         ids=["same", "other-adapter", "base"])
def test_cached_kv_is_shared_only_on_the_same_adapter(names, hits):
    """Two requests with the same 512-token prompt prefix, the second after the first ended: its prefix hits
    the cache only when both run on the same adapter (KV under an adapter is that adapter's)."""
    wl = Workload((0.0, 10.0), (512, 512), (2, 2), prefix_ids=((7,), (7,)), loras=names)
    cfg = ReplicaConfig.of(100_000, 2048, 16, kv_policy="paged", block_size=16, enable_prefix_caching=True,
                           max_loras=2)
    cost = LoraCost(LinearCostModel(0.01, 0.0), SHAPE, LINK, 2, 2)
    res = simulate(wl, cfg, cost, check=True)
    assert (res.prefix_cache_hit_rate > 0) is hits


def test_sweep_with_adapters_runs_chunked_batching_only(capsys):
    """sweep --max-loras sweeps chunked batching (the baselines have no adapter limit); asking for a baseline
    with it is an input error (exit 2)."""
    base = ["sweep", "--synthetic", "poisson", "--rate", "2", "--num-requests", "30", "--kernels", "none",
            "--loras", "4", "--max-loras", "2", "--budgets", "512", "--jobs", "1", "--json"]
    assert main(base) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["batching"] for r in rows["rows"]} == {"chunked"}
    assert main([*base, "--batching", "chunked,no-chunk"]) == 2


def test_a_scaled_replay_keeps_the_adapter_loads():
    """The range's replays (ScaledCost around LoraCost) bind each replica's adapter cache and scale the whole
    step, loads included: a cold step under factor 1.231 takes 1.231 x the unscaled cold step."""
    from stallfree.sim.studies.ranges import ScaledCost

    cost, bound, _ = _bound(["A"])
    _, _, res = _bound(["A"])
    scaled = ScaledCost(cost, 1.231).bind_replica(res)
    plan = _plan(0, prefills=[ScheduledChunk(0, 4, True, 0, True)])
    assert scaled.step_time(plan) == pytest.approx(1.231 * bound.step_time(plan))
    assert res.lora_loads == 1
