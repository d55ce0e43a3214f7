"""The measured-kernel backend on the newer decoders (MLA with shared experts and dense first layers,
windowed layers with sinks, 4-bit experts), checked against the package's own estimator of the same
model, system and engine (aiconfigurator-core's decode and prefill step latencies), which is an
independent evaluation of the same tables; skipped when the optional package is absent."""

from __future__ import annotations

import pytest

from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import CostModelError, get_gpu, get_model
from stallfree.costmodel.choice import choose_cost_model
from stallfree.costmodel.kernel_maps import PACKAGE_CONFIGS, quant_modes
from stallfree.costmodel.kernels import kernels_installed

needs_kernels = pytest.mark.skipif(
    not kernels_installed(), reason="the optional package aiconfigurator-core (extra 'kernels') is not installed"
)


def _km(model: str, gpu: str, tp: int, dtype: str, engine: str = "vllm"):  # type: ignore[no-untyped-def]
    from stallfree.costmodel.kernels import KernelCostModel

    return KernelCostModel(get_model(model), get_gpu(gpu), tp, dtype, engine=engine)


@pytest.fixture(scope="module")
def dsv3():  # type: ignore[no-untyped-def]
    """DeepSeek-V3 in its native block FP8 on 8 H200s, vLLM's current tables (built once)."""
    return _km("deepseek-v3", "h200", 8, "fp8")


@pytest.fixture(scope="module")
def oss20b():  # type: ignore[no-untyped-def]
    """gpt-oss-20b with MXFP4 experts on one H200, vLLM's current tables (the same system's database)."""
    return _km("gpt-oss-20b", "h200", 1, "mxfp4")


def _plan(step: int, offsets: tuple[int, ...], chunks: tuple[ScheduledChunk, ...] = ()) -> StepPlan:
    tokens = len(offsets) + sum(c.num_tokens for c in chunks)
    return StepPlan(step, tuple(range(len(offsets))), offsets, chunks, tokens, sum(offsets) + step * len(offsets), 8192)


def test_quant_modes_follow_the_checkpoint() -> None:
    """fp8 is block-scaled where the config says so (DeepSeek-V3's 128 x 128 blocks), per-tensor
    otherwise; mxfp4 prices MoE experts only; the MoE mode is None for a dense model."""
    block = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert quant_modes("fp8", block, True) == ("fp8_block", "fp8_block")
    assert quant_modes("fp8", {}, False) == ("fp8", None)
    assert quant_modes("mxfp4", {}, True) == ("bfloat16", "w4a16_mxfp4")
    assert quant_modes("int4", {}, True) == ("int4_wo", "int4_wo")
    assert quant_modes("nvfp4", {}, False) == ("nvfp4", None)
    with pytest.raises(CostModelError, match="'mxfp4'.*MoE experts only"):
        quant_modes("mxfp4", {}, False)
    with pytest.raises(CostModelError, match="'int8'"):
        quant_modes("int8", {}, False)


def test_mxfp4_experts_under_trtllm_on_blackwell_take_mxfp8_activations() -> None:
    """TensorRT-LLM runs MXFP4 experts with MXFP8 activations on SM >= 100 (its get_mxfp4_quant_algo), with
    bf16 activations below; the other engines keep the checkpoint's w4a16_mxfp4."""
    assert quant_modes("mxfp4", {}, True, "b200_sxm", "trtllm") == ("bfloat16", "w4a8_mxfp4_mxfp8")
    assert quant_modes("mxfp4", {}, True, "gb200", "trtllm") == ("bfloat16", "w4a8_mxfp4_mxfp8")
    assert quant_modes("mxfp4", {}, True, "h200_sxm", "trtllm") == ("bfloat16", "w4a16_mxfp4")
    assert quant_modes("mxfp4", {}, True, "b200_sxm", "vllm") == ("bfloat16", "w4a16_mxfp4")
    assert quant_modes("nvfp4", {}, True, "b200_sxm", "trtllm") == ("nvfp4", "nvfp4")


@needs_kernels
def test_gpt_oss_on_b200_trtllm_decodes_near_the_measured_tpot() -> None:
    """gpt-oss-120b on one B200 under TensorRT-LLM: a step of 4 decodes at 8,704 tokens of context (the middle
    of an 8,192 + 1,024 request) against the TPOT the package's bundled closed-loop row measured at
    concurrency 4 (silicon_sample.csv line 2715: 3.568 ms). With bf16-activation experts (w4a16_mxfp4) the
    tables price it at 8.03 ms; with TensorRT-LLM's MXFP8 activations at 3.43 ms."""
    km = _km("gpt-oss-120b", "b200", 1, "mxfp4", engine="trtllm")
    assert km.decode_step_time(4, 8704) == pytest.approx(3.568e-3, rel=0.10)


def test_int4_keeps_bf16_gemms_where_the_checkpoint_quantizes_experts_only() -> None:
    """A compressed-tensors INT4 checkpoint whose ignore list holds the attention (Kimi-K2.5: routed experts
    only) keeps bf16 GEMMs; without such a list int4 is weight-only INT4 everywhere."""
    kimi = {"text_config": {"quantization_config": {"quant_method": "compressed-tensors",
                                                    "ignore": ["lm_head", "re:.*self_attn.*"]}}}
    assert quant_modes("int4", kimi, True, "h200_sxm", "vllm") == ("bfloat16", "int4_wo")
    assert quant_modes("int4", {}, True, "h200_sxm", "vllm") == ("int4_wo", "int4_wo")


def test_every_package_config_names_a_preset() -> None:
    """Each preset handed the package's bundled config is one of ours."""
    for key in PACKAGE_CONFIGS:
        assert get_model(key).key == key


@needs_kernels
def test_deepseek_builds_the_packages_mla_graph(dsv3) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-V3 is built by the package's own DeepSeek class: its MLA block is the attention op
    and its decode graph (shared experts beside the routed ones) prices steps of decodes only."""
    tb = dsv3.tables
    # its op lists: embedding, norm, MLA block, norm, MoE (decode: an overlap of shared and routed
    # experts), lm_head, all-reduce, p2p
    assert (tb.chunk_attention, tb.decode_attention, tb.chunk_attentions) == (2, 2, ())
    assert tb.decode_shared == (0, 1, 3, 4, 6, 7) and tb.logits == 11


@needs_kernels
@pytest.mark.parametrize("decodes,start", [(1, 100), (32, 1025), (64, 4000)], ids=["1x100", "32x1025", "64x4000"])
def test_deepseek_decode_equals_the_package_estimator(dsv3, decodes: int, start: int) -> None:  # type: ignore[no-untyped-def]
    """Decodes of equal contexts equal the package's decode-step estimate (s = isl + osl // 2 + 1)."""
    est = dsv3.tables.handle.decode_step_latency(decodes, start - 1, 2) * 1e-3
    assert dsv3.decode_step_time(decodes, start) == pytest.approx(est, rel=1e-9)
    assert dsv3.step_time_exact(_plan(0, (start,) * decodes)) == pytest.approx(est, rel=1e-9)


@needs_kernels
@pytest.mark.parametrize("prompt", [512, 8192])
def test_deepseek_prefill_equals_the_package_estimator(dsv3, prompt: int) -> None:  # type: ignore[no-untyped-def]
    """One whole prompt equals the package's prefill estimate (its DeepSeek graph has the lm_head)."""
    est = dsv3.tables.handle.predict_prefill_latency(1, prompt) * 1e-3
    assert dsv3.prefill_step_time(prompt) == pytest.approx(est, rel=1e-9)


@needs_kernels
def test_deepseek_decode_reads_at_least_its_active_weights(dsv3) -> None:  # type: ignore[no-untyped-def]
    """A one-decode step is no faster than each GPU reading its share of the active weights once:
    37.6e9 active parameters x 1 byte (fp8) / 8 GPUs / 4.8e12 B/s (H200) = 0.98 ms."""
    assert dsv3.decode_step_time(1, 100) > get_model("deepseek-v3").active_params / 8 / 4.8e12


@needs_kernels
def test_gpt_oss_sums_its_windowed_and_full_layers(oss20b) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss has two attention ops (its 128-token sliding layers and its full layers); a step sums
    both, and equals the package's estimator on decodes; a prefill adds only our lm_head GEMM (the
    package's MoE family leaves it out of its prefill)."""
    tb = oss20b.tables
    assert len(tb.chunk_attentions) == 2 and len(tb.decode_attentions) == 2
    h = tb.handle
    parts = h.evaluate_generation_ops(list(tb.decode_attentions), batch_size=16, s=2048)
    assert oss20b.decode_exact_s(16, 2048) == pytest.approx(sum(v[1] for v in parts) * 1e-3, rel=1e-12)
    assert oss20b.decode_step_time(16, 2049) == pytest.approx(h.decode_step_latency(16, 2048, 2) * 1e-3, rel=1e-9)
    est = h.predict_prefill_latency(1, 4096) * 1e-3
    assert oss20b.prefill_step_time(4096) == pytest.approx(est + oss20b.logits_s(1), rel=1e-9)


@needs_kernels
def test_a_mixed_step_is_the_sum_of_its_terms(dsv3) -> None:  # type: ignore[no-untyped-def]
    """A step with a chunk prices the prefill graph's shared ops at T tokens (no decode overlap)."""
    chunk = ScheduledChunk("p", 500, True, 1024, True)
    plan = _plan(0, (1023, 1023), (chunk,))
    expected = dsv3.shared_s(502) + dsv3.logits_s(3) + dsv3.chunk_exact_s(500, 1024) + dsv3.decode_exact_s(2, 1024)
    assert dsv3.step_time(plan) == pytest.approx(expected, rel=1e-9)


@needs_kernels
def test_default_prices_deepseek_from_kernels(dsv3) -> None:  # type: ignore[no-untyped-def]
    """With no --kernels, DeepSeek-V3 is kernel-priced, from the same tables."""
    chosen = choose_cost_model("deepseek-v3", "h200", tp=8, dtype="fp8")
    assert chosen.name == "kernels" and chosen.source["system"] == "h200_sxm"
    assert chosen.cost_model.tables is dsv3.tables


@needs_kernels
def test_mxfp4_on_a_dense_model_falls_back_with_the_reason() -> None:
    """MXFP4 GEMMs for a dense model have no tables: the default prices it as today, saying why."""
    fell = choose_cost_model("qwen3-8b", "b200", tp=1, dtype="mxfp4")
    assert fell.name in ("floor", "calibrated")
    assert "'mxfp4'" in fell.source["fallback_reason"] and "no measured kernels" in fell.line


@needs_kernels
@pytest.mark.slow
def test_a_missing_4bit_table_falls_back_naming_it() -> None:
    """Kimi-K2 in int4 on H200: vLLM's tables there hold no int4_wo GEMMs; the default falls back
    to the roofline and the reason names the missing mode."""
    fell = choose_cost_model("kimi-k2", "h200", tp=8, dtype="int4")
    assert fell.name in ("floor", "calibrated")
    assert "int4_wo" in fell.source["fallback_reason"] and "no measured kernels" in fell.line


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize(
    "model,gpu,tp,dtype,engine,moe",
    [
        ("kimi-k2", "h200", 8, "fp8", "vllm", False),
        ("deepseek-v3", "h200", 8, "fp8", "sglang", False),
        ("deepseek-v3", "b200", 8, "nvfp4", "trtllm", False),
        ("llama-4-scout", "h200", 8, "bf16", "vllm", False),
        ("qwen3-235b-a22b", "h200", 4, "fp8", "vllm", True),  # block FP8: 1,536 / tp must be 128-aligned
        ("gpt-oss-120b", "h100-sxm", 1, "mxfp4", "vllm", True),
        ("qwen3-32b", "b200", 1, "nvfp4", "vllm", False),
    ],
)
def test_more_models_equal_the_package_estimator(
    model: str, gpu: str, tp: int, dtype: str, engine: str, moe: bool
) -> None:
    """Decodes equal the package's estimator; a prefill too, plus our lm_head for its MoE family."""
    km = _km(model, gpu, tp, dtype, engine)
    h = km.tables.handle
    assert km.decode_step_time(32, 1025) == pytest.approx(h.decode_step_latency(32, 1024, 2) * 1e-3, rel=1e-9)
    extra = km.logits_s(1) if moe else 0.0
    assert km.prefill_step_time(2048) == pytest.approx(h.predict_prefill_latency(1, 2048) * 1e-3 + extra, rel=1e-9)


@needs_kernels
def test_fp8_qwen3_moe_is_its_block_scaled_checkpoint() -> None:
    """fp8 Qwen3-235B-A22B is handed the package's Qwen3-235B-A22B-FP8 config (128 x 128 blocks, so
    fp8_block kernels); bf16 the plain one; a preset without an FP8 variant keeps its own."""
    from stallfree.costmodel.kernel_tables import package_config

    fp8, bf16 = package_config("qwen3-235b-a22b", "fp8"), package_config("qwen3-235b-a22b", "bf16")
    assert fp8 is not None and bf16 is not None
    assert fp8["quantization_config"]["weight_block_size"] == [128, 128]
    assert "quantization_config" not in bf16
    assert quant_modes("fp8", fp8, True) == ("fp8_block", "fp8_block")
    assert package_config("qwen3-8b", "fp8") == package_config("qwen3-8b", "bf16")
