"""A few-expert MoE (Mixtral) prices the steps that spread over every expert from balanced routing, the
package's power-law skew below that (stallfree.costmodel.kernel_tables.BALANCED_ROUTING_MAX_EXPERTS)."""

from __future__ import annotations

import pytest

from stallfree.costmodel import get_gpu, get_model
from stallfree.costmodel.kernel_tables import balanced_from
from stallfree.costmodel.kernels import kernels_installed

needs_kernels = pytest.mark.skipif(not kernels_installed(), reason="aiconfigurator-core is not installed")


@pytest.mark.parametrize(("config", "expected"), [
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, 8),      # Mixtral: ceil(2 x 8 / 2)
    ({"num_local_experts": 8, "num_experts_per_tok": 3}, 6),      # ceil(16 / 3)
    ({"num_experts": 128, "num_experts_per_tok": 8}, None),       # Qwen3-30B-A3B: the power law throughout
    ({"hidden_size": 4096}, None),                                # dense
    ({"num_local_experts": 8}, None),                             # no top-k given: nothing assumed
], ids=["mixtral", "top3", "qwen3-moe", "dense", "no-topk"])
def test_balanced_from_by_hand(config, expected):
    """Tokens x top-k >= 2 x experts, for an MoE of at most 8 experts."""
    assert balanced_from(config) == expected


@needs_kernels
@pytest.mark.slow
def test_mixtral_prices_a_spread_step_on_balanced_routing():
    """Mixtral-8x7B, TP 2, H100, vLLM's tables: a 4-token step keeps the skewed tables, a 64-token step reads
    the balanced ones, which the package measured lower there (its power-law MoE rows are 1.30 x its
    balanced rows at 64 tokens at moe_tp 2)."""
    from stallfree.costmodel.kernels import KernelCostModel

    km = KernelCostModel(get_model("mixtral-8x7b"), get_gpu("h100-sxm"), 2, "bf16", engine="vllm")
    assert km.balanced_from == 8 and km._balanced is not None

    def priced(tables, tokens):
        return sum(v[1] for v in tables.handle.evaluate_context_ops(list(tables.shared), batch_size=1, s=tokens))

    assert km.shared_s(4) == pytest.approx(priced(km.tables, 4) * 1e-3)
    assert km.shared_s(64) == pytest.approx(priced(km._balanced, 64) * 1e-3)
    assert priced(km._balanced, 64) < 0.9 * priced(km.tables, 64)
