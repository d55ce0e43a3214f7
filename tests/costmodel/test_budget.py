"""Tests of the budget report and the `stallfree budget`, `calibrate` and `specs` commands."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.costmodel import CostModel, CostModelError, CostModelMemoryError
from stallfree.costmodel.budget import budget_rows

ARGS = [
    "budget",
    "--model",
    "llama-3.3-70b",
    "--gpu",
    "h100-sxm",
    "--tp",
    "4",
    "--dtype",
    "fp8",
    "--budgets",
    "512,2048,8192",
    "--decodes",
    "64",
    "--context",
    "4096",
    "--prompt",
    "32768",
]


def test_budget_json_design_numbers(capsys):
    """The design numbers of DESIGN.md section 2: 9.1 / 36.5 / 146.0 ms, 5.3 ms decode, 17 and 5 steps."""
    assert main(ARGS + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["budget"]: r for r in out["rows"]}
    assert [round(rows[b]["design"]["step_ms"], 1) for b in (512, 2048, 8192)] == [9.1, 36.5, 146.0]
    assert {round(r["design"]["decode_step_ms"], 1) for r in out["rows"]} == {5.3}
    assert rows[2048]["steps_to_first_token"] == 17 and rows[8192]["steps_to_first_token"] == 5
    assert rows[512]["steps_to_first_token"] == 74
    assert out["kv_capacity_tokens"] == 657_180


def test_budget_json_full_beside_design(capsys):
    """Full mode prices the same steps higher, with an all-reduce part design mode does not have."""
    main(ARGS + ["--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    for r in rows:
        assert r["full"]["step_ms"] > r["design"]["step_ms"]
        assert r["full"]["comm_ms"] > 0 and r["design"]["comm_ms"] == 0
    assert round(rows[1]["full"]["step_ms"], 1) == 54.8


def test_budget_text_table(capsys):
    """The text output has one line per budget with the design and full figures side by side."""
    assert main(ARGS) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.split()[:2] == ["2048", "17"])
    assert row.split()[3:5] == ["36.5", "5.3"]


def test_budget_ttft_design_by_hand():
    """Design TTFT at budget 8,192 is 4 full steps plus a last step of 8,384 - 8,192 tokens less."""
    full = CostModel.from_names("llama-3.3-70b", "h100-sxm", tp=4, dtype="fp8")
    row = budget_rows(full, [8192], 64, 4096, 32768)[0]
    per_token = 2 * 70_553_706_496 / (4 * 1978.9e12)
    last = 32768 - 4 * 8128 + 64
    assert row.design.ttft_s == pytest.approx(4 * 8192 * per_token + last * per_token)


@pytest.mark.parametrize(
    "extra,match,code",
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'; known models:", 2),
        (["--gpu", "tpu"], "unknown GPU 'tpu'; known GPUs:", 2),
        (["--tp", "3"], "--tp 3 does not divide the 64 attention heads", 2),
        (["--budgets", "64"], "--budgets 64: leaves no room", 2),
        (["--budgets", "512,x"], "'x' is not a whole number of tokens", 2),
        (["--budgets", "0"], "0 is not a positive number", 2),
        (["--prompt", "0"], "--prompt 0: must be an integer >= 1", 2),
        (["--decodes", "-1"], "--decodes -1: must be an integer >= 0", 2),
    ],
    ids=["model", "gpu", "tp", "budget-small", "budget-text", "budget-zero", "prompt", "decodes"],
)
def test_budget_errors_one_line(capsys, extra, match, code):
    """Bad arguments print one 'error:' line on stderr and exit 2, never a traceback."""
    assert main(ARGS + extra) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stallfree budget: error: ") and match in err[0]


def test_budget_fp8_a100_warns(capsys):
    """FP8 on A100 prints a warning line and still prices at the BF16 peak."""
    assert (
        main(["budget", "--model", "llama-3.1-8b", "--gpu", "a100", "--dtype", "fp8", "--budgets", "512"])
        == 0
    )
    assert "warning: a100-sxm-80gb has no fp8 units" in capsys.readouterr().err


def test_budget_rows_validation():
    """budget_rows refuses an empty budget list."""
    full = CostModel.from_names("llama-3.1-8b", "h100-sxm")
    with pytest.raises(CostModelError, match="at least one token budget"):
        budget_rows(full, [], 1, 1, 1)


def test_calibrate_csv_command(tmp_path, capsys):
    """`stallfree calibrate --csv` fits a step CSV and reports JSON with held-out error."""
    truth = CostModel.from_names("llama-3.1-8b", "h100-sxm", mfu=0.5, mbu=0.7, overhead_s=0.0005)
    lines = ["step,num_prefill_tokens,num_decodes,decode_context_sum,prefill_context_sum,num_tokens,seconds"]
    for i in range(40):
        nd, chunk = 1 + i * 3, (i % 4) * 700
        t = truth.prefill_step_time(chunk, 0, nd, 1000) if chunk else truth.decode_step_time(nd, 1000)
        lines.append(f"{i},{chunk},{nd},{nd * 1000},0,{nd + chunk},{t!r}")
    path = tmp_path / "steps.csv"
    path.write_text("\n".join(lines) + "\n")
    assert (
        main(["calibrate", "--csv", str(path), "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 40
    assert out["test_error"]["max"] < 1e-3
    assert (round(out["mfu"], 3), round(out["mbu"], 3)) == (0.5, 0.7)


def test_calibrate_needs_one_source(capsys):
    """calibrate without --csv or --profile is a usage error."""
    assert main(["calibrate"]) == 2
    assert "exactly one of --csv" in capsys.readouterr().err


def test_specs_json(capsys):
    """`stallfree specs --json` lists the presets with their key numbers."""
    assert main(["specs", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"]["h100-sxm"]["fp8_tflops"] == pytest.approx(1978.9)
    assert out["models"]["mixtral-8x7b"]["active_params"] == 12_879_925_248


def test_budget_says_design_counts_every_expert_of_an_moe(capsys):
    """For an MoE model the design column prices all parameters per token; the footer says so, with the
    total and active counts (Mixtral-8x7B: 46.7B total, 12.9B active, both from get_model)."""
    from stallfree.costmodel.model import get_model

    m = get_model("mixtral-8x7b")
    assert main(["budget", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--tp", "2", "--kernels", "none"]) == 0
    out = capsys.readouterr().out
    assert f"design counts all {m.total_params / 1e9:,.1f}B parameters per token" in out
    assert f"an MoE token runs {m.active_params / 1e9:,.1f}B" in out
    assert main(["budget", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--kernels", "none"]) == 0
    assert "design counts all" not in capsys.readouterr().out


def test_specs_names_multi_head_attention_as_such(capsys):
    """llama-2-7b has as many KV heads as heads (32 and 32): mha, not gqa; llama-3.1-8b (8 of 32) is gqa."""
    assert main(["specs", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert models["llama-2-7b"]["attention"] == "mha"
    assert models["llama-3.1-8b"]["attention"] == "gqa"
    assert models["deepseek-v3"]["attention"] == "mla"


def test_specs_lists_every_accepted_alias_and_the_kernel_system(capsys):
    """Every alias --gpu and --model accept is listed (h100 for h100-sxm, deepseek-r1 for deepseek-v3),
    with the package's system name of the GPU's kernel tables ('h100_sxm'; none for the L4)."""
    from stallfree.costmodel import get_gpu, get_model

    assert main(["specs", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "h100" in out["gpus"]["h100-sxm"]["aliases"] and get_gpu("h100").key == "h100-sxm"
    assert out["gpus"]["h100-sxm"]["kernel_system"] == "h100_sxm" and out["gpus"]["l4"]["kernel_system"] is None
    assert "deepseek-r1" in out["models"]["deepseek-v3"]["aliases"]
    for kind, get in (("gpus", get_gpu), ("models", get_model)):
        for key, row in out[kind].items():
            assert all(get(alias).key == key for alias in row["aliases"])
    assert main(["specs"]) == 0
    text = capsys.readouterr().out
    assert any(line.startswith("h100-sxm") and line.endswith("h100, h100-sxm5") for line in text.splitlines())


def test_budget_names_a_bad_flag_before_the_model_fit(capsys):
    """--decodes -1 is named even though llama-3.3-70b in bf16 does not fit one H100 (that check comes after)."""
    assert main(["budget", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--decodes", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "stallfree budget: error: --decodes -1: must be an integer >= 0"


def test_budget_refuses_a_budget_beyond_the_context_or_the_kv_cache(capsys):
    """A budget whose prompt chunk exceeds the 131,072-token context (limit 131,072 + 64 decodes) or whose
    tokens exceed the KV cache is refused naming the flag, the value and the limit."""
    argv = ["budget", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "4", "--dtype", "fp8"]
    assert main([*argv, "--budgets", "1000000000"]) == 2
    assert capsys.readouterr().err.strip() == (
        "stallfree budget: error: --budgets 1,000,000,000: more tokens in one step than llama-3.3-70b's "
        "context of 131,072 tokens plus --decodes 64; at most 131,136")
    assert main([*argv, "--budgets", "131136", "--json"]) == 0
    capsys.readouterr()
    from stallfree.costmodel import get_gpu, get_model

    capacity = CostModel(get_model("llama-3.3-70b"), get_gpu("h100-sxm"), tp=4, dtype="fp8").kv_capacity_tokens(0.3)
    assert main([*argv, "--budgets", str(capacity + 1), "--gpu-memory-utilization", "0.3"]) == 2
    assert f"than the {capacity:,}-token KV cache of this replica; at most {capacity:,}" in capsys.readouterr().err


def test_budget_refuses_a_prompt_or_context_no_server_runs(capsys):
    """--prompt or --context past llama-3.3-70b's 131,072-token context, and --decodes x --context past the
    KV cache, are refused naming the flag, the value and the limit; at the limits they are priced."""
    from stallfree.costmodel import get_gpu, get_model

    argv = ["budget", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "4", "--dtype", "fp8",
            "--budgets", "512"]
    capacity = CostModel(get_model("llama-3.3-70b"), get_gpu("h100-sxm"), tp=4, dtype="fp8").kv_capacity_tokens(0.9)
    most = capacity // 64  # the longest context 64 decodes can hold together
    for flag in ("--prompt", "--context"):
        assert main([*argv, flag, "131073"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"stallfree budget: error: {flag} 131,073: longer than llama-3.3-70b's context of 131,072 tokens; "
            "at most 131,072")
    assert main([*argv, "--prompt", "131072", "--context", str(most), "--json"]) == 0
    capsys.readouterr()
    assert main([*argv, "--context", str(most + 1)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"stallfree budget: error: --context {most + 1:,}: --decodes 64 x {most + 1:,} = {64 * (most + 1):,} KV "
        f"tokens, more than the {capacity:,}-token KV cache of this replica; at most {most:,}")
    assert main([*argv, "--decodes", "0", "--context", str(most + 1), "--json"]) == 0  # no decodes: no KV held


def test_budget_refuses_a_budget_given_twice(capsys):
    """--budgets 512,512 is refused as sweep refuses it, instead of printing the row twice."""
    argv = ["budget", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "4", "--dtype", "fp8"]
    assert main([*argv, "--budgets", "512,2048,512"]) == 2
    assert capsys.readouterr().err.strip() == (
        "stallfree budget: error: --budgets 512,2048,512: 512 is given twice; give each value once")


def test_budget_list_takes_token_suffixes(capsys):
    """--budgets reads each value as every token flag does (vLLM's suffixes): 1k is 1,000 and 2K 2,048."""
    assert main(["budget", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--budgets", "1k,2K", "--json"]) == 0
    assert [r["budget"] for r in json.loads(capsys.readouterr().out)["rows"]] == [1000, 2048]


def test_budget_header_counts_every_gpu_of_a_pipeline(capsys):
    """With --pp the header names the replica's tp x pp GPUs and the split (it said "4 x h100-sxm" for
    tp 4 x pp 2, 8 GPUs); the step figures are one batch through the stages in turn, and the KV capacity is
    the whole pipeline's (1,536,086 tokens against 657,180 at pp 1)."""
    argv = ["budget", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--dtype", "fp8", "--tp", "4"]
    assert main([*argv, "--pp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "llama-3.3-70b on 8 x h100-sxm (tp 4 x pp 2: one batch passes the 2 stages in turn), weights fp8,"
    )
    assert lines[1].startswith("KV capacity 1,536,086 tokens")
    assert "kernels: not priced (the kernel tables price --pp 1 only)" in lines
    assert main([*argv, "--pp", "2", "--json", "--kernels", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["pp"], out["gpus"]) == (4, 2, 8)
    assert main([*argv, "--kernels", "none"]) == 0
    assert capsys.readouterr().out.startswith("llama-3.3-70b on 4 x h100-sxm, weights fp8,")


@pytest.mark.parametrize(("command", "argv", "said", "library"), [
    ("budget", ["--tp", "3"], "--tp 3 does not divide the 64 attention heads of llama-3.3-70b; use a divisor of 64",
     "tp 3 does not divide the 64 attention heads of llama-3.3-70b; use a divisor of 64"),
    ("budget", ["--pp", "100"], "--pp 100 is more than the 80 layers of llama-3.3-70b",
     "pp 100 is more than the 80 layers of llama-3.3-70b"),
    ("calibrate", ["--profile", "a100-codellama34b-tp2", "--tp", "3"],
     "--tp 3 does not divide the 64 attention heads of llama-3.3-70b; use a divisor of 64",
     "tp 3 does not divide the 64 attention heads of llama-3.3-70b; use a divisor of 64"),
    ("budget", ["--model", "qwen2.5-7b", "--tp", "7"],
     "--tp 7 and the 4 KV heads of qwen2.5-7b: one must divide the other, so that KV heads are either split evenly "
     "or replicated evenly",
     "tp 7 and the 4 KV heads of qwen2.5-7b: one must divide the other, so that KV heads are either split evenly "
     "or replicated evenly"),
    ("budget", ["--model", "deepseek-v3", "--tp", "1", "--dp-attention", "2", "--ep", "2"],
     "deepseek-v3 weights in fp8 need 345.9 GB per GPU at --tp 1, --dp-attention 2, --ep 2, more than the 80 GB of "
     "one h100-sxm",
     "deepseek-v3 weights in fp8 need 345.9 GB per GPU at tp 1, dp_attention 2, ep 2, more than the 80 GB of "
     "one h100-sxm"),
], ids=["tp-heads", "pp-layers", "calibrate-tp", "tp-kv-heads", "moe-weights"])
def test_cost_model_errors_name_the_flags(command, argv, said, library, capsys):
    """budget and calibrate name the flags typed (--tp 3, --pp 100, --dp-attention 2), as they word an MoE
    split, where the cost model itself keeps its fields (tp 3, dp_attention 2)."""
    base = ["--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--dtype", "fp8"]
    if command == "calibrate":
        base = base[:4]
    assert main([command, *base, *argv]) == 2
    assert capsys.readouterr().err == f"stallfree {command}: error: {said}\n"
    kw = dict(zip(base[::2], base[1::2], strict=True)) | dict(zip(argv[::2], argv[1::2], strict=True))
    with pytest.raises(CostModelError) as raised:
        CostModel.from_names(kw["--model"], "h100-sxm", tp=int(kw.get("--tp", 4)), dtype="fp8",
                             pp=int(kw.get("--pp", 1)), ep=int(kw.get("--ep", 1)),
                             dp_attention=int(kw.get("--dp-attention", 1)))
    assert str(raised.value) == library


def test_budget_memory_hint_names_pp_where_more_stages_make_room(capsys):
    """Llama 3.3 70B in bf16 at tp 1 needs 141.1 GB per GPU of an 80 GB H100; in fp8 its 72.7 GB leave no
    KV room at 0.9: each pipeline stage holds a share of the 80 layers (their weights and KV), so budget's
    hint names --pp beside --tp (the flags, not the cost model's fields). With --ep 2 (priced at pp 1 only) it
    names --tp alone, and so does `simulate`, which has no --pp."""
    argv = ["budget", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "1", "--dtype", "bf16"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "stallfree budget: error: llama-3.3-70b weights in bf16 need 141.1 GB per GPU at --tp 1, more than the 80 GB "
        "of one h100-sxm; raise --tp or --pp, or use 8-bit weights\n")
    assert main([*argv, "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err == (
        "stallfree budget: error: no room for KV: llama-3.3-70b weights take 72.7 GB per GPU, 0.9 x 80 GB leaves "
        "0.0 GB; raise --tp or --pp, use 4-bit weights or a higher --gpu-memory-utilization\n")
    assert main(["budget", "--model", "mixtral-8x7b", "--gpu", "l4", "--tp", "2", "--ep", "2", "--dtype", "bf16"]) == 2
    assert capsys.readouterr().err.endswith("need 46.7 GB per GPU at --tp 2, more than the 24 GB of one l4; raise --tp "
                                            "or use 8-bit weights\n")
    assert main(["simulate", "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "1", "--dtype", "bf16",
                 "--num-requests", "3"]) == 2
    assert capsys.readouterr().err.endswith("of one h100-sxm; raise --tp or use 8-bit weights\n")


@pytest.mark.parametrize(("gpu", "dtype", "hint"), [
    ("h100-sxm", "bf16", "811.7 GB per GPU at --tp 1, more than the 80 GB of one h100-sxm; raise --tp or --pp, or use "
                         "8-bit weights"),
    ("h100-sxm", "fp8", "410.1 GB per GPU at --tp 1, more than the 80 GB of one h100-sxm; raise --tp or --pp, or use "
                        "4-bit weights"),
    ("h100-sxm", "int8", "410.1 GB per GPU at --tp 1, more than the 80 GB of one h100-sxm; raise --tp or --pp, or use "
                         "4-bit weights"),
    ("mi300x", "fp8", "410.1 GB per GPU at --tp 1, more than the 192 GB of one mi300x; raise --tp or --pp"),
    ("h100-sxm", "int4", "215.5 GB per GPU at --tp 1, more than the 80 GB of one h100-sxm; raise --tp or --pp"),
], ids=["bf16", "fp8", "int8", "fp8-on-mi300x", "int4"])
def test_memory_hint_suggests_only_smaller_weights(capsys, gpu, dtype, hint):
    """Llama 3.1 405B at tp 1 fits no single GPU: 401.6 B decoder parameters at the dtype's bytes plus 4.2 B
    each of embedding and lm_head in 16 bits. The hint offers the weights one size smaller than those in use:
    8-bit under bf16, 4-bit under fp8 or int8 (it said 8-bit, which they are) where the GPU runs 4-bit
    weights, and none on the MI300X, which runs none, or under int4, which has nothing smaller."""
    assert main(["budget", "--model", "llama-3.1-405b", "--gpu", gpu, "--tp", "1", "--dtype", dtype]) == 2
    assert capsys.readouterr().err == f"stallfree budget: error: llama-3.1-405b weights in {dtype} need {hint}\n"


def test_kv_room_hint_under_4_bit_weights_suggests_no_smaller_weights(capsys):
    """Llama 3.3 70B's int4 weights take 39.5 GB of an H100's 80: at --gpu-memory-utilization 0.4 (32 GB) no
    KV fits. The hint names --tp (and --pp) and --gpu-memory-utilization, by their flags, but no smaller weights;
    simulate (no --pp) alike."""
    argv = ["--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "1", "--dtype", "int4",
            "--gpu-memory-utilization", "0.4"]
    facts = "no room for KV: llama-3.3-70b weights take 39.5 GB per GPU, 0.4 x 80 GB leaves 0.0 GB; "
    assert main(["budget", *argv]) == 2
    assert capsys.readouterr().err == (
        f"stallfree budget: error: {facts}raise --tp or --pp, or use a higher --gpu-memory-utilization\n")
    assert main(["simulate", *argv, "--num-requests", "3"]) == 2
    assert capsys.readouterr().err == (
        f"stallfree simulate: error: {facts}raise --tp or use a higher --gpu-memory-utilization\n")


@pytest.mark.parametrize(("flags", "said"), [
    (["--ep", "2"], "--ep 2"),
    (["--dp-attention", "2"], "--dp-attention 2"),
    (["--ep", "2", "--dp-attention", "2"], "--ep 2"),
])
def test_budget_names_the_flag_of_a_split_a_dense_model_cannot_take(capsys, flags, said):
    """--ep and --dp-attention are for MoE models: on the dense Llama 3.3 70B the error names the flag as
    typed (it said "ep 2: ..." and "dp_attention 2: ..."), exit 2, before anything is priced."""
    for command in (["budget"], ["calibrate", "--profile", "a100-codellama34b-tp2"]):
        assert main([*command, "--model", "llama-3.3-70b", "--gpu", "h100-sxm", "--tp", "4", *flags]) == 2
        assert capsys.readouterr().err == (
            f"stallfree {command[0]}: error: {said}: llama-3.3-70b has no experts; expert parallelism and "
            "data-parallel attention are for MoE models (a dense model's data parallelism is more replicas)\n")


@pytest.mark.parametrize(("flags", "said"), [
    (["--ep", "3"], "--ep 3 does not divide the 8 routed experts of mixtral-8x7b"),
    (["--ep", "4"], "--ep 4 does not divide the replica's 2 GPUs (--tp 2 x --dp-attention 1); the experts are split "
                    "--ep ways, each over --tp x --dp-attention / --ep GPUs"),
    (["--ep", "2", "--pp", "2"], "--ep 2 is not priced with --pp 2; use --pp 1"),
    (["--dp-attention", "2", "--pp", "2"], "--dp-attention 2 is not priced with --pp 2; use --pp 1"),
    (["--ep", "2", "--dp-attention", "2", "--pp", "2"],
     "--ep 2 and --dp-attention 2 are not priced with --pp 2; use --pp 1"),
], ids=["experts", "gpus", "ep-with-pp", "dp-with-pp", "both-with-pp"])
def test_budget_names_the_flags_of_a_split_the_moe_model_cannot_take(capsys, flags, said):
    """Mixtral 8x7B's 8 routed experts split 1, 2, 4 or 8 ways, over the replica's --tp 2 x --dp-attention GPUs,
    and only at --pp 1: budget and calibrate name the flags as typed (they said "ep 3 ...", "tp 2 x dp_attention
    1" and "ep 2 and dp_attention 1 are not priced with pp 2", a split at 1 named though not given), exit 2."""
    for command in (["budget"], ["calibrate", "--profile", "a100-codellama34b-tp2"]):
        assert main([*command, "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--tp", "2", *flags]) == 2
        assert capsys.readouterr().err == f"stallfree {command[0]}: error: {said}\n"


def test_simulate_and_plan_name_the_flags_of_a_split_the_moe_model_cannot_take(capsys):
    """simulate refuses --ep 3 on Mixtral 8x7B by its flag (exit 2); plan skips the shape of --tp 1 that --ep 4
    cannot split, saying so in flags (it said "ep 4 ... (tp 1 x dp_attention 1)"), and plans --tp 4. The
    cost model itself keeps naming its fields."""
    assert main(["simulate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--tp", "2", "--ep", "3",
                 "--num-requests", "3"]) == 2
    assert capsys.readouterr().err == ("stallfree simulate: error: --ep 3 does not divide the 8 routed experts of "
                                       "mixtral-8x7b\n")
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--tp", "1,4", "--ep", "4",
                 "--num-requests", "3", "--slo-ttft", "2s", "--executor", "serial", "--no-disaggregate",
                 "--max-replicas", "1", "--json"]) == 0
    shapes = {(s["tp"], s["skipped"]) for s in json.loads(capsys.readouterr().out)["shapes"]}
    assert shapes == {(4, None), (1, "skipped: --ep 4 does not divide the replica's 1 GPUs (--tp 1 x "
                                     "--dp-attention 1); the experts are split --ep ways, each over --tp x "
                                     "--dp-attention / --ep GPUs")}
    with pytest.raises(CostModelError) as caught:
        CostModel.from_names("mixtral-8x7b", "h100-sxm", tp=2, pp=2, ep=2)
    assert str(caught.value) == "ep 2 and dp_attention 1 are not priced with pp 2; use pp 1"


def test_budget_defaults_to_the_simulators_default_replica(capsys):
    """`stallfree budget` with no flags prices the replica simulate, tune and plan default to (Llama 3.3 70B
    on 4 x H100 SXM in FP8), says so in its header, gives the same rows as the flags written out, and
    shows the defaults in --help; a bad value is then named for itself."""
    from stallfree.sim.defaults import DEFAULT_REPLICA

    assert DEFAULT_REPLICA == {"model": "llama-3.3-70b", "gpu": "h100-sxm", "tp": 4, "dtype": "fp8"}
    assert main(["budget", "--kernels", "none"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("llama-3.3-70b on 4 x h100-sxm, weights fp8, KV cache bf16; 64 decodes at 4096 "
                                   "tokens of context; prompt 32768 tokens")
    assert main(["budget", "--kernels", "none", "--json"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert (bare["model"], bare["gpu"], bare["tp"], bare["dtype"]) == ("llama-3.3-70b", "h100-sxm", 4, "fp8")
    assert main([*ARGS, "--kernels", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == bare["rows"]
    with pytest.raises(SystemExit):
        main(["budget", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in ("(default llama-3.3-70b)", "(default h100-sxm)", "GPUs (default 4)", "nvfp4 (default fp8)"):
        assert said in text
    assert main(["budget", "--dtype", "fp9"]) == 2
    assert capsys.readouterr().err == ("stallfree budget: error: dtype 'fp9' is not a known dtype; known: bf16, "
                                       "fp16, fp8, int4, int8, mxfp4, nvfp4\n")


def test_cost_model_errors_pickle_with_their_message():
    """An error worded for the flags still pickles (sent back from a worker process): its message, and a memory
    error's with_pp, come back as raised; the flag wording, a closure, is left behind."""
    import pickle

    for kw, kind in (({"tp": 3}, CostModelError), ({"tp": 1, "dtype": "bf16"}, CostModelMemoryError)):
        with pytest.raises(kind) as raised:
            CostModel.from_names("llama-3.3-70b", "h100-sxm", **kw)
        back = pickle.loads(pickle.dumps(raised.value))
        assert type(back) is kind and str(back) == str(raised.value)
        assert getattr(back, "with_pp", None) == getattr(raised.value, "with_pp", None)
        assert back.named(lambda f: "--" + f) == str(back)
