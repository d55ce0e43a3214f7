"""Tests of `validate --against`: the run-folder and benchmark-CSV readers, the closed loop and the figures by
hand, the engine profile's step terms, format detection and the command."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from stallfree import Request
from stallfree.cli import main
from stallfree.core.scheduler import Scheduler
from stallfree.sim.inputs.engine_profile import (
    EngineProfile,
    EngineProfileError,
    ProfiledCostModel,
    load_profile,
)
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.validate import silicon
from stallfree.validate.against import detect, figures, replay_run, validate_runs, verdict
from stallfree.validate.compare import Latencies
from stallfree.validate.hardware import derived_kv_tokens, gpu_preset, model_preset
from stallfree.validate.runs import read_run_folder
from stallfree.validate.silicon import REQUESTS_PER_ROW, closed_loop, read_rows, select, validate_silicon

DATA = Path(__file__).parent / "data"
RUN = DATA / "run_small"
CSV = DATA / "silicon_small.csv"


def _lat(ttft: float, e2e: float, tpot: float | None = None) -> Latencies:
    return Latencies(ttft=ttft, tpot=tpot, e2e=e2e, itl_mean=tpot, itls=())


def test_run_folder_by_hand():
    """Requests are sorted by queued_ts; TTFT, TPOT and E2E come from the engine's timestamps."""
    run = read_run_folder(RUN)
    assert run.request_ids == ("r0", "r2", "r1")
    assert run.arrivals == pytest.approx((0.0, 0.1, 0.2))
    assert run.prompt_lens == (100, 20, 50) and run.output_lens == (11, 5, 1)
    r0, r2, r1 = run.measured
    assert (r0.ttft, r0.tpot, r0.e2e) == pytest.approx((0.05, 0.05, 0.55))
    assert (r2.ttft, r2.tpot, r2.e2e) == pytest.approx((0.02, 0.05, 0.22))
    assert r1.tpot is None and r1.e2e == pytest.approx(0.1)
    assert (run.tp, run.max_num_seqs, run.max_num_batched_tokens, run.num_gpu_blocks) == (1, 8, 256, 1000)
    assert run.device_name == "NVIDIA H100 80GB HBM3"


def test_run_folder_errors_name_file_line_and_field(tmp_path):
    """A malformed request names requests.jsonl, its line and the field with its value."""
    bad = tmp_path / "run"
    shutil.copytree(RUN, bad)
    lines = (bad / "requests.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"output_toks": 11', '"output_toks": "many"')
    (bad / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"requests\.jsonl:2: field 'output_toks' must be an integer >= 1, got 'many'"):
        read_run_folder(bad)
    lines[1] = lines[1].replace('"queued_ts": 10.0, ', "")
    (bad / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"requests\.jsonl:2: no field 'queued_ts'"):
        read_run_folder(bad)


def test_figures_and_verdict_by_hand():
    """Means and signed errors of three requests: measured TTFT 1, 2, 3 s against 2, 2, 3 s is +16.7%."""
    m = {0: _lat(1.0, 4.0, 0.1), 1: _lat(2.0, 4.0, 0.1), 2: _lat(3.0, 4.0, 0.1)}
    s = {0: _lat(2.0, 4.36, 0.1), 1: _lat(2.0, 4.36, 0.1), 2: _lat(3.0, 4.36, 0.1)}
    f = figures(m, s)
    assert f["requests"] == 3
    assert f["measured"]["mean_ttft_ms"] == pytest.approx(2000.0)
    assert f["error_pct"]["mean_ttft"] == pytest.approx(100 / 6)
    assert f["error_pct"]["mean_e2e"] == pytest.approx(9.0)
    assert f["error_pct"]["p50_tpot"] == pytest.approx(0.0)
    assert f["median_ape_pct"]["ttft"] == pytest.approx(0.0)
    line = verdict(f["error_pct"])
    assert "mean E2E +9.0% (within 10%)" in line and "mean TTFT +16.7% (within 20%)" in line
    assert line.startswith("verdict: within the goals")


def test_closed_loop_by_hand():
    """Concurrency 1, 8-token prompts, 3 tokens out, 1 ms a step: (0, 1, 3) ms then (3, 4, 6) ms; a 0.5 ms
    think time moves the second request to (3.5, 4.5, 6.5) ms."""
    cost = LinearCostModel(1e-3, 0.0)
    sched = SchedulerConfig(1000, 64, 8, kv="paged")
    got = closed_loop(sched, cost, concurrency=1, num_requests=2, isl=8, osl=3)
    assert got == [pytest.approx((0.0, 1e-3, 3e-3)), pytest.approx((3e-3, 4e-3, 6e-3))]
    got = closed_loop(sched, cost, concurrency=1, num_requests=2, isl=8, osl=3, think_s=0.5e-3)
    assert got[1] == pytest.approx((3.5e-3, 4.5e-3, 6.5e-3))
    # Two at once, 1 ms per token: one 16-token step (both prefills) then one 2-token decode step.
    got = closed_loop(SchedulerConfig(1000, 64, 8, kv="paged"), LinearCostModel(0.0, 1e-3), 2, 2, 8, 2)
    assert got == [pytest.approx((0.0, 16e-3, 18e-3))] * 2


def test_profiled_cost_model_by_hand():
    """A step holding one last prefill chunk and nothing else: 1 ms + 0.5 ms per step + 0.1 ms per sampled."""
    s = Scheduler(token_budget=64, max_seqs=4, kv_tokens=1000)
    s.add(Request(rid=1, prompt_len=4, max_new=2))
    plan = s.schedule()
    prof = EngineProfile("t", step_s=0.5e-3, per_sampled_s=0.1e-3, frontend_s=2e-3)
    assert ProfiledCostModel(LinearCostModel(1e-3, 0.0), prof).step_time(plan) == pytest.approx(1.6e-3)
    assert "0.500 ms per step, 100.0 us per sampled token, 2.00 ms front end" in prof.describe()
    back = EngineProfile.from_json("t", prof.to_json())
    assert (back.step_s, back.per_sampled_s, back.frontend_s) == pytest.approx((0.5e-3, 0.1e-3, 2e-3))
    with pytest.raises(EngineProfileError, match="step_s must be a finite number >= 0"):
        EngineProfile("bad", step_s=-1.0)
    with pytest.raises(EngineProfileError, match="no such profile"):
        load_profile("nonesuch")
    assert load_profile("none").is_empty


def test_names_and_kv_derivation():
    """Run names map by table; the KV of a run without blocks is memory x util - weights - reserve."""
    assert model_preset("nvidia/Llama-3.1-8B-Instruct-FP8", "bfloat16") == ("llama-3.1-8b", "fp8")
    assert model_preset("meta-llama/Llama-3.1-8B", "bfloat16") == ("llama-3.1-8b", "bf16")
    assert gpu_preset("NVIDIA GeForce RTX 4090") == "rtx-4090" and gpu_preset("RTXPRO6000") == "rtx-pro-6000"
    assert gpu_preset("h200_sxm") == "h200"

    class Cost:
        weight_bytes_per_gpu = 10e9
        kv_bytes_per_token_per_gpu = 1000.0

    # 20e9 x 0.9 - 10e9 - 1.238e9 = 6.762e9 B = 6,762,000 tokens = 422,625 blocks of 16.
    assert derived_kv_tokens(Cost(), 20e9, 0.9, 16) == 422_625 * 16


def test_replay_run_structure():
    """The hand-made folder replays on the H100 preset with the folder's own KV blocks."""
    res = replay_run(read_run_folder(RUN), EngineProfile("none"))
    assert res["requests"] == 3
    assert res["config"]["kv_tokens"] == 16_000 and res["config"]["gpu"] == "h100-sxm"
    assert res["measured"]["mean_e2e_ms"] == pytest.approx((550 + 220 + 100) / 3)
    assert all(res["simulated"][f"mean_{m}_ms"] > 0 for m in ("ttft", "e2e"))


def test_folder_of_runs_skips_with_reason(tmp_path):
    """A folder of runs replays each; a run on a GPU with no preset is skipped with the reason."""
    shutil.copytree(RUN, tmp_path / "a")
    shutil.copytree(RUN, tmp_path / "b")
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    meta["hardware"]["device_name"] = "Tesla T4"
    (tmp_path / "b" / "meta.json").write_text(json.dumps(meta))
    assert detect(str(tmp_path)) == "runs"
    res = validate_runs(tmp_path, EngineProfile("none"))
    assert [r["run"] for r in res["runs"]] == ["a"]
    assert res["skipped"][0]["run"] == "b" and "Tesla T4" in res["skipped"][0]["reason"]


def test_data_parallel_run_replays_as_replicas(tmp_path):
    """data_parallel_size 2: two replicas behind vLLM's router; the three requests (0, 0.1, 0.2 s) go to
    replicas 0, 1 and then 0 again (scores 0 / 0, then 4 x 1 waiting or 1 running on each: the lowest index)."""
    shutil.copytree(RUN, tmp_path / "dp")
    meta = json.loads((tmp_path / "dp" / "meta.json").read_text())
    meta["engine_kwargs"]["data_parallel_size"] = 2
    (tmp_path / "dp" / "meta.json").write_text(json.dumps(meta))
    res = replay_run(read_run_folder(tmp_path / "dp"), EngineProfile("none"))
    assert res["requests"] == 3 and res["config"]["dp"] == 2
    assert "2 data-parallel replicas" in res["config"]["dp_note"]


def test_silicon_rows_by_hand():
    """Concurrency from silicon_concurrency=N, else batch_size; attention_dp 0 reads as 1; selection by
    model, GPU and engine."""
    rows = read_rows(CSV)
    assert [(r.concurrency, r.tp, r.attention_dp) for r in rows] == [(8, 1, 1), (2, 4, 1), (0, 1, 1), (16, 2, 1)]
    assert [r.line for r in select(rows, model="llama-3.1", gpu="h100-sxm")] == [3]
    assert [r.line for r in select(rows, engine="sglang")] == [5]
    assert [r.line for r in select(rows, model="qwen3-32b,llama-3.1-8b", mode="agg")] == [2, 5]


def test_silicon_bad_field_names_line(tmp_path):
    """A malformed row names the file, the line and the field."""
    bad = tmp_path / "s.csv"
    bad.write_text(CSV.read_text().replace("agg,64,4,", "agg,sixty,4,"))
    with pytest.raises(ValueError, match=r"s\.csv:2: field 'isl' must be a number, got 'sixty'"):
        read_rows(bad)


def test_validate_silicon_small():
    """The two replayable vLLM rows run; the disaggregated row is counted as skipped."""
    res = validate_silicon(str(CSV), EngineProfile("none"), engine="vllm")
    assert [r["line"] for r in res["rows"]] == [2, 3]
    assert res["rows"][0]["requests"] == REQUESTS_PER_ROW * 8
    assert sum(res["skipped"].values()) == 1
    assert res["verdict"].startswith("verdict: ")


@pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                    reason="the optional package aiconfigurator-core (extra 'kernels') is not installed")
def test_silicon_skip_reasons_keep_their_figures(tmp_path):
    """A row that cannot be replayed is reported with the message as raised: its figures (versions, sizes)
    are what the user needs to act on, so none is masked."""
    csv = tmp_path / "one.csv"
    lines = CSV.read_text().splitlines()
    csv.write_text("\n".join([lines[0], lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"vllm:9\.9") as err:
        validate_silicon(str(csv), EngineProfile("none"), kernels="vllm:9.9")
    assert "N" not in str(err.value).split("replayed: ", 1)[1].replace("NVIDIA", "")


def test_silicon_limit_rows_below_one_is_refused():
    """--limit-rows 0 or -1 is an error naming the option and the value, not a silent cut of the rows."""
    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"--limit-rows must be >= 1.*got {bad}"):
            validate_silicon(str(CSV), EngineProfile("none"), engine="vllm", limit=bad)


def test_row_ttft_includes_the_first_wave_tpot_does_not(monkeypatch):
    """Row a (concurrency 8, OSL 4), replayed as 2 waves of hand-made times: the first wave's TTFT 1.0 s,
    the second's 0.2 s, so TTFT = (8 x 1.0 + 8 x 0.2) / 16 = 0.6 s; TPOT over the second wave only:
    3 gaps in 0.03 s = 10 ms (the first wave's, 50 ms, are left out)."""
    row = read_rows(CSV)[0]

    def fake(sched, cost, concurrency, n, isl, osl, think_s=0.0, spread=False):  # type: ignore[no-untyped-def]
        first = [(0.0, 1.0, 1.15)] * concurrency
        later = [(1.15, 1.35, 1.38)] * (n - concurrency)
        return first + later

    monkeypatch.setattr(silicon, "closed_loop", fake)
    got = silicon.replay_row(row, EngineProfile("none"), "none", 2)
    assert got["requests"] == 16
    assert got["sim_ttft_ms"] == pytest.approx(600.0)
    assert got["sim_tpot_ms"] == pytest.approx(10.0)
    fe = silicon.replay_row(row, EngineProfile("f", frontend_s=0.005), "none", 2)
    assert fe["sim_ttft_ms"] == pytest.approx(605.0) and fe["sim_tpot_ms"] == pytest.approx(10.0)


def test_detect_formats(tmp_path):
    """The format comes from the content."""
    assert detect(str(RUN)) == "run"
    assert detect(str(CSV)) == "silicon"
    assert detect(str(DATA / "vllm_result_small.json")) == "vllm-result"
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="not a run folder"):
        detect(str(tmp_path / "x.txt"))


def test_cli_against_json(capsys, tmp_path):
    """`validate --against RUN --json --out DIR` prints the figures and writes the plot (exit 3: the small run's
    verdict is outside the goals, and the figures are printed first)."""
    assert main(["validate", "--against", str(RUN), "--json", "--out", str(tmp_path)]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["requests"] == 3 and "per_request" not in out["runs"][0]
    assert (tmp_path / "against.png").stat().st_size > 0
    assert main(["validate", "--against", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                    reason="needs the optional aiconfigurator-core (pip install aiconfigurator-core)")
def test_against_aiconfigurator_reads_the_package_copy():
    """`--against aiconfigurator` reads the installed package's silicon_sample.csv."""
    res = validate_silicon("aiconfigurator", EngineProfile("none"), model="llama-3.1-8b-instruct-fp8",
                           engine="vllm", limit=2)
    assert res["csv"].endswith("silicon_sample.csv") and len(res["rows"]) == 2


def test_default_profile_follows_kernels():
    """--kernels none takes no profile; an engine without a shipped profile fitted on it takes none too."""
    from stallfree.sim.inputs.engine_profile import default_profile

    assert default_profile("none").is_empty and default_profile(None).is_empty
    assert default_profile("trtllm:current").name in ("none", "trtllm")
    prof = default_profile("vllm")
    assert prof.name == "none" or prof.pricing == "vllm"


def test_vllm_result_has_a_verdict_and_the_front_end():
    """A vllm bench serve result gets the verdict line; a profile's front end is added to simulated TTFT."""
    from stallfree.validate.vllm import validate_vllm

    path = DATA / "vllm_result_small.json"
    plain = validate_vllm(path, "llama-3.1-8b", "h100-sxm")
    front = validate_vllm(path, "llama-3.1-8b", "h100-sxm", profile=EngineProfile("f", frontend_s=0.01))
    assert plain["verdict"].startswith("verdict: ")
    assert front["simulator"]["mean_ttft_ms"] == pytest.approx(plain["simulator"]["mean_ttft_ms"] + 10.0)
    sc = plain["scheduler_config"]  # the replay's resolved scheduler, as every --json echoes it
    assert (sc["token_budget"], sc["max_seqs"], sc["kv_policy"], sc["block_size"]) == (2048, 256, "paged", 16)


def test_default_pricing_takes_the_matching_profile():
    """validate's default (kernels None, profile None): today's pricing and no profile on a GPU without
    tables (RTX 4090); vLLM's tables and the vllm profile where the package has the GPU."""
    from stallfree.costmodel.kernels import kernels_installed
    from stallfree.validate.hardware import pricing

    floor = pricing("llama-3.1-8b", "rtx-4090", 1, "bf16", None, None)
    assert floor.profile.name == "none" and "no measured kernels" in floor.provenance
    if not kernels_installed():
        pytest.skip("the optional package aiconfigurator-core (extra 'kernels') is not installed")
    kern = pricing("llama-3.1-8b", "h100-sxm", 1, "bf16", None, None)
    assert kern.profile == load_profile("vllm") and isinstance(kern.cost_model, ProfiledCostModel)
    named = pricing("llama-3.1-8b", "h100-sxm", 1, "bf16", EngineProfile("none"), None)
    assert named.profile.name == "none" and not isinstance(named.cost_model, ProfiledCostModel)


def test_cli_refuses_an_unknown_kernels_engine_when_reading_the_line(capsys):
    """--kernels foo is a usage error of its own (exit 2, naming the value), before any row is read."""
    from stallfree.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["validate", "--against", "aiconfigurator", "--kernels", "foo"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kernels: engine must be one of vllm, sglang, trtllm or none, got 'foo'" in err


def test_profile_version_is_named_and_plot_ticks_are_plain() -> None:
    """The shipped vllm profile names its fit's version in its line and in the default's line; log-axis
    ticks read as plain numbers (20, not 2x10^1), minor ticks labelled at 2 and 5 only."""
    from stallfree.sim.inputs.engine_profile import load_profile
    from stallfree.validate.hardware import describe_profile
    from stallfree.validate.silicon import _minor_tick, _plain_tick

    prof = load_profile("vllm")
    assert prof.version and prof.describe().startswith(f"engine profile vllm version {prof.version}: ")
    assert describe_profile(None).startswith(f"engine profile: the default: vllm version {prof.version} (")
    assert EngineProfile.from_json("x", {"step_ms": 1.0}).describe() == (
        "engine profile x: 1.000 ms per step, 0.0 us per sampled token, 0.00 ms front end per request")
    assert [_plain_tick(v) for v in (20.0, 0.5, 1000.0)] == ["20", "0.5", "1000"]
    assert [_minor_tick(v) for v in (20.0, 30.0, 50.0, 0.2, 700.0)] == ["20", "", "50", "0.2", ""]


def test_prefill_load_by_hand_and_refused_above_one():
    """ISL 10,000 in chunks of 8,192 and 1,808, each priced 1 us per token: 10 ms a prompt; a request lives
    TTFT 100 ms + 10 x 10 ms = 0.2 s, so 10 clients send 50 a second: load 0.5. With 30 clients it is 1.5:
    the row is refused with the reason, before any replay."""
    from dataclasses import replace

    class PerToken:
        def prefill_step_time(self, num_tokens: int, start: int = 0) -> float:
            assert start in (0, 8192) and num_tokens in (8192, 1808)
            return num_tokens * 1e-6

    row = replace(read_rows(CSV)[0], isl=10_000, osl=11, concurrency=10, ttft_ms=100.0, tpot_ms=10.0)
    assert silicon.prefill_load(row, PerToken()) == pytest.approx(0.5)
    assert silicon.prefill_load(replace(row, concurrency=30), PerToken()) == pytest.approx(1.5)
    flood = replace(read_rows(CSV)[0], concurrency=100_000, ttft_ms=1e-3, tpot_ms=1e-3)
    with pytest.raises(ValueError, match="not a steady state of distinct prompts"):
        silicon.replay_row(flood, EngineProfile("none"), "none", 1)


def test_typed_model_typo_is_not_blamed_on_the_runs_model(capsys):
    """--model lama-3.1-8b: the nearest preset is suggested, and the run's own name
    (meta-llama/Llama-3.1-8B, which does map to a preset) is not said to have none."""
    assert main(["validate", "--against", str(RUN), "--model", "lama-3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unknown model 'lama-3.1-8b' (did you mean 'llama-3.1-8b'?)" in err
    assert "has no preset" not in err and "meta-llama/Llama-3.1-8B" not in err


def test_silicon_no_match_names_only_the_given_filters_and_lists_the_rows():
    """No row matches: the message names the filters given (not --gpu None ...), then the models and
    GPUs the rows have, so the user can pick one."""
    with pytest.raises(ValueError) as err:
        validate_silicon(str(CSV), EngineProfile("none"), model="llama-3.1-7b")
    text = str(err.value)
    assert text.endswith("no row matches --model 'llama-3.1-7b'; its rows have models Qwen/Qwen3-32B, "
                         "meta-llama/Llama-3.1-70B, nvidia/Llama-3.1-8B-Instruct-FP8 and GPUs h100_sxm, h200_sxm")
    assert "None" not in text
    assert silicon._listed([f"m{k}" for k in range(10)], most=3) == "m0, m1, m2, ... (10 in all)"


@pytest.mark.parametrize(("argv", "said"), [
    (["--mode", "agg"], "--mode agg only applies with --against and a benchmark CSV"),
    (["--limit-rows", "3"], "--limit-rows 3 only applies with --against and a benchmark CSV"),
    (["--no-range"], "--no-range only applies with --against and run folders"),
    (["--range"], "--range only applies with --against and run folders"),
    (["--kernels", "none"], "--kernels none only applies with --against or --vllm-result"),
    (["--model", "llama-3.1-8b"], "--model llama-3.1-8b only applies with --against or --vllm-result"),
    (["--max-num-seqs", "8"], "--max-num-seqs 8 only applies with --vllm-result"),
], ids=["mode", "limit-rows", "no-range", "range", "kernels", "model", "max-num-seqs"])
def test_the_engine_run_refuses_flags_only_the_measured_inputs_read(argv, said, capsys, monkeypatch):
    """The default run (the engine, no --against or --vllm-result) refuses a flag it would ignore, in one line
    naming the flag and its value, exit 2, before the engine starts."""
    import stallfree.validate.run as run

    monkeypatch.setattr(run, "run_validate", lambda *a, **k: pytest.fail("the engine ran"))
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert "not with the engine run (the default: no --against or --vllm-result): drop " + argv[0] in err


@pytest.mark.parametrize(("argv", "said"), [
    ([str(RUN), "--engine", "vllm"], "--engine vllm only applies with --against and a benchmark CSV (a "
     "silicon_sample.csv-style file or aiconfigurator), not with run folders: drop --engine"),
    ([str(RUN), "--seed", "1"], "--seed 1 only applies with the engine run or --vllm-result, not with run folders"),
    ([str(RUN), "--tp", "2"], "--tp 2 only applies with --vllm-result"),
    ([str(CSV), "--range"], "--range only applies with --against and run folders, not with a benchmark CSV"),
    ([str(CSV), "--num-requests", "8"], "--num-requests 8 only applies with the engine run"),
    ([str(DATA / "vllm_result_small.json"), "--out", "x"], "--out x only applies with the engine run, or --against "
     "with run folders or a benchmark CSV, not with a vLLM result: drop --out"),
    ([str(RUN), "--vllm-result", str(DATA / "vllm_result_small.json")], "each name the measured input: give one"),
], ids=["engine-runs", "seed-runs", "tp-runs", "range-csv", "num-requests-csv", "out-vllm", "two-inputs"])
def test_against_refuses_flags_its_format_does_not_read(argv, said, capsys):
    """With --against, a flag the format found does not read is refused the same way, before any replay."""
    assert main(["validate", "--against", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_the_engine_run_takes_its_defaults_for_flags_left_out(monkeypatch):
    """The engine run's flags given are passed on and the others keep ValidateConfig's defaults."""
    pytest.importorskip("torch")
    import stallfree.validate.run as run
    from stallfree.validate.run import ValidateConfig

    class Ran(Exception):
        """Stops the command before the figures, which this stand-in does not make."""

    seen = []

    def fake(cfg, out, save_gpu):
        seen.append((cfg, out, save_gpu))
        raise Ran

    monkeypatch.setattr(run, "run_validate", fake)
    with pytest.raises(Ran):
        main(["validate", "--num-requests", "8", "--engine-dtype", "bf16", "--seed", "3"])
    assert seen == [(ValidateConfig(num_requests=8, dtype="bf16", seed=3), None, None)]
    assert (ValidateConfig().num_requests, ValidateConfig().dtype, ValidateConfig().seed) == (24, "float32", 0)


@pytest.mark.parametrize(("name", "said"), [
    ("gpu.txt", "the file name must end in .json (the format it is written in), got '.txt'"),
    ("gpu", "the file name must end in .json (the format it is written in), got 'no suffix'"),
    ("folder.json", "is a directory; give a file name (.json)"),
], ids=["txt", "no-suffix", "directory"])
def test_the_engine_run_checks_save_gpu_before_it_starts(name, said, tmp_path, capsys, monkeypatch):
    """--save-gpu is checked before the engine runs, as calibrate's is: a name not ending in .json (which
    --gpu FILE refuses) or an existing directory is one line naming --save-gpu, exit 2."""
    import stallfree.validate.run as run

    (tmp_path / "folder.json").mkdir()
    monkeypatch.setattr(run, "run_validate", lambda *a, **k: pytest.fail("the engine ran"))
    assert main(["validate", "--save-gpu", str(tmp_path / name)]) == 2
    assert capsys.readouterr().err == f"stallfree validate: error: --save-gpu {tmp_path / name}: {said}\n"


def test_the_engine_run_takes_a_save_gpu_in_a_folder_it_will_create(tmp_path, monkeypatch):
    """The writer creates missing folders (validate.output.write_gpu), so a .json name under a folder that
    does not exist yet is passed on, and nothing is created before the run."""
    pytest.importorskip("torch")
    import stallfree.validate.run as run

    class Ran(Exception):
        """Stops the command where the engine would start."""

    seen = []

    def fake(cfg, out, save_gpu):
        seen.append(save_gpu)
        raise Ran

    monkeypatch.setattr(run, "run_validate", fake)
    target = tmp_path / "new" / "sub" / "gpu.json"
    with pytest.raises(Ran):
        main(["validate", "--save-gpu", str(target)])
    assert seen == [target] and not (tmp_path / "new").exists()
