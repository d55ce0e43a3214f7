"""Tests of CostModel: DESIGN.md section 2's numbers, the full formulas by hand, and bad configurations."""

from __future__ import annotations

import random
import warnings

import pytest

from stallfree import Request, ScheduledChunk, Scheduler, StepPlan
from stallfree.costmodel import CostModel, CostModelError, CostModelWarning, ModelSpec, get_gpu


def _plan(decode_starts=(), chunks=(), decode_tokens=None):
    """A StepPlan with decodes at the given starts and chunks given as (num_tokens, start, is_last)."""
    prefills = tuple(ScheduledChunk(f"p{i}", n, True, s, last) for i, (n, s, last) in enumerate(chunks))
    nd = len(decode_starts)
    dec = sum(decode_tokens) if decode_tokens else nd
    return StepPlan(
        step=0,
        decode_rids=tuple(range(nd)),
        decode_offsets=tuple(decode_starts),
        prefills=prefills,
        num_tokens=dec + sum(n for n, _, _ in chunks),
        decode_context_sum=sum(decode_starts),
        token_budget=1 << 20,
        decode_tokens=tuple(decode_tokens) if decode_tokens else None,
    )


@pytest.fixture(scope="module")
def design():
    return CostModel.from_names("llama-3.3-70b", "h100-sxm", tp=4, dtype="fp8", mode="design")


@pytest.fixture(scope="module")
def full():
    return CostModel.from_names("llama-3.3-70b", "h100-sxm", tp=4, dtype="fp8")


@pytest.mark.parametrize("budget,ms", [(512, 9.1), (2048, 36.5), (8192, 146.0)], ids=str)
def test_design_budget_step_times(design, budget, ms):
    """Design mode: budget x 2 x 70.55e9 / (4 x 1,978.9e12) gives 9.1, 36.5 and 146.0 ms."""
    plan = _plan([4096] * 64, [(budget - 64, 0, False)])
    t = design.step_time(plan)
    assert round(t * 1e3, 1) == ms
    assert t == pytest.approx(budget * 2 * 70_553_706_496 / (4 * 1978.9e12), rel=1e-12)


def test_design_decode_floor(design):
    """Design mode: a decode-only step reads the weights once: 70.55e9 B / 4 / 3.35e12 B/s = 5.3 ms."""
    t = design.decode_step_time(64, 4096)
    assert round(t * 1e3, 1) == 5.3
    assert t == pytest.approx(70_553_706_496 / 4 / 3.35e12, rel=1e-12)


def test_full_budget_2048_by_hand(full):
    """Full mode at budget 2,048 (64 decodes at 4,096, a 1,984-token chunk) matches the formulas by hand."""
    lin = 2048 * 2 * 68_452_352_000 / 4 / 1978.9e12
    head = 64 * 2 * 128_256 * 8192 / 4 / 989.4e12
    attn = (1984 * 1985 / 2 + 64 * 4097) * 4 * 80 * 64 * 128 / 4 / 989.4e12
    mem = ((68_452_352_000 * 1 + 1_050_673_152 * 2) / 4 + (64 * 4096 + 2048) * 81_920) / 3.35e12
    comm = 2 * 80 * 2 * 3 / 4 * 2048 * 8192 * 2 / 450e9
    want = max(lin + head + attn, mem) + comm
    plan = _plan([4096] * 64, [(1984, 0, False)])
    assert full.step_time(plan) == pytest.approx(want, rel=1e-12)
    assert full.step_time(plan) * 1e3 == pytest.approx(54.83, abs=0.01)
    parts = full.breakdown(plan)
    assert parts.comm_s == pytest.approx(comm) and parts.memory_s == pytest.approx(mem)
    assert parts.total_s == pytest.approx(want)


def test_full_shows_what_design_misses(full, design):
    """At long context the full model adds attention, KV reads and all-reduce time that design mode omits."""
    long = _plan([32768] * 64, [(1984, 32768, False)])
    assert full.breakdown(long).comm_s > 0.017
    assert full.step_time(long) > 1.5 * design.step_time(long)
    assert full.decode_step_time(64, 32768) > 5 * design.decode_step_time(64, 32768)


def test_step_time_matches_helpers(full):
    """step_time of a built plan equals prefill_step_time and decode_step_time for the same work."""
    plan = _plan([1000] * 8, [(300, 700, True)])
    assert full.step_time(plan) == pytest.approx(full.prefill_step_time(300, 700, 8, 1000, is_last=True))
    assert full.step_time(_plan([1000] * 8)) == pytest.approx(full.decode_step_time(8, 1000))


def test_step_time_uses_sums_not_decodes(full):
    """Pricing reads num_decodes and decode_context_sum: a plan whose decodes cannot be iterated prices."""

    class NoIter(StepPlan):
        __slots__ = ()

        @property
        def decodes(self):
            raise AssertionError("step_time iterated the decodes")

    base = _plan([10, 20, 30], [(5, 0, True)])
    plan = NoIter(0, base.decode_rids, (10, 20, 30), base.prefills, base.num_tokens, 60, 1 << 20)
    assert full.step_time(plan) == pytest.approx(full.step_time(base))
    # Only the sum of contexts matters, not how it is spread over the decodes.
    assert full.step_time(_plan([0, 60])) == pytest.approx(full.step_time(_plan([30, 30])))


def test_scheduler_plans_price(full):
    """Real plans from the Scheduler price to positive times that grow with the prompt's offset."""
    s = Scheduler(token_budget=512, max_seqs=8, kv_tokens=100_000)
    s.add(Request("a", 2000, 4))
    times = []
    while s.has_unfinished():
        plan = s.schedule()
        times.append(full.step_time(plan))
        s.complete(plan)
    assert len(times) == 7 and all(t > 0 for t in times)
    assert times[0] < times[1] < times[2]  # same chunk size, later offset, more attention


def test_empty_plan_costs_nothing(full):
    """An empty plan takes 0 seconds, even with an overhead configured."""
    assert full.replace(overhead_s=0.01).step_time(_plan()) == 0.0


def test_efficiencies_and_overhead_scale(full):
    """mfu 0.5 doubles compute time, overhead adds a constant, and defaults are floors."""
    plan = _plan([100] * 4, [(4000, 0, True)])
    base = full.breakdown(plan)
    slow = full.replace(mfu=0.5, overhead_s=0.002).breakdown(plan)
    assert slow.compute_s == pytest.approx(2 * base.compute_s)
    assert slow.total_s == pytest.approx(max(slow.compute_s, slow.memory_s) + slow.comm_s + 0.002)
    assert slow.total_s > base.total_s


def test_speculative_decodes_use_mean_tokens(full):
    """Decodes with 2 tokens each cost the same as the mean-token formula (k x context + k(k+1)/2 pairs)."""
    plan = _plan([100, 300], decode_tokens=[2, 2])
    pairs = 2 * 400 + 4 * 3 / 2
    assert full.step_time(plan) == pytest.approx(full.breakdown_counts(4, pairs, 400, 2).total_s)


def test_kv_capacity_by_hand(full):
    """Llama 70B FP8 on 4 x H100: (72e9 - 72.65e9 / 4) // 81,920 B = 657,180 tokens."""
    weights = (68_452_352_000 + 8192) * 1 + 2 * 1_050_673_152 * 2
    assert full.kv_capacity_tokens() == int((80e9 * 0.9 - weights / 4) // 81_920) == 657_180
    assert full.replace(kv_dtype="fp8").kv_capacity_tokens() == int((80e9 * 0.9 - weights / 4) // 40_960)


def test_kv_heads_replicated_beyond_tp():
    """KV heads split over tp: Qwen2.5 7B (4 KV heads) at tp 4, Llama 3.1 8B (8) at tp 8: one per GPU."""
    cm = CostModel.from_names("qwen2.5-7b", "h100-sxm", tp=4)
    assert cm.kv_bytes_per_token_per_gpu == 2 * 28 * 1 * 128 * 2
    llama = CostModel.from_names("llama-3.1-8b", "h100-sxm", tp=4)
    llama16 = CostModel.from_names("llama-3.1-8b", "h100-sxm", tp=16 // 2)
    assert llama.kv_bytes_per_token_per_gpu == 2 * 32 * 2 * 128 * 2
    assert llama16.kv_bytes_per_token_per_gpu == 2 * 32 * 1 * 128 * 2  # 8 heads over 8 GPUs


def test_kv_replicated_when_tp_exceeds_kv_heads():
    """Llama 2 70B has 8 KV heads; at tp 16 (64 query heads) each GPU keeps one replicated KV head."""
    cm = CostModel.from_names("llama-2-70b", "h100-sxm", tp=16)
    assert cm.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2


def test_fp8_on_a100_warns_and_uses_bf16_peak():
    """Weight-only FP8 on A100 (no FP8 units) runs at the 312 TFLOP/s BF16 peak, with a warning."""
    with pytest.warns(CostModelWarning, match="no fp8 units"):
        cm = CostModel.from_names("llama-3.1-8b", "a100", tp=1, dtype="fp8", mode="design")
    assert cm.prefill_step_time(1000) == pytest.approx(1000 * 2 * 8_030_261_248 / 312e12)
    assert cm.warnings


def test_mixtral_reads_more_experts_with_more_tokens():
    """Mixtral: one token reads 2 of 8 experts per layer; a 64-token step reads nearly all 8."""
    cm = CostModel.from_names("mixtral-8x7b", "h100-sxm", tp=2)
    one = cm.breakdown_counts(1, 1, 0, 1).bytes
    many = cm.breakdown_counts(64, 64, 0, 64).bytes
    expert = 32 * 3 * 4096 * 14336 * 2 / 2
    assert many - one == pytest.approx(
        expert * 8 * (0.75 - 0.75**64) + 63 * cm.kv_bytes_per_token_per_gpu, rel=1e-9
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tp": 3}, "tp 3 does not divide the 64 attention heads"),
        ({"tp": 0}, "tp must be an integer >= 1"),
        ({"tp": -2}, "tp must be an integer >= 1"),
        ({"tp": 1, "dtype": "bf16", "model": "llama-3.1-405b", "gpu": "h100-sxm"}, "need 811.7 GB per GPU"),
        ({"tp": 1, "mode": "fast"}, "mode must be one of"),
        ({"tp": 4, "dtype": "fp2"}, "dtype 'fp2' is not a known dtype"),
        ({"tp": 4, "mfu": 1.5}, r"mfu must be in \(0, 1\]"),
        ({"tp": 4, "overhead_s": -1.0}, "overhead_s must be a finite number >= 0"),
        ({"tp": 4, "flux": 1.0}, "unknown keyword"),
    ],
    ids=["tp-3", "tp-0", "tp-neg", "weights-dont-fit", "mode", "dtype", "mfu", "overhead", "keyword"],
)
def test_impossible_configurations_are_explained(kwargs, match):
    """Impossible configurations raise CostModelError with an explanation."""
    args = {"model": "llama-3.3-70b", "gpu": "h100-sxm", **kwargs}
    with pytest.raises(CostModelError, match=match):
        CostModel.from_names(**args)


def test_tp_and_kv_heads_must_nest():
    """Qwen2.5 7B (28 heads, 4 KV heads) at tp 7: 7 divides the heads but not the KV heads: refused."""
    with pytest.raises(CostModelError, match="one must divide the other"):
        CostModel.from_names("qwen2.5-7b", "h100-sxm", tp=7)


@pytest.mark.parametrize(
    "call",
    [
        lambda cm: cm.decode_step_time(-1, 10),
        lambda cm: cm.decode_step_time(1, -1),
        lambda cm: cm.prefill_step_time(0),
        lambda cm: cm.kv_capacity_tokens(0.0),
        lambda cm: cm.max_tokens_within(0.0, 1, 1),
        lambda cm: cm.max_tokens_within(0.1, -1, 0),
    ],
    ids=["neg-decodes", "neg-context", "zero-chunk", "zero-util", "zero-target", "neg-target-decodes"],
)
def test_bad_sizes_raise(full, call):
    """Negative or zero sizes raise CostModelError rather than pricing nonsense."""
    with pytest.raises(CostModelError):
        call(full)


def test_kv_capacity_no_room():
    """A model that fits only without headroom raises when gpu_memory_utilization leaves no KV room."""
    cm = CostModel.from_names("llama-3.1-70b", "h100-sxm", tp=2)
    with pytest.raises(CostModelError, match="no room for KV"):
        cm.kv_capacity_tokens(0.5)


def test_max_tokens_within_is_the_boundary(full):
    """max_tokens_within returns T with time(T) <= target < time(T + 1), for several targets and offsets."""
    rng = random.Random(7)
    for _ in range(20):
        nd, ctx, start = rng.randrange(0, 200), rng.randrange(0, 8000), rng.randrange(0, 20000)
        target = rng.uniform(0.02, 0.3)
        t = full.max_tokens_within(target, nd, nd * ctx, start)

        def time(total, nd=nd, start=start, ctx=ctx):
            return (
                full.prefill_step_time(total - nd, start, nd, ctx)
                if total > nd
                else full.decode_step_time(nd, ctx)
            )

        if t == 0:
            assert time(max(nd, 1)) > target
            continue
        assert time(t) <= target < time(t + 1)


def test_max_tokens_within_design_inverts_budget(design):
    """In design mode, a 36.5 ms target with 64 decodes allows just under 2,048 tokens."""
    assert (
        design.max_tokens_within(design.step_time(_plan([4096] * 64, [(1984, 0, False)])), 64, 64 * 4096)
        == 2048
    )


def test_max_tokens_within_decodes_alone_too_slow(full):
    """When the decodes alone overrun the target the answer is 0."""
    assert full.max_tokens_within(0.001, 64, 64 * 4096) == 0


def test_construction_warning_is_not_repeated_by_replace():
    """replace() does not warn again for a configuration that already warned."""
    with pytest.warns(CostModelWarning):
        cm = CostModel.from_names("llama-3.1-8b", "a100", dtype="fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.replace(mode="design")


def test_overhead_terms_by_hand():
    """Overhead terms add per kernel launch (10 per layer + 1), per token and per sequence, in full mode only."""
    one = ModelSpec("one", "one layer", 1, 4096, 32, 8, 128, 14336, 32000)
    floor = CostModel(one, get_gpu("h100-sxm"))
    cm = floor.replace(kernel_launch_s=5e-6, per_token_s=1e-6, per_seq_s=20e-6, overhead_s=1e-4)
    assert cm.kernel_launches == 11
    extra = 1e-4 + 11 * 5e-6 + 24 * 1e-6 + 9 * 20e-6  # 8 decodes + one 16-token chunk: 24 tokens, 9 sequences
    got = cm.prefill_step_time(16, 0, 8, 100) - floor.prefill_step_time(16, 0, 8, 100)
    assert got == pytest.approx(extra, rel=1e-9)
    assert cm.replace(mode="design").step_time(_plan([100] * 8)) == cm.replace(
        mode="design", kernel_launch_s=0, per_token_s=0, per_seq_s=0, overhead_s=0
    ).step_time(_plan([100] * 8))
    with pytest.raises(CostModelError, match="per_seq_s must be a finite number >= 0"):
        floor.replace(per_seq_s=-1.0)


def test_multi_node_tensor_parallel_by_hand():
    """Llama 3.1 70B at tp 16 on H100 (two nodes): 160 all-reduces of T x 8,192 x 2 B at 2 x 15/16 / 50 GB/s."""
    cm = CostModel.from_names("llama-3.1-70b", "h100-sxm", tp=16)
    comm = cm.breakdown_counts(1000, 1000.0, 0, 0).comm_s
    assert comm == pytest.approx(160 * 2 * 15 / 16 * 1000 * 8192 * 2 / 50e9, rel=1e-12)


def test_pipeline_parallel_by_hand():
    """pp 2 x tp 8 on H100: one cross-node send of T x h x 2 B per step, weights and KV halved per GPU."""
    one = CostModel.from_names("llama-3.1-70b", "h100-sxm", tp=8)
    two = CostModel.from_names("llama-3.1-70b", "h100-sxm", tp=8, pp=2)
    t = 512
    extra = two.breakdown_counts(t, 512.0, 0, 0).comm_s - one.breakdown_counts(t, 512.0, 0, 0).comm_s
    assert extra == pytest.approx(t * 8192 * 2 / 50e9, rel=1e-12)
    assert two.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token_per_gpu // 2
    assert two.weight_bytes_per_gpu < 0.52 * one.weight_bytes_per_gpu
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()
    with pytest.raises(CostModelError, match="pp 100 is more than the 80 layers"):
        CostModel.from_names("llama-3.1-70b", "h100-sxm", tp=8, pp=100)
