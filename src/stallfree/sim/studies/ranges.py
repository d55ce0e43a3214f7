"""How sure a latency figure is: the range of each latency of a run, from a stated error model of the
step time replayed through the same scheduler.

Imports allowed: the standard library and stallfree.sim; numpy lazily (through stallfree.sim.outputs.report).

The error model (docs/simulator.md, "Ranges"):

- A step's real time is the simulator's step time times a factor r. Its distribution is measured on the
  dev data only: one sample per replayed dev run, r = measured mean TPOT / simulated mean TPOT (a mean
  TPOT is the mean time of the steps a request decodes in, so it is the step time as the run saw it),
  over the four run folders of data/validation/llmservingsim_vllm and the vLLM rows of the package's
  sample (aiconfigurator-core's systems/silicon_sample.csv) on H100 and H200 that
  ``stallfree validate --against`` replays, both with the defaults. ``benchmarks/step_time_error.py``
  measures it and prints the constants below.
- The range of a run is the same replay with every step's time scaled by STEP_TIME_LOW and by
  STEP_TIME_HIGH, the 10th and the 90th percentile of r: every latency key of the summary is then
  [min, max] of the three replays' values. Queueing amplifies the range where it amplifies the
  error: near capacity a step 10% slower is a queue that grows, and the range says so.
- The front-end term of an engine profile (``frontend_s``) is a per-request cost, not a step's: it is
  not scaled.
- Cost: two more replays of the run (not of its capacity), about 2x the replay's time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.core.plan import StepPlan
from stallfree.sim.run.costs import InnerPlainPricing, StepCostModel

__all__ = [
    "RANGE_KEYS",
    "STEP_TIME_HIGH",
    "STEP_TIME_LOW",
    "ScaledCost",
    "error_model",
    "run_range",
]

#: The 10th percentile of measured / simulated step time over the dev runs (module docstring).
#: Source: ``python benchmarks/step_time_error.py`` (210 samples: 4 run folders, 206 benchmark rows;
#: the median is 1.063: the replay is a little fast on the whole).
STEP_TIME_LOW = 0.939
#: The 90th percentile of the same distribution.
STEP_TIME_HIGH = 1.231

#: The summary's latency keys a range covers, as the summary names them (vLLM's serving-benchmark names).
RANGE_KEYS: tuple[str, ...] = tuple(
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el", "queue")
    for stat in ("mean", "median", "p90", "p99")
)


@dataclass(frozen=True, slots=True)
class ScaledCost(InnerPlainPricing):
    """A cost model whose every step takes `factor` times the inner model's time.

    Args:
        inner: the cost model scaled (anything with step_time(plan) -> s).
        factor: the scale of each step's time (> 0, finite; 1.1 = every step 10% slower).

    Raises:
        ValueError: factor not a finite number > 0.
    """

    inner: StepCostModel
    factor: float

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"ScaledCost.factor must be a finite number > 0, got {self.factor!r}")

    def step_time(self, plan: StepPlan) -> float:
        """Return the inner model's step time times the factor, s."""
        return self.factor * self.inner.step_time(plan)

    def _plain_times(self, times: list[float], num_decodes: int) -> list[float]:
        """The inner model's prices of decode-only steps times the factor, as step_time scales a step."""
        factor = self.factor
        return [factor * t for t in times]

    @property
    def frontend_s(self) -> float:
        """The inner model's per-request front end, s, unscaled (a request's cost, not a step's)."""
        return float(getattr(self.inner, "frontend_s", 0.0))

    def bind_replica(self, res: Any) -> StepCostModel:
        """A replica's pricer: the inner model's own, when it keeps state per replica (LoRA adapter
        residency, stallfree.sim.run.lora.LoraCost), scaled by the same factor; else this model."""
        bind = getattr(self.inner, "bind_replica", None)
        return self if bind is None else ScaledCost(bind(res), self.factor)

    def __getattr__(self, name: str) -> Any:
        # What the simulator reads besides step_time (the KV tier's copy pricing, batch pricing helpers)
        # is the inner model's; only whole steps are scaled. `inner` itself missing (an object being
        # unpickled) is an AttributeError, not a recursion.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def error_model() -> dict[str, Any]:
    """The stated error model as a record for a report's header: the two factors and their source."""
    return {"step_time_low": STEP_TIME_LOW, "step_time_high": STEP_TIME_HIGH,
            "percentiles": [10, 90],
            "source": "measured / simulated mean TPOT over the dev runs (benchmarks/step_time_error.py)"}


def run_range(base: dict[str, Any], scaled: list[dict[str, Any]],
              keys: Sequence[str] = RANGE_KEYS) -> dict[str, list[float] | None]:
    """The range of each latency key: [min, max] over the run's summary and its scaled replays'.

    Args:
        base: the run's summary (stallfree.sim.outputs.report.summarize_result's keys).
        scaled: the summaries of the same run replayed with ScaledCost(STEP_TIME_LOW) and
            ScaledCost(STEP_TIME_HIGH).
        keys: the latency keys to range (default RANGE_KEYS, the summary's).

    Returns:
        {key: [low, high] (ms) or None where the run has no value} for every key of `keys`.
    """
    out: dict[str, list[float] | None] = {}
    for key in keys:
        raw = [s.get(key) for s in (base, *scaled)]
        if any(v is None for v in raw):
            out[key] = None
            continue
        values = [float(v) for v in raw if v is not None]
        out[key] = [min(values), max(values)]
    return out
