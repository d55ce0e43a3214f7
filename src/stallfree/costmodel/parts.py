"""The small pieces the roofline cost model is built from: StepCost (a step's predicted time in parts),
argument checks, and largest_fitting (the search for the most tokens within a step time).

Imports allowed: the standard library, stallfree.costmodel (errors, model).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from stallfree.costmodel.errors import CostModelError, FieldName
from stallfree.costmodel.model import ModelSpec

__all__ = ["MAX_TOKENS", "StepCost", "largest_fitting"]

#: A message with its fields named by a FieldName (CostModelError.wording).
FieldWording = Callable[[FieldName], str]

# The largest step max_tokens_within will return, in tokens: far above any real token budget.
MAX_TOKENS = 1 << 30


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int = MAX_TOKENS) -> int:
    """The largest token count n in [start, cap] with fits(n), for a `fits` that is true up to some
    n and false beyond (step time grows with tokens); 0 when fits(start) is false.

    Doubles from `start` until it fails, then bisects: O(log n) calls to `fits`.
    """
    if not fits(start):
        return 0
    lo, hi = start, start * 2
    while hi < cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= cap:
        if fits(cap):
            return cap
        hi = cap
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class StepCost:
    """The parts of one step's predicted time, in seconds, with the work behind them.

    Attributes:
        compute_s: FLOPs / (n x peak x mfu).
        memory_s: bytes per GPU / (bandwidth x mbu).
        comm_s: all-reduce time (bandwidth part plus per-call latency).
        overhead_s: the overheads outside the roofline: per step, per kernel launch, per token and per
            sequence, together.
        total_s: max(compute_s, memory_s) + comm_s + overhead_s.
        flops: FLOPs per GPU (linear + lm_head + attention).
        bytes: bytes read and written per GPU (weights + KV).
    """

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    total_s: float
    flops: float
    bytes: float


def _check_fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise CostModelError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def _check_nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise CostModelError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_count(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CostModelError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_tp(model: ModelSpec, tp: int) -> None:
    _check_count("tp", tp, 1)
    problem = _tp_problem(model, tp)
    if problem is not None:
        raise CostModelError(problem(str), problem)


def _tp_problem(model: ModelSpec, tp: int) -> FieldWording | None:
    """Why tp (>= 1) cannot split this model's heads, worded with the field named by a FieldName; None where
    it can."""
    if model.num_heads % tp:
        heads = model.num_heads
        return lambda n: (f"{n('tp')} {tp} does not divide the {heads} attention heads of {model.key}; "
                          f"use a divisor of {heads}")
    kv = model.num_kv_heads
    # Engines shard KV heads when there are at least tp of them and replicate them otherwise; both
    # need one count to divide the other (vLLM's QKVParallelLinear asserts the same).
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        return lambda n: (f"{n('tp')} {tp} and the {kv} KV heads of {model.key}: one must divide the other, so "
                          "that KV heads are either split evenly or replicated evenly")
    return None
