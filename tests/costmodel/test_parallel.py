"""Expert parallelism (ep) and data-parallel attention (dp_attention) in the roofline cost model, worked
by hand from the model's counts and the GPU's specs (docs/costmodel.md), and their errors."""

from __future__ import annotations

import pytest

from stallfree.costmodel import CostModel, CostModelError, get_gpu, get_model
from stallfree.costmodel.choice import choose_cost_model


def _cm(model: str, tp: int, ep: int = 1, dp: int = 1, dtype: str = "fp8") -> CostModel:
    return CostModel(get_model(model), get_gpu("h200"), tp, dtype, ep=ep, dp_attention=dp)


@pytest.mark.parametrize(
    "model,tp,ep,dp,match",
    [
        ("llama-3.1-8b", 8, 2, 1, "ep 2: llama-3.1-8b has no experts"),
        ("llama-3.1-8b", 1, 1, 2, "dp_attention 2: llama-3.1-8b has no experts"),
        ("deepseek-v3", 8, 3, 1, "ep 3 does not divide the 256 routed experts of deepseek-v3"),
        ("deepseek-v3", 8, 16, 1, r"ep 16 does not divide the replica's 8 GPUs \(tp 8 x dp_attention 1\)"),
        ("deepseek-v3", 8, 0, 1, "ep must be an integer >= 1, got 0"),
        ("deepseek-v3", 8, 1, 0, "dp_attention must be an integer >= 1, got 0"),
    ],
)
def test_impossible_splits_name_the_field_and_value(model: str, tp: int, ep: int, dp: int, match: str) -> None:
    """Each split the model or the replica cannot take is refused, naming the field and its value."""
    with pytest.raises(CostModelError, match=match):
        _cm(model, tp, ep, dp, "bf16")


def test_pp_with_ep_is_refused() -> None:
    """ep and dp_attention are priced with pp 1 only."""
    with pytest.raises(CostModelError, match="not priced with pp 2"):
        CostModel(get_model("qwen3-235b-a22b"), get_gpu("h200"), 4, "fp8", pp=2, ep=4)


def test_ep_one_and_dp_one_price_as_before() -> None:
    """The default split is the tensor-parallel pricing, to the bit."""
    base = CostModel(get_model("deepseek-v3"), get_gpu("h200"), 8, "fp8")
    same = _cm("deepseek-v3", 8, 1, 1)
    assert same.decode_step_time(64, 4096) == base.decode_step_time(64, 4096)
    assert same.prefill_step_time(2048, 0, 16, 1000) == base.prefill_step_time(2048, 0, 16, 1000)


def test_dp_attention_stores_each_rank_s_latent_once() -> None:
    """DeepSeek-V3 fp8 on 8 H200s as 8 attention ranks of tp 1: per GPU the dense weights whole plus an
    eighth of the routed experts; each GPU keeps only its rank's sequences' 70,272-byte latents, so the
    replica's KV capacity is (0.9 x 141e9 - weights) // (70,272 / 8) tokens."""
    m = get_model("deepseek-v3")
    big = m.embed_params + m.lm_head_params
    routed = m.routed_expert_params
    weights = (m.total_params - big - routed) * 1 + big * 2 + routed / 8
    cm = _cm("deepseek-v3", 1, 8, 8)
    assert cm.weight_bytes_per_gpu == pytest.approx(weights, rel=1e-12)
    assert cm.kv_capacity_tokens(0.9) == int((0.9 * 141e9 - weights) // (70_272 / 8))
    tp8 = _cm("deepseek-v3", 8)
    assert cm.kv_capacity_tokens(0.9) > 4 * tp8.kv_capacity_tokens(0.9)  # the reason MLA runs DP attention
    assert cm.gpus == tp8.gpus == 8


def test_all_to_all_replaces_the_moe_all_reduce() -> None:
    """Qwen3-235B-A22B (94 MoE layers, top 8, h 4,096) on 4 H200s: with ep 4 each MoE layer's dispatch
    and combine move 2 x 8 x 3/4 x 4,096 x 2 B per token over 4 GPUs, against the all-reduce's
    2 x 3/4 x 4,096 x 2 B: the communication of a 1,000-token step grows by 94 x (3 - 1.5) x 8,192 B per
    token at the link's 450 GB/s."""
    tp4, ep4 = _cm("qwen3-235b-a22b", 4), _cm("qwen3-235b-a22b", 4, 4)
    a = tp4.prefill_breakdown(1000)
    b = ep4.prefill_breakdown(1000)
    per_tok = 94 * (2 * 8 * 0.75 / 4 - 2 * 0.75) * 4096 * 2 / 450e9
    assert b.comm_s - a.comm_s == pytest.approx(1000 * per_tok, rel=1e-9)
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-12)  # the same work per GPU, split differently


def test_dp_attention_keeps_the_work_per_gpu_and_reads_the_dense_weights_per_rank() -> None:
    """Qwen3-235B-A22B fp8 as 2 ranks of tp 2 against tp 4: per GPU the FLOPs are the same (dense work
    on half the tokens at half the split, experts over the same 4 GPUs) and so is the KV read (its 4 KV
    heads: 1 per GPU of all sequences, or 2 per GPU of half of them), but each GPU reads the dense
    weights and the lm_head (bf16) at tp 2, not 4: ((layer weights - routed experts) x 1 B + lm_head x 2 B)
    x (1/2 - 1/4) more at 4.8e12 B/s."""
    m = get_model("qwen3-235b-a22b")
    tp4, dp2 = _cm("qwen3-235b-a22b", 4), _cm("qwen3-235b-a22b", 2, 4, 2)
    a, b = tp4.prefill_breakdown(1, 0, 63, 30_000), dp2.prefill_breakdown(1, 0, 63, 30_000)
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-9)
    extra = ((m.layer_params - m.routed_expert_params) + 2 * m.lm_head_params) * (1 / 2 - 1 / 4) / 4.8e12
    assert b.memory_s - a.memory_s == pytest.approx(extra, rel=1e-9)


def test_the_default_prices_dp_attention_from_the_kernels_where_installed() -> None:
    """The default prices dp_attention from the kernel tables where the package is installed (the split
    is the roofline's, checked first), else by the roofline saying why."""
    from stallfree.costmodel.kernels import kernels_installed

    chosen = choose_cost_model("deepseek-v3", "h200", tp=1, dtype="fp8", ep=8, dp_attention=8)
    assert chosen.cost_model.dp_attention == 8
    if kernels_installed():
        assert chosen.name == "kernels" and chosen.cost_model.ep == 8
    else:
        assert chosen.name in ("floor", "calibrated") and "not installed" in chosen.source["fallback_reason"]
