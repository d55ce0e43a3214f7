"""The cost model's bound of SLO-driven tuning: the token budget whose full step stays within a TPOT
target at a workload's expected load, and the ladder of candidate budgets around it.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim.

The bound: by Little's law the running decodes are N = arrival rate x mean decode steps per
request x TPOT target (a request spends (output - 1) steps decoding, each at most the target),
capped by max_seqs and by the requests whose KV reservation fits; their mean context is
C = sum (o - 1)(p + (o - 2)/2) / sum (o - 1) tokens (a decode's context runs from p to p + o - 2;
p prompt, o output tokens); a prefill chunk's expected offset is the token-weighted mean offset of
the prompts' chunks at that budget (a fixed point, three rounds from offset 0). The bound is the
cost model's most tokens per step within the TPOT target at that load:
max_tokens_within(slo_tpot, N, N x C, offset). A target under the decode-only step time of N
decodes at C tokens (the floor) is refused: no budget can meet it. The candidates are the bound
times 2^(k/2), k = -6..2 (1/8 to 2 times): the bound is an estimate (steps are not always full,
and TPOT is a mean over a request's steps), so the ladder reaches past it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stallfree.core.errors import StallfreeError
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.time_budget import TimeBudgetModel, time_model

__all__ = [
    "LADDER_EXPONENTS",
    "MAX_CANDIDATE_BUDGET",
    "BudgetBound",
    "TargetBelowFloor",
    "budget_bound",
    "candidate_budgets",
    "expected_load",
    "nice_budget",
]

#: The ladder of stage 2: the bound times 2^(k/2) for these k.
LADDER_EXPONENTS = tuple(range(-6, 3))
#: Candidate budgets are never above this, tokens (a cost model may allow absurd steps for a loose target).
MAX_CANDIDATE_BUDGET = 1 << 20
#: Rounds of the chunk-offset fixed point of the bound.
_OFFSET_ROUNDS = 3

class TargetBelowFloor(StallfreeError, ValueError):
    """The TPOT target is below the decode-only step time at the expected load: no budget meets it.

    Attributes:
        floor_s: that decode-only step time, s.
    """

    def __init__(self, message: str, floor_s: float) -> None:
        super().__init__(message)
        self.floor_s = floor_s


@dataclass(frozen=True, slots=True)
class BudgetBound:
    """The cost model's token budget for a TPOT target, and the load it assumed.

    Attributes:
        token_budget: the most tokens per step within the TPOT target at that load, tokens.
        num_decodes: expected running decodes (Little's law, capped), >= 1.
        decode_context: expected context of a running decode, tokens.
        chunk_start: expected offset of a prefill chunk, tokens.
        decode_floor_s: the decode-only step time at that load, s.
        step_s: the predicted time of a full step at the bound, s (<= the target).
    """

    token_budget: int
    num_decodes: int
    decode_context: int
    chunk_start: int
    decode_floor_s: float
    step_s: float


def expected_load(
    workload: Workload,
    slo_tpot: float,
    max_seqs: int,
    kv_tokens: int,
    max_tokens: int | None = None,
) -> tuple[int, int]:
    """Return (expected running decodes, their mean context in tokens) under the TPOT target.

    N = mean_rate x mean(o - 1) x slo_tpot rounded up, at least 1, at most max_seqs and at most
    kv_tokens / mean(p + o) (the requests whose reservation fits at once); with every request
    arriving at once, N = min(requests, max_seqs). C = sum (o - 1)(p + (o - 2) / 2) / sum (o - 1),
    rounded. o is min(output, max_tokens).

    Raises:
        ValueError: an empty workload, or slo_tpot <= 0.
    """
    if not len(workload):
        raise ValueError("the workload has no requests")
    if not slo_tpot > 0:
        raise ValueError(f"slo_tpot must be > 0 seconds, got {slo_tpot!r}")
    outs = [min(o, max_tokens) if max_tokens else o for o in workload.output_lens]
    prompts = workload.prompt_lens
    n = len(outs)
    steps = sum(o - 1 for o in outs)
    rate = workload.mean_rate
    num = float(n) if math.isinf(rate) else rate * steps / n * slo_tpot
    fit = kv_tokens / ((sum(prompts) + sum(outs)) / n)
    num_decodes = max(1, min(math.ceil(num - 1e-9), max_seqs, max(1, int(fit))))
    if steps == 0:
        return num_decodes, round(sum(prompts) / n)
    ctx = sum((o - 1) * (p + (o - 2) / 2) for p, o in zip(prompts, outs, strict=True)) / steps
    return num_decodes, round(ctx)


def _mean_chunk_start(prompts: Sequence[int], chunk: int) -> int:
    """Token-weighted mean offset of the chunks of `chunk` tokens that cut each prompt, tokens."""
    total = weighted = 0
    for p in prompts:
        q, r = divmod(p, chunk)
        # full chunks start at 0, c, ..., (q-1)c; the remainder r starts at qc
        weighted += chunk * chunk * q * (q - 1) // 2 + r * q * chunk
        total += p
    return round(weighted / total) if total else 0


def budget_bound(
    cost_model: StepCostModel,
    workload: Workload,
    slo_tpot: float,
    max_seqs: int,
    kv_tokens: int,
    max_tokens: int | None = None,
) -> BudgetBound:
    """Return the cost model's token budget for the TPOT target at the workload's expected load.

    Raises:
        TargetBelowFloor: slo_tpot is below the decode-only step time at the expected load (the
            message names that floor in ms and the load).
        ValueError: an empty workload, or slo_tpot <= 0.
    """
    nd, ctx = expected_load(workload, slo_tpot, max_seqs, kv_tokens, max_tokens)
    tm: TimeBudgetModel = time_model(cost_model)
    floor = tm.decode_step_time(nd, ctx)
    if tm.max_tokens_within(slo_tpot, nd, nd * ctx, 0) == 0:
        raise TargetBelowFloor(
            f"TPOT target {slo_tpot * 1e3:g} ms is below the decode-only step time, {floor * 1e3:.1f} ms "
            f"({nd} decodes at {ctx:,} tokens of context, the expected load): no token budget can meet it",
            floor,
        )
    start, budget = 0, 0
    for _ in range(_OFFSET_ROUNDS):
        budget = max(tm.max_tokens_within(slo_tpot, nd, nd * ctx, start), nd)
        new_start = _mean_chunk_start(workload.prompt_lens, max(budget - nd, 1))
        if new_start == start:
            break
        start = new_start
    budget = max(tm.max_tokens_within(slo_tpot, nd, nd * ctx, start), 1)
    budget = min(budget, MAX_CANDIDATE_BUDGET)
    step = _full_step_time(tm, budget, nd, ctx, start)
    return BudgetBound(budget, nd, ctx, start, floor, step)


def _full_step_time(tm: TimeBudgetModel, budget: int, nd: int, ctx: int, start: int) -> float:

    chunk = budget - nd
    prefills = (ScheduledChunk(None, chunk, True, start, True),) if chunk > 0 else ()
    plan = StepPlan(0, (None,) * nd, (0,) * nd, prefills, max(budget, nd), nd * ctx, max(budget, nd))
    return tm.step_time(plan)


def nice_budget(x: float) -> int:
    """Round a budget for display and reuse: to 16 tokens from 128 up, else to a token."""
    return max(16, int(round(x / 16)) * 16) if x >= 128 else max(1, int(round(x)))


def candidate_budgets(bound: int) -> list[int]:
    """Return the stage-2 ladder: the bound itself and bound x 2^(k/2), k = -6..2, rounded, distinct,
    ascending, at most MAX_CANDIDATE_BUDGET.

    Raises:
        ValueError: bound < 1.
    """
    if bound < 1:
        raise ValueError(f"bound must be >= 1 token, got {bound!r}")
    out = {bound}
    for k in LADDER_EXPONENTS:
        if k:
            out.add(nice_budget(bound * 2 ** (k / 2)))
    return sorted(b for b in out if b <= MAX_CANDIDATE_BUDGET)
