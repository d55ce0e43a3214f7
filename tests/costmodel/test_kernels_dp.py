"""Data-parallel attention on the measured-kernel backend (dp_attention D > 1): the package's tables for
attention_dp_size D, a step priced as one rank's even share of it (kernels.py's module docstring), checked against
the package's own estimator of the same build (whose batch is one rank's) and against its ops evaluated
directly; skipped when the optional package is absent."""

from __future__ import annotations

import pytest

from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import CostModelError, get_gpu, get_model
from stallfree.costmodel.kernels import kernels_installed

needs_kernels = pytest.mark.skipif(
    not kernels_installed(), reason="the optional package aiconfigurator-core (extra 'kernels') is not installed"
)


@pytest.fixture(scope="module")
def dp8():  # type: ignore[no-untyped-def]
    """DeepSeek-V3 fp8 on 8 H200s as 8 attention ranks of tp 1, experts over ep 8, SGLang's current tables."""
    from stallfree.costmodel.kernels import KernelCostModel

    return KernelCostModel(get_model("deepseek-v3"), get_gpu("h200"), 1, "fp8", engine="sglang", ep=8,
                           dp_attention=8)


def _chunks(n: int, tokens: int, start: int = 0) -> tuple[ScheduledChunk, ...]:
    return tuple(ScheduledChunk(i, tokens, True, start, True) for i in range(n))


@pytest.mark.parametrize(
    "model,tp,ep,dp,match",
    [
        ("llama-3.1-8b", 1, 1, 2, "dp_attention 2: llama-3.1-8b has no experts"),
        ("deepseek-v3", 1, 16, 8, r"ep 16 does not divide the replica's 8 GPUs \(tp 1 x dp_attention 8\)"),
        ("deepseek-v3", 1, 8, 0, "dp_attention must be an integer >= 1, got 0"),
    ],
)
def test_impossible_splits_are_refused_naming_the_field(model: str, tp: int, ep: int, dp: int, match: str) -> None:
    """The kernel backend refuses what the roofline refuses, before the package is asked (no package needed)."""
    from stallfree.costmodel.kernels import KernelCostModel

    with pytest.raises(CostModelError, match=match):
        KernelCostModel(get_model(model), get_gpu("h200"), tp, "fp8", engine="sglang", ep=ep, dp_attention=dp)


@needs_kernels
@pytest.mark.parametrize("per_rank,start", [(1, 512), (16, 2049)], ids=["1x512", "16x2049"])
def test_decodes_of_all_ranks_equal_the_estimator_of_one_rank(dp8, per_rank: int, start: int) -> None:  # type: ignore[no-untyped-def]
    """8 x b decodes of equal contexts over the replica equal the package's decode step of b (its batch is one
    rank's; s = isl + osl // 2 + 1 keys equal a decode at `start`), through decode_step_time and step_time."""
    est = dp8.tables.handle.decode_step_latency(per_rank, start - 1, 2) * 1e-3
    n = 8 * per_rank
    assert dp8.decode_step_time(n, start) == pytest.approx(est, rel=1e-9)
    plan = StepPlan(start, tuple(range(n)), (0,) * n, (), n, start * n, 8192)
    assert dp8.step_time_exact(plan) == pytest.approx(est, rel=1e-9)
    # one decode more: a rank's share rounds up to b + 1
    more = dp8.decode_step_time(n + 1, start)
    assert more == pytest.approx(dp8.tables.handle.decode_step_latency(per_rank + 1, start - 1, 2) * 1e-3, rel=1e-9)


@needs_kernels
def test_one_prompt_per_rank_equals_the_estimators_prefill(dp8) -> None:  # type: ignore[no-untyped-def]
    """8 prompts of 2,048 tokens, one per rank, equal the package's prefill of one prompt (per rank)."""
    est = dp8.tables.handle.predict_prefill_latency(1, 2048) * 1e-3
    plan = StepPlan(0, (), (), _chunks(8, 2048), 8 * 2048, 0, 8 * 2048)
    assert dp8.step_time(plan) == pytest.approx(est, rel=1e-9)


@needs_kernels
def test_a_mixed_step_is_one_ranks_even_share(dp8) -> None:  # type: ignore[no-untyped-def]
    """One chunk of 1,000 tokens beside 24 decodes at 3,001 keys, over 8 ranks: the package's shared ops at
    ceil(1,024 / 8) = 128 tokens per rank (its MoE ops count 8 x 128), the lm_head at ceil(25 / 8) = 4, an
    eighth of the chunk's attention, and the attention of ceil(24 / 8) = 3 decodes at 3,001 keys, each read
    from the tables directly."""
    h, tb = dp8.tables.handle, dp8.tables
    shared = sum(v[1] for v in h.evaluate_context_ops(list(tb.shared), batch_size=1, s=128))
    head = h.evaluate_context_ops([tb.logits], batch_size=1, s=4, x=4)[0][1]
    chunk = sum(v[1] for v in h.evaluate_context_ops([tb.chunk_attention], batch_size=1, s=1000, prefix=0))
    dec = sum(v[1] for v in h.evaluate_generation_ops([tb.decode_attention], batch_size=3, s=3001))
    want = (shared + head + chunk / 8 + dec) * 1e-3
    assert dp8.prefill_step_time(1000, 0, 24, 3000) == pytest.approx(want, rel=1e-9)
    plan = StepPlan(3000, tuple(range(24)), (0,) * 24, _chunks(1, 1000), 1024, 3000 * 24, 8192)
    assert dp8.step_time_exact(plan) == pytest.approx(want, rel=1e-9)
    assert dp8.step_time(plan) == pytest.approx(want, rel=1e-3)  # decode keys between knots: interpolated
