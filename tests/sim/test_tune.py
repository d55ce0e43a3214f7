"""SLO-driven tuning (stallfree.sim.studies.tune): the cost-model bound, the ladder, the ranking and the search.

The end-to-end scenario ("pairs"), worked out by hand. Linear cost: a step takes 10 ms + 0.05 ms per
token. Every second, D arrives (prompt 10, output 11) and 5 ms later Q (prompt 2,000, output 1).
Step 0 prefills D alone (10.5 ms); D then decodes in steps 1-10 while Q's chunks of B - 1 tokens
share them; Q's rest R = 2000 - 10(B - 1) runs alone in chunks of B afterwards.

- D's TPOT is the mean of its 10 decode steps: 10.05 + 0.005 x min(2000, 10(B - 1)) ms.
  Under 16.52 ms exactly when B <= 130 (B = 130: 16.50 ms; 131: 16.55 ms).
- Q's TTFT (for B < 201) is 5.5 (wait) + 10 x (10 + 0.05 B) + 10 x ceil(R / B) + 0.05 R ms.
  B = 84: R = 1170, 14 more steps: 346 ms; B = 83: R = 1180, 15 steps: 356 ms. Under 350 ms
  exactly when B >= 84 (it only falls as B grows).

So with SLOs TTFT <= 350 ms and TPOT <= 16.52 ms, both requests of a pair are good for 84 <= B <= 130,
and one of the two otherwise. Among the good budgets, goodput = 10 / (4.005 s + Q's last TTFT) (the
last request to finish is the last Q), which grows with B: the answer is B = 130. The cost model's
bound is the same 130: one expected decode, (16.52 - 10) / 0.05 = 130.4 tokens.
"""

from __future__ import annotations

import json
import math

import pytest

from stallfree.cli import main
from stallfree.sim import LinearCostModel, Workload
from stallfree.sim.studies.tune import partial_prefill_candidates, rank, tune
from stallfree.sim.studies.tune_bound import (
    BudgetBound,
    TargetBelowFloor,
    _mean_chunk_start,
    budget_bound,
    candidate_budgets,
    expected_load,
)
from stallfree.sim.studies.tune_report import serve_command

COST = LinearCostModel(base_s=0.010, per_token_s=0.00005)
SLO_TTFT, SLO_TPOT = 0.350, 0.01652
KV = 100_000


def pairs(periods: int = 5) -> Workload:
    """The module docstring's workload: D (10 -> 11 tokens) at k s, Q (2,000 -> 1) at k + 0.005 s."""
    arr, prompts, outs = [], [], []
    for k in range(periods):
        arr += [float(k), k + 0.005]
        prompts += [10, 2000]
        outs += [11, 1]
    return Workload(tuple(arr), tuple(prompts), tuple(outs), "pairs")


def test_expected_load_little_law():
    """10 req/s, 20 decode steps each, 50 ms TPOT: 10 decodes, each at 100 + 19/2 = 109.5 -> 110 tokens."""
    wl = Workload(tuple(i / 10 for i in range(10)), (100,) * 10, (21,) * 10)
    assert expected_load(wl, 0.050, max_seqs=256, kv_tokens=10**6) == (10, 110)


def test_expected_load_caps():
    """The decodes are capped by max_seqs and by the reservations that fit in KV (1000 / 121 -> 8)."""
    wl = Workload(tuple(i / 10 for i in range(10)), (100,) * 10, (21,) * 10)
    assert expected_load(wl, 0.050, max_seqs=4, kv_tokens=10**6)[0] == 4
    assert expected_load(wl, 0.050, max_seqs=256, kv_tokens=1000)[0] == 8


def test_expected_load_max_tokens_cuts_outputs():
    """With max_tokens 11 the requests decode 10 steps: 5 decodes at 100 + 9/2 = 104.5 -> 104 (half to even)."""
    wl = Workload(tuple(i / 10 for i in range(10)), (100,) * 10, (21,) * 10)
    assert expected_load(wl, 0.050, max_seqs=256, kv_tokens=10**6, max_tokens=11) == (5, 104)


def test_mean_chunk_start_by_hand():
    """A 10-token prompt in chunks of 4 starts them at 0, 4, 8 for 4, 4, 2 tokens: 32 / 10 -> 3."""
    assert _mean_chunk_start([10], 4) == 3
    assert _mean_chunk_start([3], 4) == 0


def test_budget_bound_pairs():
    """The pairs workload: one expected decode at 14 tokens, bound 130 tokens, a 16.5 ms full step."""
    b = budget_bound(COST, pairs(), SLO_TPOT, max_seqs=8, kv_tokens=KV)
    assert isinstance(b, BudgetBound)
    assert (b.token_budget, b.num_decodes, b.decode_context) == (130, 1, 14)
    assert b.step_s == pytest.approx(0.0165)
    assert b.decode_floor_s == pytest.approx(0.01005)
    # Q's 2,000 tokens in chunks of 129: 15 full chunks and 65 tokens at 1,935;
    # (129^2 x 15 x 14 / 2 + 65 x 15 x 129) x 5 / (2,010 x 5) = 931.9.
    assert b.chunk_start == 932


def test_target_below_floor_is_refused():
    """A 9 ms TPOT target is under the 10.05 ms decode-only step: refused with the floor named."""
    with pytest.raises(TargetBelowFloor, match=r"below the decode-only step time, 10\.\d ms") as info:
        budget_bound(COST, pairs(), 0.009, max_seqs=8, kv_tokens=KV)
    assert info.value.floor_s == pytest.approx(0.01005)


def test_candidate_ladder_by_hand():
    """The ladder of 1000: 1000 x 2^(k/2), k = -6..2, rounded to 16 tokens from 128 up."""
    assert candidate_budgets(1000) == [125, 176, 256, 352, 496, 704, 1000, 1408, 2000]
    assert candidate_budgets(130) == [16, 23, 32, 46, 65, 92, 130, 176, 256]


def _row(budget, goodput, tpot, max_seqs=256):
    return {"token_budget": budget, "max_seqs": max_seqs, "request_goodput": goodput, "p99_tpot_ms": tpot}


def test_rank_goodput_then_tpot_then_larger_budget():
    """Highest goodput wins; ties go to the lower p99 TPOT, then the larger budget, then the base max_seqs."""
    rows = [_row(512, 10.0, 20.0), _row(1024, 12.0, 40.0), _row(2048, 11.0, 60.0)]
    assert [r["token_budget"] for r in rank(rows, 0.0)] == [1024, 2048, 512]
    tied = [_row(512, 10.0, 20.0), _row(1024, 10.0, 30.0), _row(768, 10.0, 20.0)]
    assert [r["token_budget"] for r in rank(tied, 0.0)] == [768, 512, 1024]
    seqs = [_row(512, 10.0, 20.0, 128), _row(512, 10.0, 20.0, 512), _row(512, 10.0, 20.0, 256)]
    assert [r["max_seqs"] for r in rank(seqs, 0.0, base_max_seqs=256)] == [256, 512, 128]


def test_rank_tolerance():
    """Goodputs within the tolerance of the best are ties, decided by p99 TPOT."""
    rows = [_row(2048, 10.0, 45.0), _row(1024, 9.95, 25.0), _row(512, 9.0, 10.0)]
    assert rank(rows, 0.0)[0]["token_budget"] == 2048
    assert rank(rows, 0.01)[0]["token_budget"] == 1024
    with pytest.raises(ValueError, match="tie_tolerance"):
        rank(rows, 1.5)


def _by_budget(result, max_seqs=8):
    return {r["token_budget"]: r for r in result.rows if r["max_seqs"] == max_seqs}


def test_tune_finds_the_hand_optimum():
    """From the bound (130) the search simulates the ladder, refines, and picks B = 130 (module docstring)."""
    result = tune(pairs(), KV, COST, SLO_TTFT, SLO_TPOT, max_seqs=8, max_seqs_candidates=[1])
    assert result.bound is not None and result.bound.token_budget == 130
    best = result.best
    assert (best["token_budget"], best["max_seqs"]) == (130, 8)
    assert best["slo_attainment"] == 1.0
    rows = _by_budget(result)
    # ladder [16, 23, 32, 46, 65, 92, 130, 176, 256], then midpoints 109 and 144, then max_seqs 1
    assert sorted(rows) == [16, 23, 32, 46, 65, 92, 109, 130, 144, 176, 256]
    assert result.stages == [9, 3]
    for b, row in rows.items():
        good = 84 <= b <= 130
        if b >= 23:  # at 16 tokens Q's prefills pile up across periods
            assert row["slo_attainment"] == (1.0 if good else 0.5), b
    # max_seqs 1 keeps Q waiting behind D: its TTFT misses, half the requests are good.
    assert _by_budget(result, 1)[130]["slo_attainment"] == 0.5
    assert [r["request_goodput"] for r in result.rows] == sorted(
        (r["request_goodput"] for r in result.rows), reverse=True
    )


def test_tune_explicit_budgets_in_parallel():
    """Given budgets, every (budget, max_seqs) pair runs (here in 2 processes); the good ones are 84-130."""
    budgets = [64, 83, 84, 100, 130, 131, 200]
    result = tune(pairs(), KV, COST, SLO_TTFT, SLO_TPOT, max_seqs=8, max_seqs_candidates=[2], budgets=budgets, jobs=2)
    assert result.bound is None
    assert len(result.rows) == 14
    rows = _by_budget(result)
    assert {b for b, r in rows.items() if r["slo_attainment"] == 1.0} == {84, 100, 130}
    # max_seqs 2 holds a whole pair: identical results, so the base max_seqs is kept.
    assert (result.best["token_budget"], result.best["max_seqs"]) == (130, 8)
    assert _by_budget(result, 2)[130]["request_goodput"] == result.best["request_goodput"]


def test_goodput_is_not_the_arrival_rate():
    """Outside 84-130 goodput is about half of what the best budget reaches."""
    result = tune(pairs(), KV, COST, SLO_TTFT, SLO_TPOT, max_seqs=8, max_seqs_candidates=[], budgets=[65, 130, 176])
    rows = _by_budget(result)
    assert rows[65]["request_goodput"] < 0.55 * rows[130]["request_goodput"]
    assert rows[176]["request_goodput"] < 0.55 * rows[130]["request_goodput"]
    assert rows[130]["request_goodput"] == pytest.approx(10 / (4.005 + 0.266), rel=1e-9)


def test_tune_rejects_bad_slos():
    """An SLO <= 0 is refused with its name."""
    with pytest.raises(ValueError, match="slo_ttft"):
        tune(pairs(), KV, COST, 0.0, SLO_TPOT)


def _write_pairs(path):
    wl = pairs()
    lines = ["arrival_time,prompt_len,output_len"]
    lines += [f"{a},{p},{o}" for a, p, o in zip(wl.arrivals, wl.prompt_lens, wl.output_lens, strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tune_cli_prints_choice_and_serve_line(tmp_path, capsys):
    """`stallfree tune` prints the bound, the chosen budget and the serve flags; --out writes a plot."""
    trace = _write_pairs(tmp_path / "pairs.csv")
    args = ["tune", "--trace", str(trace), "--linear-cost", "10,50", "--kv-tokens", str(KV), "--max-num-seqs", "8"]
    args += ["--slo-ttft", "350ms", "--slo-tpot", "16.52ms", "--jobs", "1", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cost-model bound: token budget 130" in out
    assert "chosen: token budget 130, max_seqs 8" in out
    # The simulated replica is the default 4 x H100 SXM in FP8: vLLM's line, as plan prints it; not
    # `stallfree serve`, whose engine runs on one device.
    assert ("\nserve it: vllm serve MODEL --tensor-parallel-size 4 --quantization fp8 --max-num-batched-tokens 130 "
            "--max-num-seqs 8  (MODEL: the checkpoint of llama-3.3-70b)\n"
            "  (stallfree serve runs on one device: a replica of 4 GPUs needs a tensor-parallel engine such as "
            "vLLM)\n") in out
    assert "stallfree serve --max-num-batched-tokens" not in out
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert report["chosen"]["token_budget"] == 130 and report["bound"]["token_budget"] == 130
    assert (tmp_path / "out" / "tune.png").stat().st_size > 10_000
    # tune.json and --json carry the printed vLLM line beside `serve` (kept as it was).
    vllm = ("vllm serve MODEL --tensor-parallel-size 4 --quantization fp8 --max-num-batched-tokens 130 "
            "--max-num-seqs 8")
    assert report["vllm_serve"] == vllm
    assert report["serve"] == "stallfree serve --max-num-batched-tokens 130 --max-num-seqs 8"
    assert main([*args[:-2], "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["vllm_serve"], printed["serve"]) == (vllm, report["serve"])


def test_tune_cli_target_below_floor(capsys):
    """A TPOT target under the decode-only step time is one line naming the floor, exit status 2."""
    code = main(["tune", "--num-requests", "200", "--slo-ttft", "2s", "--slo-tpot", "5ms"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "below the decode-only step time" in err[0] and "ms" in err[0]


def test_tune_cli_needs_both_slos(capsys):
    """tune without --slo-ttft is a usage error (exit 2, one line)."""
    assert main(["tune", "--slo-tpot", "50ms"]) == 2
    assert "--slo-ttft" in capsys.readouterr().err


def test_bound_matches_cost_model_inverse():
    """The bound is the largest budget whose full step at the expected load is within the target."""
    from stallfree.costmodel import CostModel
    from stallfree.sim import load_bundled

    cm = CostModel.from_names(model="llama-3.3-70b", gpu="h100-sxm", tp=4, dtype="fp8")
    wl = load_bundled().head(3000).scale_rate(3.0)
    b = budget_bound(cm, wl, 0.050, max_seqs=256, kv_tokens=cm.kv_capacity_tokens())
    assert b.step_s <= 0.050
    over = cm.prefill_step_time(b.token_budget + 1 - b.num_decodes, b.chunk_start, b.num_decodes, b.decode_context)
    assert over > 0.050
    assert not math.isnan(b.decode_floor_s) and b.decode_floor_s < 0.050


def _long_then_short() -> Workload:
    """Q (800 -> 1 tokens) at 0 s, then three short prompts S (5 -> 1) at 1 ms."""
    return Workload((0.0, 0.001, 0.001, 0.001), (800, 5, 5, 5), (1, 1, 1, 1), "long-then-short")


def test_partial_prefill_candidates_by_hand():
    """T = budget // 8 and budget // 4 (at least 1); duplicates dropped; a budget < 1 is refused."""
    assert partial_prefill_candidates(80) == [(2, 2, 10), (4, 4, 10), (4, 1, 10), (4, 4, 20)]
    assert partial_prefill_candidates(4) == [(2, 2, 1), (4, 4, 1), (4, 1, 1)]
    with pytest.raises(ValueError, match="token_budget"):
        partial_prefill_candidates(0)


def test_tune_searches_partial_prefills_when_asked():
    """Budget 80, 10 ms + 0.05 ms/token, TTFT SLO 145 ms. Contract: Q's 10 chunks of 80 end at 140 ms
    (good), the S's wait and finish at 150.75 ms (149.75 ms TTFT: bad). With (2, 2, 10): step 0 gives
    Q 10 + 70 left over; step 1 Q 10, the S's 5 each (TTFT 27 ms: good), Q the 55 left; Q's last 15
    tokens end at 10 x 14 + 10.75 = 150.75 ms (bad). Goodput 1 vs 3 requests over 150.75 ms; every
    candidate ties at 3 and the smallest (K, L, T) is chosen, with its serve flags."""
    result = tune(_long_then_short(), KV, COST, 0.145, 0.05, max_seqs=8, max_seqs_candidates=[], budgets=[80],
                  search_partial_prefills=True)
    assert result.stages == [1, 4]
    by_pp = {r["partial_prefills"]: r for r in result.rows}
    assert set(by_pp) == {None, (2, 2, 10), (4, 4, 10), (4, 1, 10), (4, 4, 20)}
    assert by_pp[None]["request_goodput"] == pytest.approx(1 / 0.15075, rel=1e-9)
    for pp in [p for p in by_pp if p]:
        assert by_pp[pp]["request_goodput"] == pytest.approx(3 / 0.15075, rel=1e-9), pp
    assert result.best["partial_prefills"] == (2, 2, 10)
    assert serve_command(result.best) == ("stallfree serve --max-num-batched-tokens 80 --max-num-seqs 8 "
                                          "--max-num-partial-prefills 2 --max-long-partial-prefills 2 "
                                          "--long-prefill-token-threshold 10")
    # Off by default: one row, no partial prefills.
    plain = tune(_long_then_short(), KV, COST, 0.145, 0.05, max_seqs=8, max_seqs_candidates=[], budgets=[80])
    assert [r["partial_prefills"] for r in plain.rows] == [None]


def test_tune_cli_search_partial_prefills(tmp_path, capsys):
    """`tune --search-partial-prefills` prints a K/L/T column and the chosen setting's serve flags."""
    trace = tmp_path / "ls.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,800,1\n0.001,5,1\n0.001,5,1\n0.001,5,1\n")
    args = ["tune", "--trace", str(trace), "--linear-cost", "10,50", "--kv-tokens", str(KV), "--max-num-seqs", "8",
            "--max-seqs-candidates", "8", "--budgets", "80", "--slo-ttft", "145ms", "--slo-tpot", "50ms",
            "--jobs", "1", "--search-partial-prefills", "--slo-attainment", "0.75"]  # the 800-token prompt misses
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "K/L/T" in out and "2/2/10" in out
    assert ("serve it: vllm serve MODEL --tensor-parallel-size 4 --quantization fp8 --max-num-batched-tokens 80 "
            "--max-num-seqs 8 --max-num-partial-prefills 2 --max-long-partial-prefills 2 "
            "--long-prefill-token-threshold 10  (MODEL: the checkpoint of llama-3.3-70b)") in out


def test_tune_cli_serve_line_of_a_one_gpu_replica(tmp_path, capsys):
    """A one-GPU replica named by its Hugging Face id gets vLLM's line with that id and bf16 (no
    --quantization), and `stallfree serve`'s as the alternative, as plan words them."""
    trace = _write_pairs(tmp_path / "pairs.csv")
    args = ["tune", "--trace", str(trace), "--linear-cost", "10,50", "--kv-tokens", str(KV), "--max-num-seqs", "8",
            "--slo-ttft", "350ms", "--slo-tpot", "16.52ms", "--jobs", "1", "--model", "meta-llama/Llama-3.1-8B",
            "--tp", "1", "--dtype", "bf16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("\nserve it: vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size 1 --max-num-batched-tokens 130 "
            "--max-num-seqs 8\n  or, on stallfree's engine: stallfree serve --max-num-batched-tokens 130 "
            "--max-num-seqs 8\n") in out


def test_tune_cli_honours_fixed_partial_prefill_flags(tmp_path, capsys):
    """--max-num-partial-prefills 2 --long-prefill-token-threshold 10 without the search: every run uses
    them (the long-then-short workload then serves all 3 in the SLOs, as test_tune_searches_partial_prefills
    works out) and the serve line carries them; L > K is a one-line usage error before anything runs."""
    trace = tmp_path / "ls.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,800,1\n0.001,5,1\n0.001,5,1\n0.001,5,1\n")
    args = ["tune", "--trace", str(trace), "--linear-cost", "10,50", "--kv-tokens", str(KV), "--max-num-seqs", "8",
            "--max-seqs-candidates", "8", "--budgets", "80", "--slo-ttft", "145ms", "--slo-tpot", "50ms",
            "--jobs", "1", "--json", "--slo-attainment", "0.75"]  # 3 of the 4 requests: the 800-token prompt misses
    assert main([*args, "--max-num-partial-prefills", "2", "--max-long-partial-prefills", "2",
                 "--long-prefill-token-threshold", "10"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["partial_prefills"] == [2, 2, 10] and chosen["request_goodput"] == pytest.approx(3 / 0.15075)
    out = tmp_path / "out"
    assert main([*args, "--max-long-partial-prefills", "9", "--max-num-partial-prefills", "2",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-long-partial-prefills 9 must be <= --max-num-partial-prefills 2" in err
    assert not out.exists()
    assert main([*args, "--long-prefill-token-threshold", "10"]) == 2
    assert "--long-prefill-token-threshold" in capsys.readouterr().err


def test_tune_exits_3_when_the_best_misses_the_attainment_target(tmp_path, capsys):
    """Twelve one-token requests 0.25 s apart; every step takes 1 s (--linear-cost 1000,0) and holds them
    all, so a step starts each second: a request arriving at a step's start has TTFT 1 s, one 0.25, 0.5 or
    0.75 s after it waits 0.75, 0.5 or 0.25 s for the next step, TTFT 1.75, 1.5 or 1.25 s. Within 1.5 s:
    all but the 3 arriving 0.25 s after a start, 75%; below the default target 0.99 by 24 points: exit 3,
    the last line says so; with --slo-attainment 0.75 the same run exits 0."""
    from stallfree.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{0.25 * k},10,1\n" for k in range(12)))
    argv = ["tune", "--trace", str(trace), "--linear-cost", "1000,0", "--slo-ttft", "1.5s", "--slo-tpot", "50ms",
            "--budgets", "64,128", "--executor", "serial"]
    assert main(argv) == 3
    lines = capsys.readouterr().out.splitlines()
    last = lines[-1]
    # The serve line is the best found, not one that meets the SLOs.
    assert [line for line in lines if "vllm serve" in line] == [
        "best found, not one that meets the SLO target (--slo-attainment 0.99): vllm serve MODEL "
        "--tensor-parallel-size 4 --quantization fp8 --max-num-batched-tokens 128 --max-num-seqs 256  "
        "(MODEL: the checkpoint of llama-3.3-70b)"]
    assert last.startswith("stallfree tune: the best candidate misses the SLO target: 75.00% of requests")
    assert "24.00 points below --slo-attainment 0.99 (exit 3)" in last
    assert "try `stallfree plan`" in last
    assert main([*argv, "--slo-attainment", "0.75", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attainment"] == pytest.approx(0.75)
    assert report["attainment_met"] is True and report["slo_attainment_target"] == 0.75
    assert main([*argv, "--json"]) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["attainment_met"] is False
    assert "misses the SLO target" in captured.err
    assert main([*argv, "--slo-attainment", "0"]) == 2
    assert "--slo-attainment 0: must be in (0, 1]" in capsys.readouterr().err


def test_tune_counts_one_candidate_and_one_run_in_the_singular(tmp_path, capsys):
    """One budget and one max_seqs are one candidate: "simulated 1 candidate", and the warning for its
    rejected request (500 prompt tokens over --max-model-len 100) says "1 of 1 run", not "1 runs"."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n1,500,1\n")
    argv = ["tune", "--trace", str(trace), "--linear-cost", "1000,0", "--slo-ttft", "2s", "--slo-tpot", "1s",
            "--budgets", "2048", "--max-seqs-candidates", "256", "--max-model-len", "100", "--executor", "serial"]
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert "\nsimulated 1 candidate in " in captured.out
    assert captured.err.startswith("warning: 1 of 1 run rejected requests; the first, budget 2,048: rejected 1 of 2 "
                                   "requests (1 over the context length (context_length))")


def test_tune_writes_a_light_rate_with_two_significant_digits(tmp_path, capsys):
    """Three requests 600 s apart are offered 2 / 1,200 = 0.0017 req/s; each is served in one 1 s step within
    the SLOs, so every candidate's goodput is 3 requests in the 1,201 s to the last finish, 0.0025 req/s. The
    header, the table, the chosen line and the best of each kind write them with two significant digits, as
    simulate and plan do (two decimals read 0.00)."""
    trace = tmp_path / "light.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n0,10,1\n600,10,1\n1200,10,1\n")
    argv = ["tune", "--trace", str(trace), "--linear-cost", "1000,0", "--slo-ttft", "2s", "--slo-tpot", "1s",
            "--budgets", "512,1024", "--max-seqs-candidates", "2", "--executor", "serial"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("light.csv: 3 requests, rate scale 1 (0.0017 req/s offered); linear cost 1000,0")
    rows = [[cell.strip() for cell in line.strip("│ ").split("│")] for line in out if line.startswith("│")]
    assert [row[:5] for row in rows] == [["chosen", "1,024", "256", "0.0025", "100.0%"],
                                         ["#2", "1,024", "2", "0.0025", "100.0%"],
                                         ["#3", "512", "256", "0.0025", "100.0%"],
                                         ["#4", "512", "2", "0.0025", "100.0%"]]
    assert "chosen: token budget 1,024, max_seqs 256: goodput 0.0025 req/s (100.0% within the SLOs)" in out
    assert out[-1] == ("best of each kind searched: token budget 1,024 (of 2 tried; goodput 0.0025 req/s, 100.0% "
                       "in SLO); max_seqs 256 (of 2 tried; goodput 0.0025 req/s, 100.0% in SLO)")
