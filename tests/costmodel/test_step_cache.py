"""Tests of the kernel cost model's step cache (stallfree.costmodel.decode_runs.DecodeRuns and
KernelCostModel's step_cache switch): the same prices as pricing every step afresh, bit for bit."""

from __future__ import annotations

import json
import pickle
import random
from typing import Any

import pytest

from stallfree import Request, Scheduler
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import get_gpu, get_model
from stallfree.costmodel.decode_runs import DecodeRuns
from stallfree.costmodel.kernels import KNOTS, STEP_CACHE_ENV, kernels_installed, step_cache_default

needs_kernels = pytest.mark.skipif(
    not kernels_installed(), reason="the optional package aiconfigurator-core (extra 'kernels') is not installed"
)

_STRIDE = 1 << 12


def _triangular(prices: dict[int, float]):  # type: ignore[no-untyped-def]
    """A knot price that is not linear: decode(nb, knots[k]) = k (k + 1) / 2 seconds for any nb."""

    def knot(nb: int, k: int) -> float:
        prices[nb * _STRIDE + k] = v = k * (k + 1) / 2
        return v

    return knot


def test_sum_between_knots_worked_by_hand() -> None:
    """Offsets 10, 300, 700: at shift 1 the keys 11, 301, 701 fall in three intervals (by hand 6.609375 s),
    and at shift 300 the keys 310, 600, 1000 give 15.078125 s."""
    prices: dict[int, float] = {}
    runs = DecodeRuns(KNOTS, prices, _STRIDE)
    knot = _triangular(prices)
    offs = (10, 300, 700)
    # f(11) = 0 + 11/256; f(301) = 1 + 45/256 x 2; f(701) = 3 + 189/256 x 3
    assert runs.total(offs, 1, 3, knot) == 11 / 256 + (1 + 90 / 256) + (3 + 567 / 256) == 6.609375
    assert runs.total(offs, 2, 3, knot) == 6.609375 + 1 / 256 + 2 / 256 + 3 / 256  # one token further: a hit
    # f(310) = 1 + 54/256 x 2; f(600) = 3 + 88/256 x 3; f(1000) = 6 + 232/256 x 4
    assert runs.total(offs, 300, 3, knot) == 1.421875 + 4.03125 + 9.625 == 15.078125


def test_cached_sum_equals_each_decode_interpolated_alone() -> None:
    """Over random offsets and shifts (knots crossed, tuples changing, batch sizes changing), the cached sum
    equals the sum of each decode's own interpolation (an independent reference) to rounding."""
    rng = random.Random(7)
    prices: dict[int, float] = {}
    runs = DecodeRuns(KNOTS, prices, _STRIDE)
    knot = _triangular(prices)

    def alone(s: int) -> float:
        k = max(i for i, x in enumerate(KNOTS[:40]) if x <= s)
        lo, hi = k * (k + 1) / 2, (k + 1) * (k + 2) / 2
        return lo + (hi - lo) * (s - KNOTS[k]) / (KNOTS[k + 1] - KNOTS[k])

    offs = tuple(rng.randrange(0, 5000) for _ in range(40))
    for shift in range(1, 3000, 7):
        if rng.random() < 0.2:
            offs = tuple(rng.randrange(0, 5000) for _ in range(rng.randrange(1, 60)))
        expected = sum(alone(o + shift) for o in offs)
        assert runs.total(offs, shift, len(offs), knot) == pytest.approx(expected, rel=1e-12)


def test_tuples_in_turn_are_priced_afresh() -> None:
    """Two tuples priced in turn (two replicas sharing a cost model) each give their own sum, the cache
    keeping only the last one; a tuple's second step keeps its partition, read on the third."""
    prices: dict[int, float] = {}
    runs = DecodeRuns(KNOTS, prices, _STRIDE)
    knot = _triangular(prices)
    a, b = (10, 300, 700), (40, 41, 2000)
    for shift in range(1, 6):
        assert runs.total(a, shift, 3, knot) == 6.609375 + 6 * (shift - 1) / 256
        runs.total(b, shift, 3, knot)
    assert runs._offs is b and runs._nb == -1  # seen once in a row: no partition kept
    runs.total(b, 6, 3, knot)
    assert runs._nb == 3 and runs._first == 6 and len(runs._terms) == 2  # decodes in 2 intervals
    assert runs.total(b, 7, 3, knot) == runs._walk(7, 3, knot, False)


def test_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """STALLFREE_KERNEL_STEP_CACHE=0 (or off, false, no) turns the step cache off; unset or anything else keeps it."""
    monkeypatch.delenv(STEP_CACHE_ENV, raising=False)
    assert step_cache_default() is True
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(STEP_CACHE_ENV, off)
        assert step_cache_default() is False
    monkeypatch.setenv(STEP_CACHE_ENV, "1")
    assert step_cache_default() is True


@pytest.fixture(scope="module")
def llama8b():  # type: ignore[no-untyped-def]
    """Llama 3.1 8B on one H100 SXM, vLLM's current tables (built once for the module)."""
    from stallfree.costmodel.kernels import KernelCostModel

    return KernelCostModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), 1, "bf16", engine="vllm")


@needs_kernels
def test_cached_prices_equal_uncached_bit_for_bit_on_scheduler_runs(llama8b) -> None:  # type: ignore[no-untyped-def]
    """Every plan of two interleaved seeded scheduler runs is priced to the same float with the step cache
    as without it (decodes joining and leaving, crossing knots, prefills beside them)."""
    rng = random.Random(3)
    scheds = [Scheduler(token_budget=512, max_seqs=64, kv_tokens=400_000) for _ in range(2)]
    rid = 0
    for s in scheds:
        for _ in range(60):
            s.add(Request(rid=rid, prompt_len=rng.randrange(1, 3000), max_new=rng.randrange(1, 700)))
            rid += 1
    llama8b.clear_caches()
    steps = 0
    while any(s.has_unfinished() for s in scheds):
        for s in scheds:
            if not s.has_unfinished():
                continue
            plan = s.schedule()
            assert llama8b.step_time(plan) == llama8b.step_time_uncached(plan)
            s.complete(plan)
            steps += 1
    assert steps > 500


@needs_kernels
def test_replica_views_keep_their_own_runs_and_price_the_same(llama8b) -> None:  # type: ignore[no-untyped-def]
    """bind_replica: a view per replica shares the model's price caches and keeps its own step cache, so
    interleaved schedulers each keep their tuple's partition; every plan gets the model's uncached float."""
    rng = random.Random(4)
    scheds = [Scheduler(token_budget=512, max_seqs=64, kv_tokens=400_000) for _ in range(3)]
    for k, s in enumerate(scheds):
        for i in range(40):
            s.add(Request(rid=100 * k + i, prompt_len=rng.randrange(1, 3000), max_new=rng.randrange(1, 500)))
    views = [llama8b.bind_replica(None) for _ in scheds]
    assert all(v._decode_c is llama8b._decode_c and v._runs is not llama8b._runs for v in views)
    assert len({id(v._runs) for v in views}) == len(views)
    steps = 0
    while any(s.has_unfinished() for s in scheds):
        for s, v in zip(scheds, views, strict=True):
            if s.has_unfinished():
                plan = s.schedule()
                assert v.step_time(plan) == llama8b.step_time_uncached(plan)
                if plan.num_decodes:
                    assert v._runs._offs is plan.decode_offsets  # this replica's tuple, not another's
                s.complete(plan)
                steps += 1
    assert steps > 500


@needs_kernels
def test_cached_price_is_within_the_bucket_bound_of_unbucketed(llama8b) -> None:  # type: ignore[no-untyped-def]
    """A plan of decodes at scattered contexts and one chunk: the cached price stays within 0.5% of the
    package asked at every decode's own keys (step_time_exact), the bound of the buckets."""
    offsets = (100, 700, 1500, 2600, 5000, 9000)
    chunk = ScheduledChunk(99, 300, True, 1200, False)
    for step in (0, 50, 400):
        plan = StepPlan(step, tuple(range(6)), offsets, (chunk,), 306, sum(offsets) + 6 * step, 8192)
        exact = llama8b.step_time_exact(plan)
        assert llama8b.step_time(plan) == pytest.approx(exact, rel=5e-3)


@needs_kernels
def test_pickles_with_its_switch(llama8b) -> None:  # type: ignore[no-untyped-def]
    """The switch travels with the model to a worker process (pickled as its arguments)."""
    from stallfree.costmodel.kernels import KernelCostModel

    off = KernelCostModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), 1, "bf16", engine="vllm", step_cache=False)
    assert off.step_cache is False and pickle.loads(pickle.dumps(off)).step_cache is False
    assert pickle.loads(pickle.dumps(llama8b)).step_cache is True


@needs_kernels
def test_simulate_json_is_the_same_with_the_cache_off(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """`simulate --json` of a short replay under the kernel tables prints the same figures with the step cache
    on and off (STALLFREE_KERNEL_STEP_CACHE=0), all but the wall time the simulation took."""
    from stallfree.cli import main

    args = ["simulate", "--num-requests", "300", "--kernels", "vllm", "--json", "--no-range"]
    outputs = []
    for value in ("1", "0"):
        monkeypatch.setenv(STEP_CACHE_ENV, value)
        assert main(args) == 0
        outputs.append(capsys.readouterr().out)
    on, off = (_without_wall_time(json.loads(text)) for text in outputs)
    assert on == off and on["runs"]


def _without_wall_time(value: Any) -> Any:
    """The JSON value without its keys ending in 'wall_s' (the wall time the simulation took, which varies)."""
    if isinstance(value, dict):
        return {k: _without_wall_time(v) for k, v in value.items() if not k.endswith("wall_s")}
    if isinstance(value, list):
        return [_without_wall_time(v) for v in value]
    return value
