"""Tests of the newer architectures: multi-head latent attention, shared experts, dense first layers,
windowed layers and sinks, 4-bit weights, and the DeepSeek, Kimi, Qwen3, gpt-oss and Llama 4 presets."""

from __future__ import annotations

import re
from importlib import util
from pathlib import Path

import pytest

from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import CostModel, CostModelError, get_gpu, get_model, load_model_file, model_from_hf_config
from stallfree.costmodel.hardware import gpu_from_dict, gpu_to_dict
from stallfree.costmodel.kernel_maps import PACKAGE_CONFIGS

# Published totals and active counts, the precision they were published at (half a unit of the last
# digit), and whether the publisher's active count includes the input embedding. DeepSeek, Moonshot
# and OpenAI count the active parameters without the embedding (gpt-oss's model card says so; the 37B
# and 32B agree only that way); Qwen and Meta with it (3.3B and 17B agree only that way).
PUBLISHED = {
    # key: (total, total tolerance, active, active tolerance, active counts the embedding)
    "deepseek-v3": (671e9, 0.5e9, 37e9, 0.5e9, False),  # DeepSeek-V3 README / arXiv 2412.19437
    "kimi-k2": (1e12, 0.05e12, 32e9, 0.5e9, False),  # Kimi-K2 model card: 1T total, 32B activated
    "qwen3-8b": (8.2e9, 0.05e9, 8.2e9, 0.05e9, True),  # Qwen3-8B model card
    "qwen3-32b": (32.8e9, 0.05e9, 32.8e9, 0.05e9, True),  # Qwen3-32B model card
    # 3.353B worked out against a published 3.3B: within 0.06B, not 0.05B (Qwen gives no breakdown; its
    # 29.9B non-embedding figure agrees to 0.01B, see the test below).
    "qwen3-30b-a3b": (30.5e9, 0.05e9, 3.3e9, 0.06e9, True),  # Qwen3-30B-A3B model card
    "qwen3-235b-a22b": (235e9, 0.5e9, 22e9, 0.5e9, True),  # Qwen3-235B-A22B model card
    "gpt-oss-20b": (20.91e9, 0.005e9, 3.61e9, 0.005e9, False),  # gpt-oss model card, Table 1
    "gpt-oss-120b": (116.83e9, 0.005e9, 5.13e9, 0.005e9, False),  # gpt-oss model card, Table 1
    # Meta's 109B is of the multimodal model; the text decoder alone is 107.8B (1.1% less): the vision
    # encoder is not in the text config, so this one total is checked to 1.5% only.
    "llama-4-scout": (109e9, 1.5e9, 17e9, 0.5e9, True),  # Llama 4 model card
    "llama-4-maverick": (400e9, 1e9, 17e9, 0.5e9, True),  # Llama 4 model card
}

_CONFIGS = (
    Path(util.find_spec("aiconfigurator_core").origin).parent / "model_configs"  # type: ignore[union-attr,arg-type]
    if util.find_spec("aiconfigurator_core") is not None
    else None
)
BUNDLED = PACKAGE_CONFIGS  # our presets whose config.json the package bundles


@pytest.mark.parametrize("key", sorted(PUBLISHED), ids=str)
def test_total_and_active_parameters_match_the_published_figures(key):
    """Each new preset's total and active parameters agree with the publisher's, to its precision."""
    m = get_model(key)
    total, t_tol, active, a_tol, with_embed = PUBLISHED[key]
    ours_active = m.active_params - (0 if with_embed else m.embed_params)
    assert abs(m.total_params - total) <= t_tol, m.total_params
    assert abs(ours_active - active) <= a_tol, ours_active


@pytest.mark.parametrize(
    "key,published",
    [("qwen3-8b", 6.95e9), ("qwen3-32b", 31.2e9), ("qwen3-30b-a3b", 29.9e9), ("qwen3-235b-a22b", 234e9)],
)
def test_qwen3_non_embedding_parameters_match_the_model_cards(key, published):
    """Qwen publishes non-embedding counts (6.95B, 31.2B, 29.9B, 234B): our layer parameters, to the
    precision published."""
    digits = {6.95e9: 0.005e9, 31.2e9: 0.05e9, 29.9e9: 0.05e9, 234e9: 0.5e9}[published]
    assert abs(get_model(key).layer_params - published) <= digits


def test_deepseek_v3_counts_by_hand():
    """DeepSeek-V3 by hand: 671.026B total (the fact sheet's recount), 3 dense layers and 58
    MoE layers of 256 routed plus 1 shared expert of 3 x 7168 x 2048 weights."""
    m = get_model("deepseek-v3")
    h, n_q = 7168, 128
    attn = (h * 1536 + 1536 + 1536 * n_q * 192) + (h * 576 + 512 + 512 * n_q * 256) + n_q * 128 * h
    expert = 3 * h * 2048
    dense_layer = attn + 2 * h + 3 * h * 18432
    moe_layer = attn + 2 * h + h * 256 + (256 + 1) * expert
    total = 3 * dense_layer + 58 * moe_layer + 2 * 129280 * h + h  # embedding, lm_head, final norm
    assert m.attention_params_per_layer == attn
    assert (m.num_dense_layers, m.num_moe_layers) == (3, 58)
    assert m.total_params == total
    assert round(total / 1e6) == 671_026


@pytest.mark.parametrize(
    "key,want",
    [
        ("deepseek-v3", 61 * (512 + 64) * 2),  # one latent and one rope key per layer: 70,272
        ("kimi-k2", 61 * (512 + 64) * 2),
        ("qwen3-8b", 2 * 36 * 8 * 128 * 2),
        ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),
        ("qwen3-235b-a22b", 2 * 94 * 4 * 128 * 2),
        ("gpt-oss-120b", 2 * 36 * 8 * 64 * 2),
        ("llama-4-maverick", 2 * 48 * 8 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_by_the_independent_formula(key, want):
    """KV bytes per token in bf16: 2 x L x n_kv x d x 2 (GQA), L x (kv_lora_rank + rope) x 2 (MLA)."""
    assert get_model(key).kv_bytes_per_token(2) == want


def test_mla_latent_is_not_split_across_tensor_parallel_ranks():
    """DeepSeek-V3's 70,272 B per token are on every one of 8 ranks; Qwen3-8B's 8 KV heads split 8 ways."""
    assert get_model("deepseek-v3").kv_bytes_per_token(2, tp=8) == 70_272
    assert get_model("qwen3-8b").kv_bytes_per_token(2, tp=8) == 2 * 36 * 1 * 128 * 2
    cm = CostModel(get_model("deepseek-v3"), get_gpu("h200"), tp=8, dtype="fp8")
    assert cm.kv_bytes_per_token_per_gpu == 70_272


def test_mla_attention_flops_per_pair():
    """DeepSeek-V3 per layer and (query, key) pair: 2 x 128 x (192 + 128) = 81,920 FLOPs as a prefill
    computes it, 2 x 128 x 576 + 2 x 128 x 512 = 278,528 for an absorbed decode (the fact sheet's)."""
    m = get_model("deepseek-v3")
    assert (m.attention_flops_per_pair, m.decode_flops_per_pair) == (81_920, 278_528)
    assert get_model("qwen3-8b").attention_flops_per_pair == 4 * 32 * 128


def test_mla_decode_step_prices_the_latent():
    """One DeepSeek-V3 decode at context 1000 on 8 H200s in fp8: attention FLOPs per GPU are
    61 x 278,528 x 1001 / 8 and KV bytes read are 70,272 x 1001 (the latent, whole on each rank)."""
    cm = CostModel(get_model("deepseek-v3"), get_gpu("h200"), tp=8, dtype="fp8")
    cost = cm.breakdown(_plan([1000]))
    m = cm.model
    want_flops = 2 * m.active_layer_params / 8 + 2 * m.vocab_size * m.hidden_size / 8 + 61 * 278_528 * 1001 / 8
    assert cost.flops == pytest.approx(want_flops, rel=1e-12)
    expert = m.num_moe_layers * m.expert_params_per_layer * 1 / 8
    fixed = (m.layer_params - m.routed_expert_params) * 1 / 8
    want_bytes = fixed + m.lm_head_params * 2 / 8 + 70_272 * 1001 + expert * 256 * (1 - (1 - 8 / 256))
    assert cost.bytes == pytest.approx(want_bytes, rel=1e-12)


def test_qwen3_moe_decoder_sparse_step_one_means_every_layer():
    """Qwen3-30B-A3B's decoder_sparse_step 1 and empty mlp_only_layers: all 48 layers are MoE."""
    m = get_model("qwen3-30b-a3b")
    assert (m.num_experts, m.experts_per_token, m.num_moe_layers, m.num_dense_layers) == (128, 8, 48, 0)
    assert m.norm_params_per_layer == 2 * 2048 + 2 * 128  # two RMSNorms plus q and k norms


def test_gpt_oss_windows_sinks_and_biases():
    """gpt-oss-120b: 18 of 36 layers slide over 128 tokens; 64 sinks per layer; biased experts."""
    m = get_model("gpt-oss-120b")
    assert (m.num_window_layers, m.sliding_window, m.attention_sinks, m.mlp_bias) == (18, 128, True, True)
    h, f = 2880, 2880
    assert m.expert_params_per_layer == 3 * h * f + 2 * f + h
    assert m.attention_params_per_layer == 2 * h * 4096 + 2 * h * 512 + 4096 + 2 * 512 + h + 64


def test_llama4_shared_expert_interleaving_and_chunked_layers():
    """Maverick: MoE on every second layer (24), a dense MLP of 16,384 on the others, one shared expert;
    three layers of four attend in chunks of 8192 tokens (36 windowed)."""
    m = get_model("llama-4-maverick")
    assert (m.num_moe_layers, m.num_dense_layers, m.dense_intermediate_size) == (24, 24, 16384)
    assert (m.num_shared_experts, m.num_window_layers, m.sliding_window) == (1, 36, 8192)
    assert get_model("llama-4-scout").num_moe_layers == 48


def _plan(decode_starts=(), chunk=None):
    """A StepPlan with decodes at the given starts and at most one chunk (num_tokens, start)."""
    prefills = () if chunk is None else (ScheduledChunk("p", chunk[0], True, chunk[1], False),)
    nd = len(decode_starts)
    return StepPlan(
        step=0,
        decode_rids=tuple(range(nd)),
        decode_offsets=tuple(decode_starts),
        prefills=prefills,
        num_tokens=nd + (chunk[0] if chunk else 0),
        decode_context_sum=sum(decode_starts),
        token_budget=1 << 20,
    )


def _brute_pairs(n: int, p: int, w: int) -> int:
    return sum(min(p + j + 1, w) for j in range(n))


@pytest.mark.parametrize("n,p", [(10, 0), (100, 0), (50, 100), (300, 40), (20, 500)])
def test_windowed_chunk_pairs_against_a_brute_force_sum(n, p):
    """gpt-oss-20b (12 of 24 layers windowed at 128): a chunk's attention FLOPs are the layer average
    of the full pairs and the brute-force windowed sum of min(position, 128)."""
    cm = CostModel(get_model("gpt-oss-20b"), get_gpu("h100-sxm"), dtype="mxfp4")
    full = n * p + n * (n + 1) / 2
    win = _brute_pairs(n, p, 128)
    pairs = 0.5 * full + 0.5 * win
    got = cm.breakdown(_plan(chunk=(n, p))).flops
    assert got == pytest.approx(2 * cm.model.active_layer_params * n + 24 * 4 * 64 * 64 * pairs, rel=1e-12)


def test_windowed_decode_caps_pairs_and_kv_at_the_window():
    """Two gpt-oss-20b decodes at context 10,000: windowed layers read 128 keys each, so the KV read is
    (0.5 x 20,000 + 0.5 x 256) x 49,152 bytes, plus the 2 tokens written."""
    cm = CostModel(get_model("gpt-oss-20b"), get_gpu("h100-sxm"), dtype="mxfp4")
    one = cm.breakdown(_plan([10_000, 10_000]))
    none = cm.breakdown(_plan([0, 0]))
    assert one.bytes - none.bytes == pytest.approx((0.5 * 20_000 + 0.5 * 256) * 49_152, rel=1e-12)


def test_four_bit_weights_bytes_and_peaks():
    """gpt-oss-120b in mxfp4 on an H100: decoder weights at 4.25 bits, embedding and lm_head 16-bit,
    GEMMs at the BF16 peak (weight-only); on a B200 mxfp4 runs at the FP4 peak of 9,000 TFLOP/s."""
    m = get_model("gpt-oss-120b")
    cm = CostModel(m, get_gpu("h100-sxm"), dtype="mxfp4")
    big = m.embed_params + m.lm_head_params
    assert cm.weight_bytes_per_gpu == pytest.approx((m.total_params - big) * 4.25 / 8 + big * 2)
    assert not cm.warnings and cm.kv_dtype == "bf16"
    b200 = CostModel(m, get_gpu("b200"), dtype="mxfp4")
    assert get_gpu("b200").peak_flops("mxfp4") == 9000e12
    tok = _plan(chunk=(4096, 0))
    lin = 2 * m.active_layer_params * 4096
    assert cm.breakdown(tok).compute_s == pytest.approx(lin / 989.4e12 + _attn(m, 4096) / 989.4e12)
    assert b200.breakdown(tok).compute_s == pytest.approx(lin / 9000e12 + _attn(m, 4096) / 2250e12)


def _attn(m, n):
    w = m.sliding_window
    full = n * (n + 1) / 2
    f = m.num_window_layers / m.num_layers
    win = (1 + w) * w / 2 + (n - w) * w
    return m.num_layers * m.attention_flops_per_pair * (full + f * (win - full))


def test_int4_weight_only_sizes():
    """INT4 in groups of 128 with a 16-bit scale is 4.125 bits; Qwen3-32B's decoder weights on an H100."""
    m = get_model("qwen3-32b")
    cm = CostModel(m, get_gpu("h100-sxm"), dtype="int4")
    big = m.embed_params + m.lm_head_params
    assert cm.weight_bytes_per_gpu == pytest.approx((m.total_params - big) * 4.125 / 8 + big * 2)


def test_four_bit_refusals_name_dtype_and_gpu():
    """NVFP4 without FP4 units, 4-bit weights on a GPU without weight-only kernels, and a 4-bit KV
    cache are refused, naming the dtype and the GPU."""
    with pytest.raises(CostModelError, match="nvfp4 needs FP4 Tensor cores.*h100-sxm"):
        CostModel(get_model("qwen3-8b"), get_gpu("h100-sxm"), dtype="nvfp4")
    with pytest.raises(CostModelError, match="int4 needs 4-bit weight-only GEMM kernels.*mi300x"):
        CostModel(get_model("qwen3-8b"), get_gpu("mi300x"), dtype="int4")
    with pytest.raises(CostModelError, match="kv_dtype mxfp4"):
        CostModel(get_model("qwen3-8b"), get_gpu("b200"), dtype="mxfp4", kv_dtype="mxfp4")
    CostModel(get_model("qwen3-8b"), get_gpu("b200"), dtype="nvfp4")  # Blackwell has FP4 units


def test_gpu_fp4_fields_round_trip():
    """fp4 peak and w4a16_kernels survive gpu_to_dict and gpu_from_dict."""
    for key in ("b200", "mi300x"):
        g = get_gpu(key)
        back = gpu_from_dict(key, gpu_to_dict(g))
        assert (back.fp4_flops_per_s, back.w4a16_kernels) == (g.fp4_flops_per_s, g.w4a16_kernels)


@pytest.mark.skipif(_CONFIGS is None, reason="aiconfigurator-core is not installed")
@pytest.mark.parametrize("key", sorted(BUNDLED), ids=str)
def test_bundled_config_json_loads_to_the_preset(key):
    """The public config.json each preset was read from loads to the same dimensions and counts."""
    assert _CONFIGS is not None
    m, want = load_model_file(_CONFIGS / f"{BUNDLED[key]}_config.json"), get_model(key)
    assert (m.total_params, m.active_params, m.kv_bytes_per_token(2)) == (
        want.total_params,
        want.active_params,
        want.kv_bytes_per_token(2),
    )
    assert (m.num_window_layers, m.sliding_window, m.num_dense_layers) == (
        want.num_window_layers,
        want.sliding_window,
        want.num_dense_layers,
    )


def test_unknown_layer_type_is_refused():
    """A layer_types entry other than full or sliding attention is refused, naming the field."""
    config = {"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 100, "layer_types": ["full_attention", "linear_attention"]}
    with pytest.raises(CostModelError, match="'layer_types'.*linear_attention"):
        model_from_hf_config("x", config)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", "abc"), ("head_dim", "x"), ("hidden_size", [1]), ("num_hidden_layers", 2.5),
     ("num_key_value_heads", True)],
)
def test_a_count_that_is_not_a_whole_number_is_refused(field, value):
    """A config.json count that is not a whole number is refused naming the field and the value, before any
    arithmetic on it (a qwen3 string hidden_size crashed on `2 * h + 2 * d`)."""
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, field: value}
    with pytest.raises(CostModelError, match=re.escape(f"field '{field}' must be a whole number >= 0, got {value!r}")):
        model_from_hf_config("x", config)


@pytest.mark.parametrize(
    "key,gpu,tp,dtype",
    [
        ("deepseek-v3", "h200", 8, "fp8"),
        ("gpt-oss-20b", "h100-sxm", 1, "mxfp4"),
        ("llama-4-scout", "h100-sxm", 4, "bf16"),
    ],
)
def test_pricing_entry_points_agree_on_the_new_models(key, gpu, tp, dtype):
    """step_time, breakdown, decode_step_time, prefill_step_time, prefill_breakdown (the budget
    table's parts) and max_tokens_within price the same step alike with MLA decodes and windowed layers."""
    cm = CostModel(get_model(key), get_gpu(gpu), tp=tp, dtype=dtype)
    dec = _plan([3000] * 16)
    assert cm.step_time(dec) == pytest.approx(cm.breakdown(dec).total_s, rel=1e-12)
    assert cm.step_time(dec) == pytest.approx(cm.decode_step_time(16, 3000), rel=1e-12)
    mixed = _plan([3000] * 16, chunk=(512, 200))
    prefill = cm.prefill_step_time(512, start=200, num_decodes=16, context_len=3000, is_last=False)
    assert cm.step_time(mixed) == pytest.approx(cm.breakdown(mixed).total_s, rel=1e-12)
    assert cm.step_time(mixed) == pytest.approx(prefill, rel=1e-12)
    parts = cm.prefill_breakdown(512, start=200, num_decodes=16, context_len=3000, is_last=False)
    assert parts.total_s == pytest.approx(prefill, rel=1e-12)
    last = StepPlan(0, tuple(range(16)), (3000,) * 16, (ScheduledChunk("p", 512, True, 200, True),),
                    528, 48_000, 1 << 20)
    target = cm.prefill_step_time(512, start=200, num_decodes=16, context_len=3000)
    assert cm.step_time(last) == pytest.approx(target, rel=1e-12)
    assert cm.max_tokens_within(target * (1 + 1e-9), 16, 48_000, chunk_start=200) >= 528
    assert cm.max_tokens_within(target * (1 - 1e-3), 16, 48_000, chunk_start=200) < 528


def test_speculative_decodes_cap_windowed_pairs_per_token():
    """Two gpt-oss-20b decodes of 3 tokens each at context 10,000: a windowed layer's pairs are capped
    at 6 x 128 (every token sees the window), not 2 x 128."""
    cm = CostModel(get_model("gpt-oss-20b"), get_gpu("h100-sxm"), dtype="mxfp4")
    plan = StepPlan(0, (0, 1), (10_000, 10_000), (), 6, 20_000, 1 << 20, decode_tokens=(3, 3))
    full = 3 * 20_000 + 6 * 4 / 2  # k x context sum + tokens x (k + 1) / 2, k = 3 tokens per decode
    pairs = 0.5 * full + 0.5 * 6 * 128
    m = cm.model
    want = m.num_layers * 4 * 64 * 64 * pairs
    base = cm.breakdown_counts(6, 0.0, 0.0, 2)
    # step_time prices the same compute as breakdown_counts with these pairs
    cost = cm.breakdown_counts(6, pairs, 0.5 * 20_000 + 0.5 * 256, 2)
    assert cost.flops - base.flops == pytest.approx(want, rel=1e-12)
    assert cm.step_time(plan) == pytest.approx(cost.total_s, rel=1e-12)


def test_calibration_counts_follow_the_model():
    """A measured step of 8 decodes (context sum 40,000) and a 300-token chunk at offset 200: for Llama
    3.1 8B the counts calibration prices are MeasuredStep.counts' plain ones; for gpt-oss-20b the
    windowed half of the layers sees at most 128 keys per token."""
    from stallfree.costmodel.measured import MeasuredStep

    step = MeasuredStep(308, 8, 40_000, 0.01, num_prefill_tokens=300, prefill_context_sum=200)
    _, pairs, kv, _ = step.counts()
    llama = CostModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    assert llama.attention_counts(300, 200, 8, 8, 40_000) == pytest.approx((pairs, kv), rel=1e-12)
    oss = CostModel(get_model("gpt-oss-20b"), get_gpu("h100-sxm"), dtype="mxfp4")
    win = _brute_pairs(300, 200, 128) + 8 * 128
    want = (0.5 * pairs + 0.5 * win, 0.5 * kv + 0.5 * (128 + 8 * 128))
    assert oss.attention_counts(300, 200, 8, 8, 40_000) == pytest.approx(want, rel=1e-12)
