"""Time budget mode: each step's token budget is the most tokens whose predicted step time stays
under a target, worked out by the cost model from the running decodes before every schedule().

Imports allowed: the standard library, stallfree.core and stallfree.sim (its stdlib modules only).

A fixed token budget keeps a step's *tokens* constant, but not its *time*: attention makes a step
over long contexts slower than one over short ones, so at long context a budget sized for the
TPOT target drifts past it. Here the budget follows the step time instead: before each step the
wrapper reads the ready decodes and the sum of their context lengths from the scheduler
(`Scheduler.decode_load`, O(1)) and the offset of the prompt being prefilled, asks the cost model
for the most tokens within the target (`max_tokens_within`), and calls
`schedule(token_budget=b)` with b clamped to [1, the configured budget]:

- decodes and a chunk fit: b = that many tokens (decodes first, as in the contract);
- the decodes alone exceed the target (decode overflow): b = the most decodes that fit, priced at
  the decodes' mean context, at least 1; the scheduler's decode_overflow rule picks which run;
- nothing fits (one token is already over the target): b = 1, so a step always holds one entry.

Pricing assumptions (those of CostModel.max_tokens_within): the prefill tokens of a step are one
chunk at the offset of the partial prefill (0 when none), which sampled one token. Splitting them
into several chunks (admissions at offset 0) only removes attention pairs, so the prediction is an
upper bound, except for the lm_head of each further prompt finishing in the step (2 x V x h FLOPs
each, 0.5 us on Llama 3.3 70B at TP 4), which a pair saving of more than 200 (query, key) pairs
covers; the tests check the bound on whole workloads. In decode overflow the decodes the rule
picks may have more context than the mean, so such steps may exceed the target.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stallfree.core.config import SchedulerConfig
from stallfree.core.errors import check_positive_int
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.core.request import FinishReason, Request
from stallfree.core.scheduler import Scheduler
from stallfree.costmodel.roofline import largest_fitting
from stallfree.sim.defaults import DEFAULT_MAX_SEQS
from stallfree.sim.run.costs import StepCostModel

__all__ = [
    "PlanPricer",
    "TimeBudgetConfig",
    "TimeBudgetModel",
    "TimeBudgetScheduler",
    "time_model",
]



@runtime_checkable
class TimeBudgetModel(Protocol):
    """A cost model that can invert its step time (stallfree.costmodel.CostModel has these)."""

    def step_time(self, plan: StepPlan) -> float:
        """Return the wall time of executing `plan`, s."""
        ...

    def max_tokens_within(
        self, target_s: float, num_decodes: int, decode_context_sum: int, chunk_start: int = 0
    ) -> int:
        """Return the most tokens (decodes plus one chunk at `chunk_start`) within target_s; 0 if
        the decodes alone exceed it."""
        ...

    def decode_step_time(self, num_decodes: int, context_len: int) -> float:
        """Return the time of a step of `num_decodes` decodes at `context_len` tokens each, s."""
        ...


class PlanPricer:
    """Give any StepCostModel the TimeBudgetModel methods, by pricing synthetic StepPlans.

    max_tokens_within is a doubling then a binary search on the step's tokens (monotone for any
    sensible cost model), each probe one step_time() of a plan holding `num_decodes` decodes at
    the given context sum and one sampling chunk at `chunk_start`. About 2 log2(tokens) pricings;
    meant for models without a closed form (stallfree.sim.LinearCostModel, hand-made ones).

    Args:
        cost_model: anything with step_time(plan) -> seconds.
    """

    def __init__(self, cost_model: StepCostModel) -> None:
        self.cost_model = cost_model

    def __repr__(self) -> str:
        return f"PlanPricer({self.cost_model!r})"

    def step_time(self, plan: StepPlan) -> float:
        """Return the wrapped model's step time of `plan`, s."""
        return self.cost_model.step_time(plan)

    def _price(self, num_decodes: int, context_sum: int, chunk: int, chunk_start: int) -> float:
        prefills = (ScheduledChunk(None, chunk, True, chunk_start, True),) if chunk > 0 else ()
        plan = StepPlan(
            step=0,
            decode_rids=(None,) * num_decodes,
            decode_offsets=(0,) * num_decodes,
            prefills=prefills,
            num_tokens=num_decodes + max(chunk, 0),
            decode_context_sum=context_sum,
            token_budget=num_decodes + max(chunk, 0),
        )
        return self.cost_model.step_time(plan)

    def decode_step_time(self, num_decodes: int, context_len: int) -> float:
        """Return the time of a decode-only step, s (0.0 for no decodes)."""
        if num_decodes <= 0:
            return 0.0
        return self._price(num_decodes, num_decodes * context_len, 0, 0)

    def max_tokens_within(
        self, target_s: float, num_decodes: int, decode_context_sum: int, chunk_start: int = 0
    ) -> int:
        """Return the most tokens of a step (the decodes plus one chunk) priced <= target_s, at most
        2^30; 0 when the decodes alone (or, without decodes, a one-token chunk) exceed it.

        Raises:
            ValueError: target_s <= 0, or a negative count, context sum or offset.
        """
        if not target_s > 0:
            raise ValueError(f"target_s must be > 0 seconds, got {target_s!r}")
        for name, value in (
            ("num_decodes", num_decodes),
            ("decode_context_sum", decode_context_sum),
            ("chunk_start", chunk_start),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        nd = num_decodes

        def fits(total: int) -> bool:
            return self._price(nd, decode_context_sum, total - nd, chunk_start) <= target_s

        return largest_fitting(fits, max(nd, 1))


def time_model(cost_model: StepCostModel) -> TimeBudgetModel:
    """Return `cost_model` itself when it can invert its step time, else a PlanPricer around it."""
    if isinstance(cost_model, TimeBudgetModel):
        return cost_model
    return PlanPricer(cost_model)


def _check_target(target_s: float) -> float:
    if isinstance(target_s, bool) or not isinstance(target_s, int | float) or not 0 < target_s < float("inf"):
        raise ValueError(f"step time target must be a finite number of seconds > 0, got {target_s!r}")
    return float(target_s)


class TimeBudgetScheduler:
    """Wrap a Scheduler so that each step's token budget keeps the predicted step time <= target_s.

    It owns nothing of the scheduling itself: every decision stays the wrapped scheduler's (the
    contract order, chunking, admission, the decode_overflow rule); the wrapper only picks the
    `token_budget` argument of each schedule() (see the module docstring) and remembers the offset
    of the prompt being prefilled, which it reads from the plans it hands out. Any attribute it
    does not define is read from the wrapped scheduler (kv_total, step, max_seqs, ...), so the
    simulator and stallfree.core.invariants.InvariantChecker can use it as a scheduler.

    Args:
        scheduler: the Scheduler to drive; its token_budget is the cap of every step's budget.
        cost_model: prices steps; without max_tokens_within it is wrapped in a PlanPricer.
        target_s: the step time target, seconds (> 0).

    Raises:
        ValueError: target_s is not a finite number > 0, or the scheduler uses speculative decode
            tokens (a decode that costs several tokens is not what the cost model inverts).

    Example: with a linear model of 10 ms + 0.1 ms per token and a 30 ms target, a step with
    50 decodes gets a budget of 200 tokens: the decodes and a 150-token chunk.
    """

    def __init__(self, scheduler: Scheduler, cost_model: StepCostModel, target_s: float) -> None:
        self.target_s = _check_target(target_s)
        if scheduler.config.num_spec_tokens:
            raise ValueError(
                f"time budget mode prices one token per decode; the scheduler has num_spec_tokens = "
                f"{scheduler.config.num_spec_tokens}"
            )
        self.scheduler = scheduler
        self.cost_model = time_model(cost_model)
        self.last_finished: dict[Hashable, FinishReason] = {}
        self._partial: Hashable | None = None
        self._partial_start = 0

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here: read them from the wrapped scheduler.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"TimeBudgetScheduler(target_s={self.target_s}, budget<={self.scheduler.config.token_budget})"

    # ------------------------------------------------------------------ the scheduler interface

    @property
    def kv_free(self) -> int:
        """Unreserved KV capacity of the wrapped scheduler, tokens."""
        return self.scheduler.kv_free

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the wrapped scheduler."""
        return self.scheduler.num_waiting

    def has_unfinished(self) -> bool:
        """True while the wrapped scheduler has a waiting or running request."""
        return self.scheduler.has_unfinished()

    def add(self, req: Request) -> None:
        """Queue `req` in the wrapped scheduler (raises what its add() raises)."""
        self.scheduler.add(req)

    def abort(self, rid: Hashable) -> None:
        """Abort `rid` in the wrapped scheduler (raises what its abort() raises)."""
        self.scheduler.abort(rid)
        if rid == self._partial:
            self._partial, self._partial_start = None, 0

    def schedule(self) -> StepPlan:
        """Plan the next step under the budget of step_budget().

        Raises:
            SchedulerStateError: the previous plan has not been completed.
        """
        return self.scheduler.schedule(token_budget=self.step_budget())

    def complete(
        self,
        plan: StepPlan,
        stopped: Iterable[Hashable] = (),
        num_accepted: Mapping[Hashable, int] | None = None,
    ) -> tuple[Hashable, ...]:
        """Apply an executed step to the wrapped scheduler; note where the partial prefill stands."""
        emitted = self.scheduler.complete(plan, stopped, num_accepted)
        self.last_finished = self.scheduler.last_finished
        for c in plan.prefills:
            if not c.is_last:
                self._partial, self._partial_start = c.rid, c.start + c.num_tokens
            elif c.rid == self._partial:
                self._partial, self._partial_start = None, 0
        if self._partial is not None and (self._partial in self.last_finished or self._partial in plan.preempted):
            self._partial, self._partial_start = None, 0  # aborted in flight, or preempted (paged)
        return emitted

    # ------------------------------------------------------------------ the budget

    def step_budget(self) -> int:
        """Return the token budget of the next step, tokens, from 1 to the configured budget.

        Raises:
            ValueError: from the cost model, on inconsistent counts (a scheduler fault).
        """
        num_decodes, context_sum = self.scheduler.decode_load
        cap = self.scheduler.config.token_budget
        cm, target = self.cost_model, self.target_s
        tokens = cm.max_tokens_within(target, num_decodes, context_sum, self._partial_start)
        if tokens == 0 and num_decodes > 1:
            tokens = self._decodes_within(num_decodes, context_sum)
        return min(max(tokens, 1), cap)

    def _decodes_within(self, num_decodes: int, context_sum: int) -> int:
        """The most decodes, each at the mean context (rounded up), whose decode-only step fits the
        target (0 if not even one); a binary search over the count, one pricing per probe."""
        cm, target = self.cost_model, self.target_s
        mean_context = -(-context_sum // num_decodes)  # rounded up: never under the mean

        def fits(k: int) -> bool:
            return cm.decode_step_time(k, mean_context) <= target

        return largest_fitting(fits, 1, cap=num_decodes - 1) if num_decodes > 1 else 0


@dataclass(frozen=True, slots=True, init=False)
class TimeBudgetConfig:
    """A picklable factory of a time-budget scheduler, for simulate() and worker processes.

    Args:
        scheduler: the inner scheduler's stallfree.SchedulerConfig; its token_budget caps every step's
            budget (tokens). (The former form TimeBudgetConfig(kv_tokens, target_s, cost_model,
            token_budget=65536, max_seqs=256, decode_overflow=, kv_policy=, block_size=, watermark=,
            enable_prefix_caching=) is deprecated: one warning.)
        target_s: the step time target, seconds.
        cost_model: prices steps (the simulator's own cost model, so that both agree).

    Raises:
        ValueError: target_s is not a finite number > 0.
        InvalidConfig: a scheduler field out of range (named).
    """

    scheduler: SchedulerConfig
    target_s: float
    cost_model: StepCostModel

    def __init__(self, scheduler: SchedulerConfig | int, target_s: float, cost_model: StepCostModel,
                 token_budget: int = 65536, max_seqs: int = DEFAULT_MAX_SEQS, **legacy: Any) -> None:
        _check_target(target_s)
        if not isinstance(scheduler, SchedulerConfig):
            from stallfree.sim.run.config import warn_deprecated

            warn_deprecated("TimeBudgetConfig(kv_tokens, ...)",
                            "TimeBudgetConfig(SchedulerConfig(...), target_s, cost_model)")
            check_positive_int("token_budget", token_budget)
            if legacy.get("kv_policy", "reserve") != "paged":
                legacy.pop("block_size", None)
            scheduler = SchedulerConfig(token_budget, max_seqs, scheduler, **legacy)
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "target_s", target_s)
        object.__setattr__(self, "cost_model", cost_model)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TimeBudgetConfig, (self.scheduler, self.target_s, self.cost_model))

    def __call__(self) -> TimeBudgetScheduler:
        """Build a fresh wrapped scheduler."""
        return TimeBudgetScheduler(Scheduler(self.scheduler), self.cost_model, self.target_s)

    @property
    def token_budget(self) -> int:
        """The cap of every step's budget, tokens."""
        return self.scheduler.token_budget

    @property
    def label(self) -> str:
        """A short name for tables: "time/50ms"."""
        return f"time/{self.target_s * 1e3:g}ms"
