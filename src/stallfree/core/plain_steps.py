"""Runs of plain decode steps taken at once (plain_decode_run): for a simulator that advances many
lightly loaded replicas, where most steps are the same decodes one token further on.

Imports allowed: the standard library and stallfree.core only.

A *plain decode step* is one whose plan holds every running decode, one token each, and nothing else:
nothing waits, no prompt is partly prefilled, no speculative or draft token, no fairness counters, no
clock, no abort pending, no second KV tier, and the KV manager's block promises for it succeed
(reservations need none; paged KV promises a block to each decode whose token starts one). A *run* of
them ends with the first step in which a decode finishes. Before that step the scheduler changes only
its step number, its finish index (`_due`, whose stale keys complete() pops) and, under paged KV, the
count of promised blocks; in it, the decodes due finish as complete() finishes them. So k steps of a
run can be applied at once, as k rounds of schedule() and complete() would apply them, without a plan
object per step; a caller that needs a step's plan (to price it) asks for it (`PlainDecodeRun.plan`),
and gets the plan schedule() would return, field for field. A function of the scheduler rather than a
method: the Scheduler's face stays the contract's (docs/DESIGN.md section 4).

The tests (tests/core/test_plain_steps.py) run schedulers side by side, one stepping and one skipping,
and compare every plan and figure afterwards.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, Any, cast

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.decode import PlainDecodes
from stallfree.core.errors import InvalidConfig, SchedulerStateError
from stallfree.core.kv.paged import PagedKV
from stallfree.core.kv.reservation import ReservationKV
from stallfree.core.lifecycle import end_reason
from stallfree.core.plan import StepPlan
from stallfree.core.prefill import NO_LIMITS
from stallfree.core.request import RequestStatus

if TYPE_CHECKING:
    from stallfree.core.scheduler import Scheduler

__all__ = ["PlainDecodeRun", "plain_decode_run"]

_PLAIN_KV = (ReservationKV, PagedKV)
_DECODING = RequestStatus.DECODING


def _count(s: Any, limit: int) -> int:
    """How many of the scheduler `s`'s next steps, at most `limit`, are plain decode steps (0: the next is
    not one, or a plan is in flight). O(running decodes), plus O(steps) under paged KV."""
    if (s._inflight is not None or s._partials or len(s._waiting) or s._inflight_aborts
            or s._fair is not None or s._lora is not None or s._clock is not None
            or type(s._decode) is not PlainDecodes or type(s._kv) not in _PLAIN_KV):
        return 0
    recs = s._decodes.recs
    if not recs or len(recs) > s._token_budget:
        return 0
    step = s._step
    # Steps step .. first - 1 finish nothing and step `first` is the run's last: a decode finishes in the
    # step numbered its finish_step, a key of the finish index (its other keys, left by decodes that moved,
    # only make the run shorter). Looked up from `step` on: the next finish is a few steps away, and
    # min() over the index reads every key.
    due = s._due
    first = step
    end = step + limit
    while first < end and first not in due:
        first += 1
    n: int = min(first - step + 1, limit)
    kv = s._kv
    if n <= 0 or type(kv) is ReservationKV:
        return max(n, 0)
    # Paged: step step + i promises a block to each decode filed under residue (step + i) % block_size. The
    # run stops before the first step whose promise fails (it grows decodes one by one, preempting): the
    # most steps m whose promises sum to at most the free blocks, found by whole cycles of block_size steps
    # (each promising `cycle` blocks) and then the residues in order.
    buckets, size = kv.buckets, kv.block_size
    free = kv.pool.num_free
    if free >= len(recs) * -(-n // size):  # at most a block per decode every block_size steps
        return n
    prefix = [0]
    for i in range(size):
        prefix.append(prefix[-1] + len(buckets.get((step + i) % size, ())))
    cycle = prefix[-1]
    if not cycle:
        return n
    whole = free // cycle
    m: int = whole * size + bisect_right(prefix, free - whole * cycle) - 1
    return min(n, m)


def plain_decode_run(scheduler: Scheduler, limit: object) -> PlainDecodeRun | None:
    """The run of plain decode steps (module docstring) `scheduler` is about to take: its next steps, at
    most `limit`, each the running decodes one token further, the last the first in which one finishes
    (or the limit's). None when the next step is not one (or a plan is in flight). O(running decodes),
    plus O(steps) under paged KV.

    Raises:
        InvalidConfig: `limit` is not an integer >= 1.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidConfig(f"plain_decode_run(): limit must be an integer >= 1, got {limit!r}")
    n = _count(scheduler, limit)
    return PlainDecodeRun(scheduler, n) if n else None


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PlainDecodeRun:
    """A run of plain decode steps of one scheduler, from its next step (plain_decode_run).

    Valid while the scheduler is changed only through `take` (add, abort, stop_after, schedule and
    complete end it: `take` then refuses). Not thread-safe, as the scheduler.

    Attributes:
        step: the number of the run's next step.
        num_steps: the steps left in the run.
        num_decodes: decodes in each of its steps.
        offset_sum: the sum of its decodes' StepPlan offsets, tokens: step s's decode_context_sum is
            offset_sum + num_decodes * s.
    """

    __slots__ = ("_sched", "step", "num_steps", "num_decodes", "offset_sum")

    def __init__(self, scheduler: Scheduler, num_steps: int) -> None:
        self._sched, self.step, self.num_steps = scheduler, scheduler._step, num_steps
        dec = scheduler._decodes
        self.num_decodes = len(dec.recs)
        dec.tuples()  # as schedule() would: the shared tuples made current (and marked clean)
        self.offset_sum = dec._offset_sum

    def plan(self, ahead: object) -> StepPlan:
        """The plan schedule() would return for the run's step `ahead` steps after its next (0: the next),
        the steps before it taken as planned; not in flight, nothing changes. O(1).

        Raises:
            SchedulerStateError: `ahead` is not an integer from 0 to num_steps - 1.
        """
        if isinstance(ahead, bool) or not isinstance(ahead, int) or not 0 <= ahead < self.num_steps:
            raise SchedulerStateError(f"PlainDecodeRun.plan(): ahead must be an integer from 0 to "
                                      f"{self.num_steps - 1}, got {ahead!r}")
        s = self._sched
        dec = s._decodes
        rids, offsets = dec.tuples()
        step = self.step + ahead
        n = len(rids)
        return StepPlan(step, rids, offsets, (), n, dec._offset_sum + n * step, s._token_budget, (), (), None,
                        decode_offsets_sorted=dec.sorted_offsets())

    def _unchanged(self) -> bool:
        """Whether the scheduler is as the run found it, but for the steps taken: no plan in flight, its
        next step the run's, nothing waiting or prefilling, no abort pending, the same decodes (a decode
        that left or moved marks the decode set). O(1)."""
        s = self._sched
        dec = s._decodes
        return (s._step == self.step and s._inflight is None and not s._partials and not len(s._waiting)
                and not s._inflight_aborts and not dec._dirty and not dec._stale
                and len(dec.recs) == self.num_decodes)

    def take(self, count: object) -> list[int]:
        """Take the run's next `count` steps at once: the scheduler is left as schedule() and complete(plan)
        `count` times would leave it (last_finished: the requests the last of them finished, when it is the
        run's last). Returns the free KV, tokens, after each of them (what `kv_free` would read after each
        complete()).

        Raises:
            SchedulerStateError: `count` is not an integer from 0 to num_steps, or the scheduler changed
                since the run was found (its next step is another, or it no longer has `count` plain
                decode steps); nothing changes.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= self.num_steps:
            raise SchedulerStateError(
                f"PlainDecodeRun.take(): count must be an integer from 0 to {self.num_steps}, got {count!r}")
        s = self._sched
        if count and not self._unchanged():
            raise SchedulerStateError(
                f"PlainDecodeRun.take({count}): the scheduler changed since the run was found at step {self.step}")
        step, kv, due = self.step, cast(Any, s._kv), s._due
        if type(kv) is ReservationKV:
            free_after = [kv.kv_free] * count
        else:
            promise = kv.promise_decode_blocks
            free_after = []
            free = kv.kv_free
            for n in range(step, step + count):
                if kv.buckets.get(n % kv.block_size):
                    promise(n)  # succeeds: counted by _count
                    free = kv.kv_free
                free_after.append(free)
        last = step + count - 1
        if due and min(due) < last:
            # Stale entries of decodes whose finish moved, which complete() pops step by step.
            for key in [k for k in due if step <= k < last]:
                del due[key]
        s._step = self.step = step + count
        self.num_steps -= count
        s._decodes.clock = s._step
        s.last_finished = {}
        s._limits = NO_LIMITS
        ending = due.pop(last, None) if count else None
        if ending:
            # The run's last step may finish decodes, as complete() finishes them.
            for obj in ending:
                if obj.status is _DECODING and obj.finish_step == last:
                    s._finish(obj, end_reason(obj))
            free_after[-1] = kv.kv_free
        return free_after
