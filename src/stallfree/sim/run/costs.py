"""The seam between the simulator and a cost model: anything that prices a StepPlan in seconds.

Imports allowed: the standard library and stallfree.core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stallfree.core.plan import StepPlan

__all__ = ["InnerPlainPricing", "LinearCostModel", "StepCostModel"]


@runtime_checkable
class StepCostModel(Protocol):
    """Prices one step: stallfree.costmodel.CostModel, or a hand-made model in tests."""

    def step_time(self, plan: StepPlan) -> float:
        """Return the wall time of executing `plan`, s (> 0 for a non-empty plan)."""
        ...


@dataclass(frozen=True, slots=True)
class LinearCostModel:
    """step time = base_s + per_token_s * plan.num_tokens + per_context_token_s * plan.decode_context_sum.

    A stand-in with a transparent formula: hand-computed timelines in tests, and quick what-ifs.
    An empty plan costs 0.

    Args:
        base_s: fixed cost of a step, s (e.g. reading the weights once).
        per_token_s: cost of each token in the flat batch, s/token.
        per_context_token_s: cost of each KV token the decodes read, s/token.

    Raises:
        ValueError: a coefficient is negative, or all are 0.
    """

    base_s: float
    per_token_s: float
    per_context_token_s: float = 0.0

    #: step_time depends on the plan alone and changes nothing (a simulator may price steps ahead).
    pure_step_time = True

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_context_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LinearCostModel.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.base_s == 0 and self.per_token_s == 0:
            raise ValueError("LinearCostModel needs base_s > 0 or per_token_s > 0")

    def plain_decode_times(self, offsets: tuple[int, ...], offset_sum: int, step: int, count: int) -> list[float]:
        """step_time of each of `count` decode-only steps, s, the first numbered `step`, of the decodes at
        `offsets` (summing to `offset_sum`), one token each: the same floats, no plan per step."""
        nd = len(offsets)
        if not nd:
            return [0.0] * count
        return [self.base_s + self.per_token_s * nd + self.per_context_token_s * (offset_sum + nd * s)
                for s in range(step, step + count)]

    def step_time(self, plan: StepPlan) -> float:
        """Return the step's time, s, by the linear formula."""
        if plan.num_tokens == 0:
            return 0.0
        return (
            self.base_s
            + self.per_token_s * plan.num_tokens
            + self.per_context_token_s * plan.decode_context_sum
        )


class InnerPlainPricing:
    """A base for a cost model that wraps another (`inner`) and derives each step's price from the inner
    one's: the inner model's answers about runs of plain decode steps (stallfree.core.plain_steps), and its
    plain_decode_times mapped through the wrapper's own `_plain_times(times, num_decodes)`, which must do to
    each price what the wrapper's step_time does to a decode-only step's. Defined, not delegated: a wrapper
    that hands unknown attributes to its inner model would otherwise price runs as the inner model does.
    """

    __slots__ = ()
    inner: Any
    #: No running sums of the inner model's prices (its plain_decode_ends would skip `_plain_times`).
    plain_decode_ends = None

    @property
    def pure_step_time(self) -> bool:
        """Whether step_time depends on the plan alone and changes nothing: the inner model's answer."""
        return bool(getattr(self.inner, "pure_step_time", False))

    @property
    def plain_decode_times_vectorized(self) -> bool:
        """Whether plain_decode_times prices many steps for about the cost of one: the inner model's answer."""
        return bool(getattr(self.inner, "plain_decode_times_vectorized", False))

    def plain_decode_times(
        self, offsets: tuple[int, ...], offset_sum: int, step: int, count: int
    ) -> list[float] | None:
        """step_time of each of `count` decode-only steps, s, the first numbered `step`, of the decodes at
        `offsets` (summing to `offset_sum`), one token each: the inner model's prices through `_plain_times`;
        None when the inner model has no such pricing (the caller then prices each step's plan)."""
        inner = getattr(self.inner, "plain_decode_times", None)
        times = None if inner is None else inner(offsets, offset_sum, step, count)
        return None if times is None else self._plain_times(times, len(offsets))

    def _plain_times(self, times: list[float], num_decodes: int) -> list[float]:
        raise NotImplementedError

