"""Tests of the measured-kernel cost model (stallfree.costmodel.kernels) against the package's own
estimator and its tables read directly; skipped when the optional package is absent."""

from __future__ import annotations

import pickle
import random

import pytest

from stallfree import Request, Scheduler
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import CostModelError, get_gpu, get_model
from stallfree.costmodel.choice import choose_cost_model
from stallfree.costmodel.kernel_maps import SYSTEMS, config_from_spec, parse_kernels, system_for
from stallfree.costmodel.kernels import KNOTS, KernelsUnavailable, kernels_installed

needs_kernels = pytest.mark.skipif(
    not kernels_installed(), reason="the optional package aiconfigurator-core (extra 'kernels') is not installed"
)


@pytest.fixture(scope="module")
def llama8b():  # type: ignore[no-untyped-def]
    """Llama 3.1 8B on one H100 SXM, vLLM's current tables (built once for the module)."""
    from stallfree.costmodel.kernels import KernelCostModel

    return KernelCostModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), 1, "bf16", engine="vllm")


def _plan(step: int, offsets: tuple[int, ...], chunks: tuple[ScheduledChunk, ...] = ()) -> StepPlan:
    tokens = len(offsets) + sum(c.num_tokens for c in chunks)
    return StepPlan(step, tuple(range(len(offsets))), offsets, chunks, tokens, sum(offsets) + step * len(offsets), 8192)


def test_parse_kernels_names_bad_values() -> None:
    """ENGINE[:VERSION] parses to (engine, version), 'current' by default; an unknown engine is named."""
    assert parse_kernels("vllm") == ("vllm", "current")
    assert parse_kernels("sglang:next") == ("sglang", "next")
    assert parse_kernels("none") == ("none", "")
    with pytest.raises(CostModelError, match="'tgi'"):
        parse_kernels("tgi")
    with pytest.raises(CostModelError, match="empty"):
        parse_kernels("vllm:")


def test_gpu_mapping_is_a_table() -> None:
    """Our GPU presets map onto the package's systems by table; one without tables says why."""
    assert system_for("h100-sxm") == "h100_sxm" and system_for("h200") == "h200_sxm"
    assert system_for("a100-sxm-80gb") == "a100_sxm" and system_for("l40s") == "l40s"
    assert system_for("rtx-pro-6000") == "rtx_pro_6000_server"  # the package's server edition tables
    with pytest.raises(CostModelError, match="'h100-pcie'.*no measured tables"):
        system_for("h100-pcie")
    with pytest.raises(CostModelError, match="'l4'"):
        system_for("l4")


def test_config_from_preset_carries_the_dimensions() -> None:
    """The config.json written for the package carries the preset's dimensions (Qwen3-14B's card)."""
    cfg = config_from_spec(get_model("qwen3-14b"))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (40, 5120, 40)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (8, 128, 17408)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (151936, 40960)
    moe = config_from_spec(get_model("mixtral-8x22b"))
    assert moe["architectures"] == ["MixtralForCausalLM"]
    assert (moe["num_local_experts"], moe["num_experts_per_tok"]) == (8, 2)
    with pytest.raises(CostModelError, match="gated_mlp"):
        config_from_spec(get_model("falcon-180b"))


def test_knots_are_increasing_and_fine_at_short_contexts() -> None:
    """KNOTS start every 256 tokens to 1,024, then two per doubling."""
    assert KNOTS[:7] == (0, 256, 512, 768, 1024, 1536, 2048)
    assert KNOTS[7:10] == (3072, 4096, 6144)
    assert all(b > a for a, b in zip(KNOTS, KNOTS[1:], strict=False))


def test_default_falls_back_with_the_reason_for_a_gpu_without_tables() -> None:
    """With no --kernels, a GPU the package has no tables for is priced as today, with the reason."""
    chosen = choose_cost_model("llama-3.1-8b", "l4", tp=1, dtype="bf16")
    assert chosen.name in ("floor", "calibrated")
    why = "'l4'" if kernels_installed() else "not installed"
    assert why in chosen.source["fallback_reason"] and "no measured kernels" in chosen.line


def test_kernels_given_but_unavailable_is_an_error() -> None:
    """--kernels vllm on a GPU without tables is an error naming the GPU."""
    with pytest.raises(CostModelError, match="'l4'"):
        choose_cost_model("llama-3.1-8b", "l4", tp=1, kernels="vllm")


@needs_kernels
def test_unknown_version_lists_the_slots() -> None:
    """A version the package does not serve is refused with the slots it serves."""
    with pytest.raises(KernelsUnavailable, match="current = 0.24.0"):
        choose_cost_model("llama-3.1-8b", "h100-sxm", kernels="vllm:0.1.0")


@needs_kernels
@pytest.mark.parametrize("decodes,start", [(1, 100), (32, 1025), (64, 4000)], ids=["1x100", "32x1025", "64x4000"])
def test_decode_step_equals_the_package_estimator(llama8b, decodes: int, start: int) -> None:  # type: ignore[no-untyped-def]
    """Decodes of equal contexts: our composition equals the package's decode-step estimator
    (its s = isl + osl // 2 + 1 keys; a decode at start p attends to p + 1 keys)."""
    est = llama8b.tables.handle.decode_step_latency(decodes, start - 1, 2) * 1e-3
    assert llama8b.decode_step_time(decodes, start) == pytest.approx(est, rel=1e-9)
    plan = _plan(0, (start,) * decodes)
    assert llama8b.step_time_exact(plan) == pytest.approx(est, rel=1e-9)


@needs_kernels
@pytest.mark.parametrize("prompt", [512, 2048, 8192])
def test_prefill_equals_the_package_estimator(llama8b, prompt: int) -> None:  # type: ignore[no-untyped-def]
    """One whole prompt: our composition equals the package's prefill estimator."""
    est = llama8b.tables.handle.predict_prefill_latency(1, prompt) * 1e-3
    assert llama8b.prefill_step_time(prompt) == pytest.approx(est, rel=1e-9)


@needs_kernels
@pytest.mark.parametrize("chunk,decodes", [(512, 32), (1024, 64), (2000, 8)], ids=["512+32", "1024+64", "2000+8"])
def test_mixed_step_within_the_lm_head_of_the_estimator(llama8b, chunk: int, decodes: int) -> None:  # type: ignore[no-untyped-def]
    """A whole prompt of c tokens beside decodes at start c + 1: within 0.3% of the package's mixed
    step (its shapes: isl = c, osl 2, one chunk); the rest is where the lm_head positions are priced."""
    est = llama8b.tables.handle.mixed_step_latency(chunk, decodes, chunk, 2, 0, 1.0, 1.0) * 1e-3
    ours = llama8b.prefill_step_time(chunk, 0, decodes, chunk + 1, is_last=True)
    assert ours == pytest.approx(est, rel=3e-3)


@needs_kernels
def test_terms_read_from_the_tables_directly(llama8b) -> None:  # type: ignore[no-untyped-def]
    """A mixed step is the sum of its terms, each as the package's op evaluation gives it."""
    h, tb = llama8b.tables.handle, llama8b.tables
    chunk = ScheduledChunk("p", 500, True, 1024, True)
    plan = _plan(0, (1023, 1023), (chunk,))  # decodes attend to 1,024 keys and the chunk sits at 1,024: knots
    shared = sum(v[1] for v in h.evaluate_context_ops(list(tb.shared), batch_size=1, s=502)) * 1e-3
    logits = h.evaluate_context_ops([tb.logits], batch_size=1, s=3, x=3)[0][1] * 1e-3
    attn = h.evaluate_context_ops([tb.chunk_attention], batch_size=1, s=500, prefix=1024)[0][1] * 1e-3
    dec = h.evaluate_generation_ops([tb.decode_attention], batch_size=2, s=1024)[0][1] * 1e-3
    assert llama8b.step_time(plan) == pytest.approx(shared + logits + attn + dec, rel=1e-9)


@needs_kernels
def test_each_decode_is_priced_at_its_own_context(llama8b) -> None:  # type: ignore[no-untyped-def]
    """Two decodes at different contexts cost the mean of a 2-batch at each context (not at the mean)."""
    plan = _plan(0, (100, 5000))
    a, b = llama8b.decode_exact_s(2, 101), llama8b.decode_exact_s(2, 5001)
    expected = llama8b.shared_s(2) + llama8b.logits_s(2) + (a + b) / 2
    assert llama8b.step_time_exact(plan) == pytest.approx(expected, rel=1e-12)
    assert llama8b.step_time(plan) == pytest.approx(expected, rel=5e-3)  # 5,001 keys lie between knots


@needs_kernels
def test_bucketing_error_is_small_on_scheduler_plans(llama8b) -> None:  # type: ignore[no-untyped-def]
    """On seeded random scheduler plans the buckets stay within 0.5% of unbucketed pricing."""
    rng = random.Random(7)
    s = Scheduler(token_budget=2048, max_seqs=64, kv_tokens=2_000_000)
    for rid in range(120):
        s.add(Request(rid, rng.randint(10, 6000), rng.randint(1, 400)))
    worst, n = 0.0, 0
    while s.has_unfinished() and n < 400:
        plan = s.schedule()
        if n % 8 == 0 and plan.num_tokens:
            exact = llama8b.step_time_exact(plan)
            worst = max(worst, abs(llama8b.step_time(plan) - exact) / exact)
        s.complete(plan)
        n += 1
    assert worst < 5e-3


@needs_kernels
def test_mixtral_moe_matches_the_estimator_on_decodes() -> None:
    """Mixtral-8x22B at tp 8: decode steps equal the estimator, with its default (power-law) routing below
    8 tokens and balanced routing from 8 tokens on (kernel_tables.BALANCED_ROUTING_MAX_EXPERTS); a prefill
    adds only our lm_head GEMM (the package's MoE family leaves it out of its prefill)."""
    from stallfree.costmodel.kernels import KernelCostModel

    km = KernelCostModel(get_model("mixtral-8x22b"), get_gpu("h100-sxm"), 8, "bf16", engine="vllm")
    h = km.tables.handle
    assert km._balanced is not None
    balanced = km._balanced.handle
    assert km.decode_step_time(4, 1025) == pytest.approx(h.decode_step_latency(4, 1024, 2) * 1e-3, rel=1e-9)
    assert km.decode_step_time(32, 1025) == pytest.approx(balanced.decode_step_latency(32, 1024, 2) * 1e-3,
                                                          rel=1e-9)
    est = balanced.predict_prefill_latency(1, 2048) * 1e-3
    assert km.prefill_step_time(2048) == pytest.approx(est + km.logits_s(1), rel=1e-9)


@needs_kernels
def test_pickles_as_its_arguments(llama8b) -> None:  # type: ignore[no-untyped-def]
    """A pickled kernel model rebuilds to the same prices (worker processes)."""
    clone = pickle.loads(pickle.dumps(llama8b))
    plan = _plan(3, (10, 700, 3000), (ScheduledChunk("p", 64, True, 0, False),))
    assert clone.step_time(plan) == llama8b.step_time(plan)


@needs_kernels
def test_default_choice_names_the_tables() -> None:
    """With no --kernels and tables for the GPU, vLLM's current tables price the steps, said in one line."""
    chosen = choose_cost_model("llama-3.1-8b", "h100-sxm", tp=1)
    assert chosen.name == "kernels"
    assert chosen.source["engine"] == "vllm" and chosen.source["version"] == "0.24.0"
    assert chosen.source["chosen_by"] == "default" and chosen.source["system"] == "h100_sxm"
    assert chosen.line == "steps priced by measured vllm 0.24.0 kernels (aiconfigurator-core)"


@needs_kernels
def test_a100_current_is_its_own_slot() -> None:
    """A100's vLLM current slot is 0.14.0 (the package's per-system override)."""
    chosen = choose_cost_model("llama-3.1-8b", "a100-sxm-80gb", tp=1, kernels="vllm")
    assert chosen.source["version"] == "0.14.0"


def test_every_mapped_system_is_distinct() -> None:
    """No two of our GPUs map onto one system."""
    assert len(set(SYSTEMS.values())) == len(SYSTEMS)


@needs_kernels
def test_budget_kernel_column_prices_the_budget_steps(llama8b, capsys) -> None:  # type: ignore[no-untyped-def]
    """`stallfree budget --kernels vllm --json` adds per-row kernel figures equal to the model's own."""
    import json

    from stallfree.cli import main

    argv = ["budget", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--tp", "1", "--dtype", "bf16",
            "--budgets", "512,2048", "--decodes", "16", "--context", "1000", "--prompt", "4000", "--kernels", "vllm",
            "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost_model"] == "kernels" and out["cost_model_source"]["version"] == "0.24.0"
    row = out["rows"][1]
    step = llama8b.prefill_step_time(2048 - 16, 0, 16, 1000, is_last=False)
    assert row["kernels"]["step_ms"] == pytest.approx(step * 1e3, rel=1e-12)
    assert row["kernels"]["decode_step_ms"] == pytest.approx(llama8b.decode_step_time(16, 1000) * 1e3, rel=1e-12)


def test_without_the_package_the_default_falls_back(monkeypatch) -> None:
    """With the package hidden, the default says it is not installed and --kernels vllm is an error."""
    import stallfree.costmodel.kernel_tables as t
    import stallfree.costmodel.kernels as k

    monkeypatch.setattr(k, "kernels_installed", lambda: False)
    monkeypatch.setattr(t, "_import_package", lambda: (_ for _ in ()).throw(KernelsUnavailable("not installed")))
    monkeypatch.setattr(t, "_TABLES", {})
    monkeypatch.setenv("STALLFREE_CACHE_DIR", "/nonexistent-stallfree-cache")
    chosen = choose_cost_model("llama-3.1-8b", "h100-sxm", tp=1)
    assert chosen.name == "floor" and "not installed" in chosen.source["fallback_reason"]
    with pytest.raises(KernelsUnavailable, match="not installed"):
        choose_cost_model("llama-3.1-8b", "h100-sxm", tp=1, kernels="vllm")


@needs_kernels
def test_rtx_pro_6000_is_priced_from_its_tables() -> None:
    """The RTX PRO 6000 preset is priced from the package's rtx_pro_6000_server vLLM tables, equal to the
    package's own decode estimator on equal contexts, and no faster than reading the weights once
    (16.06e9 B of Llama-3.1-8B bf16 at 1.792e12 B/s = 8.96 ms)."""
    from stallfree.costmodel.kernels import KernelCostModel

    km = KernelCostModel(get_model("llama-3.1-8b"), get_gpu("rtx-pro-6000"), 1, "bf16", engine="vllm")
    assert km.tables.system == "rtx_pro_6000_server"
    est = km.tables.handle.decode_step_latency(32, 1024, 2) * 1e-3
    assert km.decode_step_time(32, 1025) == pytest.approx(est, rel=1e-9)
    assert km.decode_step_time(1, 100) > 16.06e9 / 1.792e12


@pytest.mark.slow  # builds a TP-2/TP-4 table set and reads parquet tables: 1-3 s
@needs_kernels
def test_allreduce_priced_from_the_runs_engine_version() -> None:
    """A vLLM 0.19.0 run on 2 x RTX PRO 6000 has its all-reduces priced from the package's 0.19.0 table of
    that system: at 128 tokens of Llama-3.1-8B (128 x 4,096 = 524,288 elements, a measured size) each
    all-reduce op is scaled by 0.0915194 / 0.0301462 ms = 3.0358 (the two tables' values there); the other
    ops are unchanged. A version with no older table (0.12.0) or the tables' own (0.24.0) changes nothing."""
    from stallfree.costmodel.kernels import KernelCostModel

    spec, gpu = get_model("llama-3.1-8b"), get_gpu("rtx-pro-6000")
    own = KernelCostModel(spec, gpu, 2, "bf16", engine="vllm")
    run = KernelCostModel(spec, gpu, 2, "bf16", engine="vllm", comm_version="0.19.0")
    assert run.comm_table == "0.19.0" and "all-reduce from vllm 0.19.0's table" in run.description
    ops = own.tables.handle.evaluate_context_ops(list(own.tables.shared), batch_size=1, s=128)
    ar_ms = sum(v[1] for v in ops if str(v[0]) in ("context_ar_1", "context_ar_2", "context_embedding_ar"))
    assert ar_ms > 0
    assert (run.shared_s(128) - own.shared_s(128)) * 1e3 == pytest.approx(ar_ms * (0.0915194 / 0.0301462 - 1), rel=1e-4)
    for same in ("0.12.0", "0.24.0"):
        km = KernelCostModel(spec, gpu, 2, "bf16", engine="vllm", comm_version=same)
        assert km.comm_table is None and km.shared_s(128) == own.shared_s(128)
    assert pickle.loads(pickle.dumps(run)).comm_table == "0.19.0"


@pytest.mark.slow  # builds a TP-2/TP-4 table set and reads parquet tables: 1-3 s
@needs_kernels
def test_allreduce_on_more_than_two_pcie_gpus_is_nccl() -> None:
    """vLLM on 4 x L40S (PCIe only) all-reduces with NCCL, its custom all-reduce being off: at 128 tokens
    of Llama-3.1-8B (524,288 elements, a measured size) each all-reduce op is scaled from the custom
    table's 0.360600 ms to NCCL's 0.268300 ms (the package's tables there); on 2 x L40S nothing changes."""
    from stallfree.costmodel.kernels import KernelCostModel

    spec, gpu = get_model("llama-3.1-8b"), get_gpu("l40s")
    km = KernelCostModel(spec, gpu, 4, "bf16", engine="vllm")
    assert km.comm_table == "nccl" and "all-reduce from NCCL's table" in km.description
    ops = km.tables.handle.evaluate_context_ops(list(km.tables.shared), batch_size=1, s=128)
    ar = [v[1] for v in ops if str(v[0]) in ("context_ar_1", "context_ar_2")]
    assert sum(ar) / 64 == pytest.approx(0.3606, rel=1e-3)  # the package reads the custom table, per layer
    rest = sum(v[1] for v in ops) - sum(v[1] for v in ops if str(v[0]).endswith(("_ar", "_ar_1", "_ar_2")))
    embed = sum(v[1] for v in ops if str(v[0]) == "context_embedding_ar")
    assert km.shared_s(128) * 1e3 == pytest.approx(rest + (sum(ar) + embed) * 0.2683 / 0.3606, rel=1e-4)
    assert KernelCostModel(spec, gpu, 2, "bf16", engine="vllm").comm_table is None
