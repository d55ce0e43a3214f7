"""One replica's configuration (ReplicaConfig: the core's SchedulerConfig plus the batching mode, KV
capacity and the simulator's own options), the scheduler it builds, and the deprecated names kept for it.

Imports allowed: the standard library, stallfree.core and stallfree.sim.run.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from stallfree.core.config import SchedulerConfig
from stallfree.core.invariants import InvariantChecker
from stallfree.core.invariants_tier import TieredInvariantChecker
from stallfree.core.kv_tier import TieredKV
from stallfree.core.scheduler import Scheduler
from stallfree.sim.defaults import BATCHING_MODES, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET
from stallfree.sim.run.baselines import NoChunkScheduler, PrefillFirstScheduler
from stallfree.sim.run.replica import SimClock
from stallfree.sim.run.result import SchedulerLike

__all__ = [
    "BATCHING_MODES",
    "ReplicaConfig",
    "async_of",
    "legacy_scheduler_config",
    "make_scheduler",
    "warn_deprecated",
    "wrap_checker",
]


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """The simulator's record of one replica's scheduler: the core's SchedulerConfig plus what is the
    simulator's own (the batching mode, asynchronous scheduling); picklable, so that a worker process
    can build its own.

    Args:
        scheduler: the stallfree.core SchedulerConfig (token budget, sequences, KV capacity and policy,
            prefix caching, partial prefills, CPU tier, ...). The baselines read only its token_budget,
            max_seqs and kv_tokens and need kv_policy "reserve".
        batching: "chunked" (stallfree.Scheduler, the contract), "prefill-first" or "no-chunk"
            (stallfree.sim.run.baselines).
        async_scheduling: the engine plans each step while the previous one runs, as vLLM's
            `--async-scheduling` does (on by default from vLLM 0.14.0): a request that arrives while
            step k runs first runs in step k + 2 instead of k + 1 (stallfree.sim.run.loop, "Asynchronous
            scheduling"; docs/simulator.md). Default False: a synchronous scheduler.
        max_queue_time_s: None, or seconds a request may wait for admission: one that waits longer, never
            admitted, is shed (finish reason "timeout", no token; SchedulerConfig.max_queue_time_s on the
            simulated clock, stallfree.sim.run.replica.SimClock). Chunked batching only.

    Raises:
        ValueError: an unknown batching mode, a baseline with kv_policy "paged", scheduler not a
            SchedulerConfig, async_scheduling not a bool, or max_queue_time_s not a finite number > 0
            (or given with a baseline).
    """

    scheduler: SchedulerConfig
    batching: str = "chunked"
    async_scheduling: bool = False
    max_queue_time_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"scheduler must be a stallfree.core.SchedulerConfig, got {type(self.scheduler).__name__}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}; got {self.batching!r}")
        if self.scheduler.kv_policy == "paged" and self.batching != "chunked":
            raise ValueError(f"the paged scheduler runs chunked batching only; got batching={self.batching!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        limit = self.max_queue_time_s
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int | float) or not math.isfinite(limit) or limit <= 0:
                raise ValueError(f"max_queue_time_s must be a finite number of seconds > 0, got {limit!r}")
            if self.batching != "chunked":
                raise ValueError(f"max_queue_time_s applies to chunked batching, got batching={self.batching!r}")

    @classmethod
    def of(cls, kv_tokens: int, token_budget: int = DEFAULT_TOKEN_BUDGET, max_seqs: int = DEFAULT_MAX_SEQS, *,
           batching: str = "chunked", async_scheduling: bool = False, **options: Any) -> ReplicaConfig:
        """A ReplicaConfig over SchedulerConfig(token_budget, max_seqs, kv_tokens, **options), with the
        simulator's defaults (budget 2,048, 256 sequences).

        Raises:
            InvalidConfig: a SchedulerConfig field out of range (named).
            ValueError: as ReplicaConfig.
        """
        core = SchedulerConfig(token_budget, max_seqs, kv_tokens, **options)
        return cls(core, batching, async_scheduling)

    @property
    def token_budget(self) -> int:
        """The scheduler's token budget, tokens."""
        return self.scheduler.token_budget

    @property
    def max_seqs(self) -> int:
        """The scheduler's most running requests."""
        return self.scheduler.max_seqs

    @property
    def kv_tokens(self) -> int:
        """The scheduler's KV capacity, tokens."""
        return self.scheduler.kv_tokens

    def build(self) -> SchedulerLike:
        """Make a fresh scheduler: stallfree.Scheduler(scheduler) for chunked batching, else the baseline.

        Raises:
            InvalidConfig: a number is out of range.
        """
        if self.batching == "chunked":
            if self.max_queue_time_s is not None:
                return Scheduler(self.scheduler.replace(max_queue_time_s=self.max_queue_time_s, clock=SimClock()))
            return Scheduler(self.scheduler)
        classes: dict[str, Callable[[int, int, int], SchedulerLike]] = {
            "prefill-first": PrefillFirstScheduler,
            "no-chunk": NoChunkScheduler,
        }
        return classes[self.batching](self.token_budget, self.max_seqs, self.kv_tokens)

    @property
    def label(self) -> str:
        """A short name for tables: "chunked/2048", or "paged/2048" for the paged scheduler."""
        core = self.scheduler
        caching = core.enable_prefix_caching
        kind = ("paged+cache" if caching else "paged") if core.kv_policy == "paged" else self.batching
        if core.cpu_blocks:
            kind += "+cpu"
        base = f"{kind}/{self.token_budget}"
        k, lng, thr = core.partial_prefill_limits
        if k > 1:
            base += f"/K{k}L{lng}T{thr}"
        if self.async_scheduling:
            base += "/async"
        return base


_WARNED: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
    """One DeprecationWarning per process for `old`, naming `new` (the release after next removes `old`)."""
    if old not in _WARNED:
        _WARNED.add(old)
        warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def legacy_scheduler_config(
    kv_tokens: int, token_budget: int = DEFAULT_TOKEN_BUDGET, max_seqs: int = DEFAULT_MAX_SEQS,
    batching: str = "chunked", kv: str = "reserve", block_size: int = DEFAULT_BLOCK_SIZE,
    watermark: float = SchedulerConfig.watermark, prefix_caching: bool = False,
    partial_prefills: tuple[int, int, int] | None = None, cpu_kv_tokens: int = 0, async_scheduling: bool = False,
) -> ReplicaConfig:
    """The ReplicaConfig of the former stallfree.sim.SchedulerConfig(...)'s arguments (deprecated:
    `stallfree.sim.SchedulerConfig` resolves to this and warns once). Block size, watermark, caching and
    the tier apply under kv="paged" only, as they did.

    Raises:
        InvalidConfig, ValueError: as ReplicaConfig.of.
    """
    opts: dict[str, Any] = {}
    if partial_prefills is not None:
        k, lng, thr = partial_prefills
        opts.update(max_num_partial_prefills=k, max_long_partial_prefills=lng, long_prefill_token_threshold=thr)
    if kv == "paged":
        opts.update(kv_policy="paged", block_size=block_size, watermark=watermark,
                    enable_prefix_caching=prefix_caching, cpu_kv_tokens=cpu_kv_tokens)
    elif kv != "reserve":
        raise ValueError(f"kv must be 'reserve' or 'paged'; got {kv!r}")
    elif prefix_caching:
        raise ValueError(f"prefix caching needs the paged scheduler (kv='paged'); got kv={kv!r}")
    return ReplicaConfig.of(kv_tokens, token_budget, max_seqs, batching=batching, async_scheduling=async_scheduling,
                            **opts)


def async_of(scheduler: ReplicaConfig | Callable[[], SchedulerLike]) -> bool:
    """Whether `scheduler` schedules asynchronously: a ReplicaConfig's async_scheduling; False for a factory."""
    return isinstance(scheduler, ReplicaConfig) and scheduler.async_scheduling


def make_scheduler(scheduler: ReplicaConfig | Callable[[], SchedulerLike]) -> SchedulerLike:
    """A fresh scheduler from a ReplicaConfig (its build()) or a zero-argument factory."""
    if isinstance(scheduler, ReplicaConfig):
        return scheduler.build()
    return scheduler()


def wrap_checker(sched: SchedulerLike) -> SchedulerLike:
    """`sched` inside stallfree.core.invariants.InvariantChecker (raises on the first violated invariant);
    a scheduler with a CPU KV tier inside stallfree.core.invariants_tier.TieredInvariantChecker."""
    if isinstance(getattr(sched, "kv_manager", None), TieredKV):
        return cast(SchedulerLike, TieredInvariantChecker(sched))  # type: ignore[arg-type]
    # One checker for both KV policies (and for a time-budget wrapper, which reads as a Scheduler).
    return cast(SchedulerLike, InvariantChecker(sched))  # type: ignore[arg-type]
