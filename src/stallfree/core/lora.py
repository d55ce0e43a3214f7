"""LoRA adapters at admission: at most max_loras distinct adapters among the running requests, and the
bounded pass-over that keeps a request whose adapter cannot join from starving.

Imports allowed: the standard library only.

The rule (docs/scheduling.md, "LoRA adapters"; docs/DESIGN.md, the contract's one exception to
admission in queue order):

- A request names its adapter in `Request.lora` (None: the base model, which takes no adapter slot).
- The running requests (prefilling or decoding) hold at most `max_loras` distinct adapters. Every
  step's plan is drawn from the running requests, so it holds at most `max_loras` adapters too; an
  adapter a running request holds stays in a slot until its last running request leaves (finishes,
  is aborted or preempted), as its weights must stay in GPU memory for its next step.
- Admission in queue order: a waiting request *can join* when it has no adapter, its adapter is
  already running, or fewer than `max_loras` adapters are running. One that cannot join is passed
  over (it keeps its place) and later requests that can join are admitted, as vLLM's scheduler
  skips a request whose adapter does not fit; each step in which a later request is admitted past it
  counts as one pass. After `max_lora_passes` passes over its life it is passed no more: it stops
  admission, as a head that does not fit does, until running adapters leave and it can join. As
  running requests always finish (the contract's progress rule), nothing waits forever.

Source: the per-step adapter limit and the skip of a waiting request whose adapter cannot join are
vLLM's (vllm/v1/core/sched/scheduler.py, `max_loras`, `scheduled_loras`); the bound on passes is
ours, so that FCFS holds except for a bounded number of steps per request.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

__all__ = ["LoraSlots"]


class LoraSlots:
    """The adapters of the running requests and the pass-over rule; owned by one Scheduler.

    It is told of every admission (`join`) and every exit from the running set (`leave`); admission
    asks `can_join` and `may_pass` and reports the requests passed over (`passed`).

    Args:
        max_loras: the most distinct adapters among the running requests, an integer >= 1.
        max_lora_passes: the most steps in which a request whose adapter cannot join may be passed
            over by later requests, an integer >= 0 (0: it always blocks admission).

    Attributes:
        running: adapter -> number of running requests that hold it (read only).
        max_passes_seen: the most passes any request has had so far (read only).
    """

    __slots__ = ("max_loras", "max_lora_passes", "running", "max_passes_seen")

    def __init__(self, max_loras: int, max_lora_passes: int) -> None:
        self.max_loras = max_loras
        self.max_lora_passes = max_lora_passes
        self.running: dict[Hashable, int] = {}
        self.max_passes_seen = 0

    def can_join(self, lora: Hashable | None) -> bool:
        """Whether a request with adapter `lora` may run now without exceeding max_loras."""
        return lora is None or lora in self.running or len(self.running) < self.max_loras

    def may_pass(self, rec: Any) -> bool:
        """Whether waiting record `rec` (its adapter cannot join) may still be passed over by later
        requests; False: it stops admission this step."""
        passes: int = rec.lora_passes
        return passes < self.max_lora_passes

    def passed(self, recs: list[Any]) -> None:
        """Count one pass for each waiting record in `recs`: a later request was admitted past it."""
        for rec in recs:
            rec.lora_passes += 1
            if rec.lora_passes > self.max_passes_seen:
                self.max_passes_seen = rec.lora_passes

    def join(self, lora: Hashable | None) -> None:
        """A request with adapter `lora` starts running (admitted)."""
        if lora is not None:
            self.running[lora] = self.running.get(lora, 0) + 1

    def leave(self, lora: Hashable | None) -> None:
        """A request with adapter `lora` stops running (finished, aborted or preempted)."""
        if lora is not None:
            n = self.running[lora] - 1
            if n:
                self.running[lora] = n
            else:
                del self.running[lora]
