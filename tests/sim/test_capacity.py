"""stallfree plan: the search's rounds and a hand-worked capacity answer under a linear cost model."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.sim.studies.capacity import attainment_of, disagg_splits, next_counts


def test_next_counts_gallops_then_bisects():
    # Nothing known: N0, N0 + 1, N0 + 3 (gaps doubling), `width` at a time.
    assert next_counts(None, None, 6, set(), 3, 64) == [6, 7, 9]
    assert next_counts(9, None, 6, {6, 7, 9}, 2, 64) == [13, 21]
    assert next_counts(9, None, 6, {6, 7, 9}, 2, 14) == [13, 14]  # capped: max_replicas is the last tried
    assert next_counts(2, None, 1, {1, 2}, 1, 3) == [3]  # 1 + 3 = 4 overshoots the cap of 3: try 3
    # N0 passed: downward, N0 - 1, N0 - 2, N0 - 4, then 1.
    assert next_counts(None, 6, 6, {6}, 4, 64) == [5, 4, 2, 1]
    assert next_counts(None, 1, 1, {1}, 2, 64) == []
    # Both known: evenly spread inside (fail, ok), done when adjacent.
    assert next_counts(9, 13, 6, {6, 7, 9, 13}, 1, 64) == [11]
    assert next_counts(9, 13, 6, {6, 7, 9, 13}, 3, 64) == [10, 11, 12]
    assert next_counts(11, 12, 6, {11, 12}, 3, 64) == []


def test_disagg_splits_and_attainment_over_all_requests():
    assert disagg_splits(1) == []
    assert disagg_splits(3) == [1, 2]  # round(3/6) = 0 -> 1, round(3/4) = 1, round(1) = 1, round(1.5) = 2
    assert disagg_splits(12) == [2, 3, 4, 6]
    # 90% of the 8 completed requests met the SLOs, 2 of 10 were refused: 7.2 of 10.
    assert attainment_of({"slo_attainment": 0.9, "completed": 8, "num_requests": 10}) == pytest.approx(0.72)


def test_plan_finds_four_replicas_on_a_hand_worked_trace(tmp_path, capsys):
    """Twelve one-token requests 0.25 s apart (4 req/s); every step takes 1 s (--linear-cost 1000,0)
    and holds one request (--max-seqs 1), so a replica serves 1 req/s and TTFT is 1 s when a replica
    is free on arrival. Four replicas: each request finds one free (TTFT 1 s, all within 1 s). Three,
    round-robin: replica k gets rids k, k + 3, k + 6, k + 9 arriving 0.75 s apart but served 1 s apart,
    so only each replica's first is within 1 s: 3 of 12 = 25%."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{0.25 * k},10,1\n" for k in range(12)))
    code = main(["plan", "--trace", str(trace), "--linear-cost", "1000,0", "--max-num-seqs", "1", "--slo-ttft", "1s",
                 "--executor", "serial", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["answer"]["replicas"] == 4
    assert report["answer"]["router"] == "least-outstanding"
    assert report["answer"]["row"]["attainment"] == 1.0
    assert report["bound"]["start_replicas"] == 4  # 4 req/s offered / 1 req/s saturated
    rows = {(r["label"]): r for r in report["rows"]}
    assert rows["x3 round-robin"]["attainment"] == pytest.approx(0.25)
    assert all(r["attainment"] < 0.99 for r in report["rows"] if r["replicas"] == 3)
    assert report["disaggregation"]["beats_aggregated"] is False  # the KV move adds to a 1 s TTFT


def test_plan_refuses_bad_flags(capsys):
    assert main(["plan", "--slo-ttft", "1s", "--slo-attainment", "1.5"]) == 2
    assert "--slo-attainment 1.5: must be in (0, 1]" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "plan needs an SLO" in capsys.readouterr().err
    assert main(["plan", "--slo-ttft", "1s", "--routers", "nearest"]) == 2
    assert "--routers 'nearest': choose from" in capsys.readouterr().err


def test_plan_prints_vllm_line_for_a_multi_gpu_replica_and_plain_progress(tmp_path, capsys):
    """The hand-worked trace above at --tp 4: the answer's serve line is vLLM's (tensor parallelism 4,
    the budget as --max-num-batched-tokens), stallfree serve being one device; stderr is not a terminal
    under capsys, so each finished simulation is one plain progress line; --json gains "serve"."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{0.25 * k},10,1\n" for k in range(12)))
    argv = ["plan", "--trace", str(trace), "--linear-cost", "1000,0", "--max-num-seqs", "1", "--slo-ttft", "1s",
            "--executor", "serial", "--tp", "4", "--max-num-batched-tokens", "512"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[-2] == ("each replica: vllm serve MODEL --tensor-parallel-size 4 --quantization fp8 "
                         "--max-num-batched-tokens 512 --max-num-seqs 1  (MODEL: the checkpoint of llama-3.3-70b)")
    assert "stallfree serve runs on one device" in lines[-1]
    progress = captured.err.splitlines()
    simulations = int(lines[-3].split(";")[1].split()[0])
    assert len(progress) == simulations
    assert all(p.startswith(f"plan: simulation {k} done (") for k, p in enumerate(progress, start=1))
    assert main([*argv, "--tp", "1", "--model", "llama-3.1-8b", "--dtype", "bf16", "--json"]) == 0
    serve = json.loads(capsys.readouterr().out)["serve"]
    assert serve == {"vllm": "vllm serve MODEL --tensor-parallel-size 1 --max-num-batched-tokens 512 --max-num-seqs 1",
                     "stallfree": "stallfree serve --max-num-batched-tokens 512 --max-num-seqs 1"}
    # FP8 weights and KV as planned are vLLM's --quantization fp8 and --kv-cache-dtype fp8.
    assert main([*argv, "--tp", "1", "--model", "llama-3.1-8b", "--dtype", "fp8", "--kv-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["serve"]["vllm"] == (
        "vllm serve MODEL --tensor-parallel-size 1 --quantization fp8 --kv-cache-dtype fp8 --max-num-batched-tokens "
        "512 --max-num-seqs 1")


def _prefill_heavy_trace(tmp_path):
    """Twenty requests 1 s apart, each a 1,500-token prompt and 201 output tokens."""
    trace = tmp_path / "prefill_heavy.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{k}.0,1500,201\n" for k in range(20)))
    return trace


def test_split_order_and_bound_by_hand():
    """The bound of the hand-worked trace below: mu_p = 1/1.51 req/s, mu_d = 5 req/s at 1 req/s offered,
    so P >= 2, D >= 1; of 3 replicas only 2:1 is allowed, of 6 the splits nearest the balance first."""
    from stallfree.sim.studies.capacity import SplitBound, split_order

    b = SplitBound(1 / 1.51, 5.0, 1.0)
    assert (b.p_min, b.d_min) == (2, 1)
    assert b.share == pytest.approx(1.51 / (1.51 + 0.2))
    assert split_order(3, b) == [2]
    assert split_order(2, b) == []  # 2 + 1 replicas at least
    assert split_order(6, b) == [5, 4, 3, 2]  # balance at 5.30 prefill replicas of 6
    assert split_order(4, None) == [2, 1, 3]  # no bound: every split, 2:2 first
    assert SplitBound(1.0, 1.0, 2.0).p_min == 2  # an exact multiple needs that multiple


def test_plan_finds_a_prefill_heavy_split_by_hand(tmp_path, capsys):
    """--linear-cost 10,1000: a step costs 10 ms + 1 ms per token; 20 requests 1 s apart, 1,500-token
    prompts, 201 output tokens; SLOs TTFT 2 s, TPOT 15 ms.

    Aggregated, a request's prefill step takes 1.51 s and its 200 decode steps ~11 ms each (2.2 s), so a
    replica is busy ~3.7 s per request. With 3 replicas each replica's next request arrives 3 s after
    the last, while it still decodes: the 1.5 s prefill step lands among its decode steps and its TPOT
    becomes ~(2.2 + 1.5) / 200 = 18.5 ms > 15 ms (all but the last 3 requests miss: 15%); with 4 the
    next arrives at 4 s > 3.7 s, no step mixes them, TPOT ~11 ms: 4 replicas is the aggregated answer.

    Disaggregated, one prefill replica takes 1.51 s per request arriving each second: its queue grows
    (TTFT of request k ~1.51 + 0.51 k s), so the bound asks P >= 2 (mu_p = 1 / 1.51 req/s); two take
    turns, TTFT 1.51 s. One decode replica holds at most 3 requests (each ~2.2-2.6 s, one a second):
    steps of 10 + k <= 13 ms plus the KV move, TPOT < 15 ms. So 2P:1D meets the SLOs on 3 replicas,
    one fewer than aggregated, with more prefill than decode replicas."""
    trace = _prefill_heavy_trace(tmp_path)
    code = main(["plan", "--trace", str(trace), "--linear-cost", "10,1000", "--slo-ttft", "2s", "--slo-tpot", "15ms",
                 "--executor", "serial", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    answer = report["answer"]
    assert (answer["kind"], answer["replicas"], answer["prefill"], answer["decode"]) == ("disaggregated", 3, 2, 1)
    assert (answer["gpu"], answer["tp"], answer["num_gpus"]) == ("h100-sxm", 4, 12)
    assert answer["usd_per_hour"] is None  # no prices: the fewest GPUs
    assert report["serve"]["prefill"]["replicas"] == 2 and report["serve"]["decode"]["replicas"] == 1
    rows = {r["label"]: r for r in report["rows"]}
    assert rows["x3 least-outstanding"]["attainment"] == pytest.approx(0.15)
    assert rows["x4 least-outstanding"]["attainment"] == 1.0
    assert report["disaggregation"]["beats_aggregated"] is True
    best = report["disaggregation"]["best"]
    assert best["label"] == "disagg 2P:1D"
    assert report["runner_ups"][0]["label"] == "x4 least-outstanding"  # the best aggregated, 16 GPUs
    assert (best["prefill"], best["decode"]) == (2, 1)
    assert best["attainment"] == 1.0
    assert best["p99_ttft_ms"] == pytest.approx(1510, abs=1)
    assert 11 < best["p99_tpot_ms"] < 15
    # Only 2:1 is simulated: 1:2 (one prefill replica) and every split of 2 replicas are below the bound.
    assert [r["label"] for r in report["rows"] if r["kind"] == "disaggregated"] == ["disagg 2P:1D"]


def test_mixed_tp_split_walks_to_the_side_that_misses(tmp_path):
    """The prefill-heavy trace above with prefill replicas of 2 GPUs and decode replicas of 4: from 1P:1D
    the one prefill replica's queue grows (TTFT ~1.51 + 0.51 k s, far past 2 s) while TPOT stays ~11 ms,
    so the walk adds a prefill replica; 2P:1D meets the SLOs (as worked out above) on 2 x 2 + 1 x 4 = 8
    GPUs. A cap refusing 8 GPUs stops the walk after 1P:1D with no answer."""
    from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.studies.capacity import walk_mixed_split
    from stallfree.sim.studies.executors import SerialExecutor

    setup = Setup(WorkloadOptions(trace=str(_prefill_heavy_trace(tmp_path))),
                  HardwareOptions(tp=2, linear_cost="10,1000"))
    kw = dict(attainment=0.99, router="least-outstanding", budget=2048, executor=SerialExecutor())
    row, rows = walk_mixed_split(setup, (2.0, 0.015), (2, 4), (1, 1), fits=lambda p, d: True, **kw)
    assert [r["label"] for r in rows] == ["disagg 1P:1D tp 2/4", "disagg 2P:1D tp 2/4"]
    assert rows[0]["p99_ttft_ms"] > 5000 and rows[0]["p99_tpot_ms"] < 15
    assert row is rows[1] and row["num_gpus"] == 8 and row["attainment"] == 1.0
    assert (row["prefill_tp"], row["decode_tp"]) == (2, 4)
    none, tried = walk_mixed_split(setup, (2.0, 0.015), (2, 4), (1, 1), fits=lambda p, d: 2 * p + 4 * d < 8, **kw)
    assert none is None and len(tried) == 1


def test_plan_side_budgets_reach_the_splits_and_their_serve_lines(tmp_path, capsys):
    """--prefill-budget 4096 --decode-budget 256 on the prefill-heavy trace: a 1,500-token prompt is still
    one step and at most 3 decodes run at once, so the answer is still 2P:1D; its rows carry the budgets
    and each side's serve line its own --max-num-batched-tokens."""
    trace = _prefill_heavy_trace(tmp_path)
    assert main(["plan", "--trace", str(trace), "--linear-cost", "10,1000", "--slo-ttft", "2s", "--slo-tpot", "15ms",
                 "--executor", "serial", "--json", "--prefill-budget", "4096", "--decode-budget", "256"]) == 0
    report = json.loads(capsys.readouterr().out)
    row = report["answer"]["row"]
    assert (row["label"], row["prefill_budget"], row["decode_budget"]) == ("disagg 2P:1D", 4096, 256)
    assert "--max-num-batched-tokens 4096 " in report["serve"]["prefill"]["vllm"]
    assert "--max-num-batched-tokens 256 " in report["serve"]["decode"]["vllm"]


def test_a_small_workload_is_judged_against_what_its_mix_sustains(tmp_path, capsys):
    """Two one-token requests, each step 1 s (--linear-cost 1000,0) holding up to 4 (--max-num-seqs 4):
    a saturated replica finishes 4 requests a second. Timing only the two (both done in the first step)
    would say 2 req/s; the burst cycles the mix up to saturated_throughput's sample, which fills every
    step: 5,000 requests in 1,250 steps, 4.0 req/s. Offered: one gap of 1 s, 1 req/s (Workload.mean_rate)."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n1,10,1\n")
    argv = ["simulate", "--trace", str(trace), "--linear-cost", "1000,0", "--max-num-seqs", "4", "--kv-tokens",
            "1000", "--json"]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["capacity_req_s"] == pytest.approx(4.0)
    assert run["load"] == pytest.approx(1.0 / 4.0)


def test_requests_that_can_never_fit_are_no_load(tmp_path, capsys):
    """Of four requests 1 s apart, three can never fit the KV (prompt + output 1,001 > --kv-tokens 100):
    rejected at add(), they add no work, and more replicas would not serve them. The capacity burst cycles
    the four up to 5,000 and serves the 1,250 copies of the first, 4 a step: 1,250 / 313 req/s. The load is
    the servable quarter of the offered 1 req/s (3 gaps over 3 s) against that; no overload warning."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n1,1000,1\n2,1000,1\n3,1000,1\n")
    argv = ["simulate", "--trace", str(trace), "--linear-cost", "1000,0", "--max-num-seqs", "4", "--kv-tokens",
            "100", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    run = json.loads(out)["runs"][0]
    assert run["rejected"] == 3 and run["capacity_req_s"] == pytest.approx(1250 / 313)
    assert run["load"] == pytest.approx(1.0 * 0.25 / (1250 / 313))
    assert run["overload"] is None and "overloaded" not in err


def test_plan_stops_before_searching_when_every_request_is_over_the_context(tmp_path, capsys):
    """Every request longer than --max-model-len: no fleet serves one, so plan says why (the first request's
    reason) and exits 4 before any simulation."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,5\n1,20,5\n")
    argv = ["plan", "--trace", str(trace), "--linear-cost", "10,0", "--max-model-len", "12", "--slo-ttft", "1s",
            "--executor", "serial", "--no-disaggregate"]
    assert main(argv) == 4
    out, err = capsys.readouterr()
    assert out == "" and "simulation" not in err
    assert err.splitlines() == [
        "warning: plan: rejected 2 of 2 requests (2 over the context length (context_length)); first: request 0: "
        "prompt_len 10 + max_new 5 = 15 tokens exceeds the model's context length 12",
        "stallfree plan: error: every request is over the context length (12 tokens, --max-model-len): no fleet "
        "serves one; raise --max-model-len or shorten the requests (exit 4)",
    ]


def test_plan_says_when_requests_are_rejected_whatever_the_fleet(tmp_path, capsys):
    """One request of two never fits a replica's KV (15 + 5 > --kv-tokens 16): every fleet rejects it, none
    meets a 100% attainment (exit 3), and plan says that more replicas do not serve it."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,5,5\n1,15,5\n")
    argv = ["plan", "--trace", str(trace), "--linear-cost", "10,0", "--kv-tokens", "16", "--slo-ttft", "1s",
            "--slo-attainment", "1", "--executor", "serial", "--no-disaggregate", "--max-replicas", "2"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "warning: plan: every fleet rejected at least 1 of 2 requests at admission" in err


def test_plan_refuses_side_budgets_without_disaggregation(capsys):
    """--prefill-budget and --decode-budget set a disaggregated split's sides: with --no-disaggregate nothing
    reads them, so they are refused (exit 2, one line) rather than ignored."""
    for flag in ("--prefill-budget", "--decode-budget"):
        assert main(["plan", "--slo-ttft", "1s", "--no-disaggregate", flag, "4096"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} sets a disaggregated split's side" in err
