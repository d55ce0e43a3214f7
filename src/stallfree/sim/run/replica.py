"""One simulated replica: a scheduler, the SimResult rows it writes, and the per-request bookkeeping
that turns its steps into token times. The event loop (stallfree.sim.run.loop) drives it through three
calls: add a request, start a step, finish the step.

Imports allowed: the standard library, stallfree.core and stallfree.sim (result, costs).

A step is started at `now` (the scheduler's schedule(), priced by the cost model) and finished at
its end (complete(), its row recorded). The bookkeeping costs O(prefill chunks + finishes) per
step, never O(running decodes): decodes are seen from the step arrays, and only the rare
exceptions are stored per request (a decoding request left out of a step, a preemption); see
stallfree.sim.run.result.
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterable
from itertools import accumulate
from typing import Any, cast

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import RequestRejected
from stallfree.core.plain_steps import PlainDecodeRun, plain_decode_run
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request
from stallfree.core.scheduler import Scheduler
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.result import (
    KV_CAPACITY,
    DecodeTicks,
    RequestState,
    SchedulerLike,
    SimResult,
    SimulationError,
    StepStarts,
    same_float,
)
from stallfree.sim.run.tally import RunTally

__all__ = ["Replica"]

_WAITING = int(RequestState.WAITING)
_DECODING = int(RequestState.DECODING)
_DONE = int(RequestState.DONE)
#: The most plain decode steps asked for at once; and priced ahead at once, a replica parked in a run
#: waking after each chunk to price the next: the first chunk of a run _PLAIN_CHUNK_FIRST steps, each
#: next twice the last up to _PLAIN_CHUNK (a request routed to the replica cuts the run, and the steps
#: priced beyond the cut are wasted; each wake costs about what pricing ten steps does). A cost model
#: whose plain_decode_times is vectorized prices _PLAIN_CHUNK steps for about the cost of one: its
#: chunks are all _PLAIN_CHUNK long.
_PLAIN_LIMIT = 4096
#: Shorter runs are stepped through the scheduler: taking one costs about what three steps do.
_PLAIN_SHORTEST = 4
_PLAIN_CHUNK_FIRST = 32
_PLAIN_CHUNK = 256
#: With a tally (a run that keeps no records), step rows kept before the ones no request in flight can read
#: are folded into it and let go (about 30 bytes a row).
_FOLD_ROWS = 1 << 15
#: Keeping every row with compact_starts: the starts recorded before they are reduced to their exceptions
#: (8 bytes a row: 1 MiB).
_COMPACT_ROWS = 1 << 17


def _repeat(column: object, value: int, k: int) -> Iterable[int]:
    """`value` k times, as an array of `column`'s type when it is an array (extended by a copy of memory)."""
    code = getattr(column, "typecode", None)
    return array(code, (value,)) * k if code is not None else (value,) * k


#: Each finish reason's string, made once: a finished request's entry in SimResult.finish_reason is this
#: shared string rather than a new one (about 55 bytes a request).
_REASONS: dict[Hashable, str] = {}


def _reason(why: Hashable) -> str:
    """str(why), made once per reason (_REASONS)."""
    return _REASONS.setdefault(why, sys.intern(str(why)))


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class SimClock:
    """The simulated time, seconds, as a scheduler's clock: the replica sets `t` before each schedule()
    (ReplicaConfig(max_queue_time_s=...) gives its scheduler one). Picklable."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Replica:
    """One replica as the event loop drives it and as a router sees it.

    Owns its scheduler, its SimResult (rows for its own steps; per-request fields indexed by the
    global rid) and its bookkeeping; nothing else writes them. A router reads only the public
    attributes and properties below.

    Args:
        index: position in its group, 0-based.
        sched: the scheduler the loop calls (perhaps an InvariantChecker around `inner`).
        inner: the scheduler itself (its kv_free, num_waiting, last_finished are read).
        res: the SimResult it fills (n requests long).
        cost: prices its steps, s.
        async_scheduling: the engine plans each step while the previous one runs (vLLM's
            asynchronous scheduling): the event loop then hands the scheduler only the requests that
            arrived before the plan was made (stallfree.sim.run.loop.admit_async). Default off.
        tally: keep no records (stallfree.sim.run.tally): `res`'s step rows are a window from the
            step `base` on; a request's figures go to the tally when it finishes, and the rows no request
            in flight can read are folded into it (finish_tally folds the rest). None (default): every
            row is kept.
        state: the RequestState bytes to write (one per request of `res`), shared by a cluster's replicas;
            None (default): a new one. Each replica sharing one never allocates its own (n bytes each).
        compact_starts: keeping every row (no tally), hold the step starts as their exceptions as the run
            goes (a StepStarts: the starts that are not the previous step's end; every _COMPACT_ROWS rows
            the starts recorded are reduced to those) and leave `res.step_start` a StepStarts at
            finish_tally: 8 bytes a step less while the run goes, the same starts. For a cluster's
            replicas, whose merge makes them StepStarts anyway; nothing may read `res.step_start` before
            finish_tally. Default off.

    Attributes:
        num_outstanding: requests routed here and not finished or rejected.
        num_routed: requests routed here.
        pending: requests routed here and not yet handed to the scheduler (the loop's admission
            gate hands them over when the replica is idle).
        busy: a step is in flight.
        stalled: the last step was empty; waits for a request routed here.
        step_end: when the step in flight ends, s (while busy).
        step: steps recorded so far.
        last_start, last_end: start and end, s, of the last step finished (-inf before the first).
    """

    __slots__ = (
        "_append", "_complete", "_plan", "_schedule", "_start", "_step_time", "async_scheduling", "busy", "cost",
        "decoding", "index", "inner", "last_end", "last_start", "num_outstanding", "num_routed", "pending", "res",
        "sched", "seg_open", "stalled", "state", "step", "step_end", "tick", "_clock", "_plain_ok", "_ahead",
        "_ahead_i", "_ahead_start", "_ahead_nd", "_no_waiting", "_plain_times", "_plain_ends", "_run", "_chunk",
        "_chunk_first",
        "_cut", "_ticks_kept", "base", "tally", "_fold_at", "_inflight", "_prev_end", "_frontend",
        "_starts_at", "_starts_value", "_starts_base",
    )

    def __init__(self, index: int, sched: SchedulerLike, inner: SchedulerLike, res: SimResult,
                 cost: StepCostModel, async_scheduling: bool = False, tally: RunTally | None = None,
                 state: bytearray | None = None, compact_starts: bool = False) -> None:
        self.index = index
        self.async_scheduling = bool(async_scheduling)
        self.last_start = self.last_end = float("-inf")
        # A cost model with per-replica state (LoRA adapter residency, stallfree.sim.run.lora) binds to this one.
        bind = getattr(cost, "bind_replica", None)
        if bind is not None:
            cost = bind(res)
        self.sched, self.inner, self.res, self.cost = sched, inner, res, cost
        self.num_outstanding = 0
        self.num_routed = 0
        self.pending: list[Request] = []
        self.busy = False
        self.stalled = False
        self.step = 0
        # RequestState values, one byte per request.
        self.state = state if state is not None else bytearray(res.num_requests)
        self.decoding: set[int] = set()  # requests with a first token: to see skipped decodes
        self.tick = 0  # steps with decodes so far (res.step_ticks)
        # DecodeTicks counts them from step_decodes and keeps none of the values it is given.
        self._ticks_kept = not isinstance(res.step_ticks, DecodeTicks)
        self.seg_open: dict[int, int] = {}  # emitting step of the current stretch after a preemption
        self._plan: StepPlan | None = None  # the step in flight
        self._start = 0.0  # when it started, s
        self.step_end = 0.0  # when it ends, s (start_step's answer)
        # A queue time limit reads the simulated clock (SimClock), set before each schedule().
        clock = getattr(getattr(inner, "config", None), "clock", None)
        self._clock = clock if isinstance(clock, SimClock) else None
        # Bound once: the per-step path is the simulator's hot loop.
        self._schedule, self._complete, self._step_time = sched.schedule, sched.complete, cost.step_time
        self._append = (res.step_start.append, res.step_end.append, res.step_tokens.append,
                        res.step_decodes.append, res.step_kv_used.append, res.step_waiting.append,
                        res.step_ticks.append)
        # Runs of plain decode steps (stallfree.core.plain_steps) are taken at once when the scheduler is
        # called directly (no invariant checker) and the step's price depends on its plan alone.
        self._plain_ok = (sched is inner and isinstance(inner, Scheduler)
                          and bool(getattr(cost, "pure_step_time", False)) and self._clock is None)
        # While parked in such a run: the run, the ends, s, of its steps priced ahead, the next one's index
        # (the step in flight), when that one started, s, and the run's decodes per step.
        self._run: PlainDecodeRun | None = None
        vectorized = getattr(cost, "plain_decode_times_vectorized", False)
        self._chunk_first = _PLAIN_CHUNK if vectorized else _PLAIN_CHUNK_FIRST
        self._chunk = self._chunk_first  # steps to price next: doubles while a run goes on uncut
        self._ahead: array[float] | None = None  # floats ('d')
        self._plain_times = getattr(cost, "plain_decode_times", None) if self._plain_ok else None
        self._plain_ends = getattr(cost, "plain_decode_ends", None) if self._plain_ok else None
        self._ahead_i = 0
        self._cut = 0  # the run's steps before this index may be taken before what is pending is admitted
        self._ahead_start = 0.0
        self._ahead_nd = 0
        self._no_waiting: Any = _repeat(res.step_waiting, 0, 1)  # a plain step's row of step_waiting
        # Keeping no records: the window's first step, the in-flight requests' admission steps (the oldest
        # is the first row a finish can read), the end, s, of the last row folded.
        self.tally = tally
        self.base = 0
        self._fold_at = _FOLD_ROWS if tally is not None else sys.maxsize
        # Keeping every row with compact_starts: the starts' exceptions so far (StepStarts' `at` and `value`)
        # and the step number of res.step_start's first row.
        self._starts_at: array[int] | None = None
        self._starts_value: array[float] | None = None
        self._starts_base = 0
        if compact_starts and tally is None:
            self._starts_at, self._starts_value = array("q"), array("d")
            self._fold_at = _COMPACT_ROWS
        self._inflight: dict[int, int] | None = {} if tally is not None else None
        self._prev_end = 0.0
        self._frontend = float(res.config.get("frontend_s", 0.0))

    @property
    def kv_free(self) -> int:
        """Free KV as of the last step started, tokens."""
        return int(self.inner.kv_free)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission: in the scheduler's queue or routed here since its last step."""
        return int(self.inner.num_waiting) + len(self.pending)

    @property
    def kv_total(self) -> int:
        """KV capacity, tokens."""
        return self.inner.stats().kv_total

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of `request`'s prompt whose KV this replica holds in its prefix cache.

        0 when the scheduler keeps no prefix cache or the request carries no block hashes.
        """
        if request.block_hashes is None:
            return 0
        return int(self.inner.cached_prefix_len(request))

    def refuse(self, rid: int, reason: str, kind: str = KV_CAPACITY) -> None:
        """Record request `rid` as rejected here (it was routed here and will never run)."""
        self.res.rejected.append((rid, reason))
        self.res.rejected_kind[rid] = kind
        self.state[rid] = _DONE
        self.num_outstanding -= 1

    def add(self, req: Request) -> bool:
        """Hand `req` to the scheduler; an output shorter than its max_new is set to stop on its last
        wanted token (stop_after). Returns False when the scheduler rejects it (recorded, kind
        "kv_capacity")."""
        rid = cast(int, req.rid)
        try:
            self.sched.add(req)
        except RequestRejected as exc:
            self.refuse(rid, str(exc))
            return False
        target = self.res.target[rid]
        if target < req.max_new:
            self.sched.stop_after(rid, target)
        return True

    def start_step(self, now: float) -> float | None:
        """Schedule one step at `now`, s; return its end time, s, or None for an empty plan (which
        is completed and recorded at once, with no duration: the replica stalls)."""
        if self._clock is not None:
            self._clock.t = now
        plan = self._schedule()
        if not plan.num_tokens and not plan.preempted:
            self.tick = self._close(plan, now, now, self.step, self.tick)
            self.step += 1
            self.stalled = True
            return None
        step = self.step
        if plan.preempted:
            self._preempt(plan.preempted, step)
        if plan.num_decodes != len(self.decoding):
            self._skips(plan, step)
        if plan.admitted:
            self._admitted(plan.admitted, step)
        self._plan, self._start = plan, now
        self.busy = True
        end = self.step_end = now + self._step_time(plan)
        return end

    def finish_step(self, end: float) -> dict[Hashable, FinishReason]:
        """Complete the step in flight at its end, `end` s (what start_step returned), and record its
        row; return the requests that finished in it (rid -> reason; the scheduler's last_finished).

        Raises:
            SimulationError: no step is in flight.
        """
        plan = self._plan
        if plan is None:
            raise SimulationError(f"replica {self.index}: finish_step without a step in flight")
        start = self._start
        self._plan = None
        self.last_start, self.last_end = start, end
        self.busy = False
        self.tick = self._close(plan, start, end, self.step, self.tick)
        self.step += 1
        return self.inner.last_finished

    @property
    def parked(self) -> bool:
        """In a run of plain decode steps priced ahead (advance(park=True)): the step in flight is the run's
        next (its end is `step_end`) and has no plan object until it is taken."""
        return self._ahead is not None

    @property
    def wake_at(self) -> float:
        """The latest time, s, up to which this busy replica may be left alone by a loop whose router reads
        only num_outstanding: the end of the last step of the plain run it is parked in (no request
        finishes before the step after it), else the end of the step in flight."""
        ahead = self._ahead
        return ahead[self._cut - 1] if ahead is not None else self.step_end

    def cut_at(self, now: float) -> bool:
        """A request was routed to this parked replica at `now`, s: the run's step in flight then is the last
        it takes before admitting it (at that step's end, as the heap would; wake_at is then that end).
        False, nothing changed, when a step of the run ends at `now` exactly: the caller takes the steps
        up to `now` first (advance), and the request is admitted at `now`."""
        ends, i = cast("array[float]", self._ahead), self._ahead_i
        p = bisect_right(ends, now, i)
        if p > i and ends[p - 1] == now:
            return False
        self._cut = min(self._cut, p + 1)
        return True

    def advance(self, until: float, admit: Callable[[Replica, float], None], park: bool = False) -> None:
        """Run this replica on its own up to `until`, s (the next arrival), as the event loop would when
        nothing but its own steps can happen before then (EventLoop._run_apart): finish the step in flight
        if it ends by `until`; if it ended before, hand the scheduler what is pending (`admit`, the gate's)
        and start the next step at that end, and so on. A step that ends at `until` is finished and the next
        one left to start after that instant's arrivals; one that ends after `until` stays in flight; an
        idle or stalled replica is left as it is. What finish_step and start_step do, step for step and row
        for row (each step completed by _close, as theirs), with the step number and ticks in locals.

        Runs of plain decode steps (stallfree.core.plain_steps) are priced without a plan object each and
        taken at once, their rows written together. With `park`, a run is priced to its end and the
        replica parks in it when `until` falls inside: the step in flight is then the run's next, taken
        when a later call reaches its end (wake_at says until when nothing a router reading
        num_outstanding sees can change). A parked replica given a request (pending) takes at most its
        step in flight before admitting it.
        """
        if not self.busy or self.step_end > until:
            return
        schedule, close, step_time = self._schedule, self._close, self._step_time
        inner, decoding = self.inner, self.decoding
        has_unfinished = inner.has_unfinished
        clock = self._clock
        plain = self._plain_ok
        plan, start, end = self._plan, self._start, self.step_end
        step, tick = self.step, self.tick
        try:
            while True:
                if plan is None:
                    # Parked in a plain run: its steps that end by `until` are taken at once.
                    self.step, self.tick = step, tick
                    end = self._take_plain(until)
                    step, tick = self.step, self.tick
                    if self._ahead is not None:
                        if end == until or not park or self._ahead_i >= self._cut:
                            self._ahead = None  # the rest is planned afresh (after this instant's arrivals)
                        else:
                            return  # parked: the next ends after `until`
                    if end == until:
                        break
                else:
                    # The step in flight ends (finish_step).
                    self.last_start, self.last_end = start, end
                    tick = close(plan, start, end, step, tick)
                    step += 1
                    if end == until:
                        break
                # The next starts at its end (start_step), with what is pending.
                admitted = False
                if self.pending:
                    admit(self, end)
                    admitted = True  # then it waits, and the next step is no plain decode step
                if not has_unfinished():
                    break
                now = end
                if plain and not admitted:
                    run = plain_decode_run(inner, _PLAIN_LIMIT)  # type: ignore[arg-type]
                    if run is not None and run.num_steps >= _PLAIN_SHORTEST and self._price_plain(
                            now, run, math.inf if park else until):
                        plan = self._plan = None
                        if self.step_end <= until:
                            continue
                        if park:
                            return
                        self._ahead = None
                if clock is not None:
                    clock.t = now
                self._chunk = self._chunk_first
                plan = schedule()
                if not plan.num_tokens and not plan.preempted:
                    tick = close(plan, now, now, step, tick)
                    step += 1
                    self.stalled = True
                    break
                if plan.preempted:
                    self._preempt(plan.preempted, step)
                if plan.num_decodes != len(decoding):
                    self._skips(plan, step)
                if plan.admitted:
                    self._admitted(plan.admitted, step)
                start, end = now, now + step_time(plan)
                if end > until:
                    self._plan, self._start, self.step_end = plan, start, end
                    return
            self._plan = None
            self._ahead = None
            self.busy = False
        finally:
            self.step, self.tick = step, tick

    def _price_plain(self, now: float, run: PlainDecodeRun, cutoff: float) -> bool:
        """Price the steps of `run` from `now`, s, each starting as the previous ends:
        _PLAIN_CHUNK of them, or with a finite `cutoff`, s, chunks until one ends after it; park in them
        (the first is the step in flight). The cost model's plain_decode_ends or plain_decode_times where
        it has one (the same floats), else each step's plan. False (nothing done) when some request with a
        first token is not among their decodes."""
        nd, n = run.num_decodes, run.num_steps
        if nd != len(self.decoding):
            return False
        ends_of = self._plain_ends
        if ends_of is not None and cutoff == math.inf:  # one chunk, priced by the cost model (the loop below's)
            chunk = self._chunk
            self._chunk = min(2 * chunk, _PLAIN_CHUNK)
            ends = ends_of(nd, run.offset_sum, run.step, min(n, chunk), now)
        else:
            ends = self._price_chunks(run, now, cutoff)
        self._run, self._ahead, self._ahead_i, self._ahead_start, self._ahead_nd = run, ends, 0, now, nd
        # Requests pending already (held back by asynchronous scheduling) are looked at after each step.
        self._cut = 1 if self.pending else len(ends)
        self.step_end = ends[0]
        return True

    def _price_chunks(self, run: PlainDecodeRun, now: float, cutoff: float) -> array[float]:
        """The ends, s, of the steps _price_plain prices: chunk after chunk from `now`, s, until one ends
        after `cutoff`, s (one with an infinite cutoff)."""
        nd, n = run.num_decodes, run.num_steps
        step0, offset_sum, ends_of = run.step, run.offset_sum, self._plain_ends
        times, step_time = self._plain_times, self._step_time
        first = offsets = None
        ends = array("d")
        t = now
        i = 0
        while i < n:
            count = min(n - i, self._chunk)
            self._chunk = min(2 * self._chunk, _PLAIN_CHUNK)
            if ends_of is not None:  # the cost model adds the steps up itself (the same floats as below)
                ends.extend(ends_of(nd, offset_sum, step0 + i, count, t))
            else:
                if first is None:
                    first = run.plan(0)
                    offsets = first.decode_offsets
                durations = None if times is None else times(offsets, offset_sum, step0 + i, count)
                if durations is None:
                    durations = [step_time(first if j == 0 else run.plan(j)) for j in range(i, i + count)]
                ends.extend(accumulate(durations, initial=t))  # t + d, each starting as the previous ends
                del ends[-count - 1]  # the start
            t = ends[-1]
            i += count
            if t > cutoff or cutoff == math.inf:
                break
        return ends

    def _take_plain(self, until: float) -> float:
        """Take the parked run's steps that end by `until`, s (none past its cut: cut_at): their rows, the
        scheduler's skip; return the end, s, of the last one taken (the previous end when none). Drops
        the run when it is used up."""
        ends, i = cast("array[float]", self._ahead), self._ahead_i
        j = min(bisect_right(ends, until, i), self._cut)
        k = j - i
        if k == 0:
            return self._ahead_start
        first = self._ahead_start
        free = cast(PlainDecodeRun, self._run).take(k)
        res, nd, kv_total = self.res, self._ahead_nd, self.res.kv_total
        taken = ends[i:j]
        res.step_start.append(first)
        if k > 1:
            res.step_start.extend(taken[:-1])
        res.step_end.extend(taken)
        same = _repeat(res.step_tokens, nd, k)
        res.step_tokens.extend(same)
        # The decodes' column may be of another type than the tokens' (simulator.step_count_codes).
        same_type = getattr(res.step_decodes, "typecode", None) == getattr(res.step_tokens, "typecode", None)
        res.step_decodes.extend(same if same_type else _repeat(res.step_decodes, nd, k))
        kv_used, f0 = res.step_kv_used, free[0]
        unchanged = free.count(f0)
        if unchanged == k:  # nothing promised or freed in them (so under reservations but at a finish)
            kv_used.extend(_repeat(kv_used, kv_total - f0, k))
        elif unchanged == k - 1 and free[-1] != f0:  # freed at the last step's finish alone (reservations)
            kv_used.extend(_repeat(kv_used, kv_total - f0, k - 1))
            kv_used.append(kv_total - free[-1])
        else:
            kv_used.extend([kv_total - f for f in free])
        res.step_waiting.extend(self._no_waiting * k)  # nothing waits in a plain run (plain_steps)
        tick = self.tick
        if self._ticks_kept:
            res.step_ticks.extend(range(tick + 1, tick + k + 1))
        self.tick = tick + k
        self.step += k
        finished = self.inner.last_finished
        if finished:  # the run's last step finished requests
            self._finished(finished, self.step - 1)
            self.num_outstanding -= len(finished)
        if len(res.step_end) >= self._fold_at:
            self._fold()
        end = taken[-1]
        self.last_start = taken[-2] if k > 1 else first
        self.last_end = end
        if j == len(ends):
            self._ahead = None
        else:
            self._ahead_i, self._ahead_start, self.step_end = j, end, ends[j]
        return end

    def run_steps(self, now: float, until: float) -> float:
        """Run steps back to back from `now`, s, each starting as the previous ends, while a step
        would start before `until`, s (the next arrival), the scheduler has work and no plan is
        empty; return the time the last one ended (or `now`). What start_step(t) and finish_step at
        its end do, step for step and row for row, for a loop that knows nothing can happen during
        a step (EventLoop's single-replica open-loop path), with the step number and ticks in locals
        and each step completed by _close, as finish_step completes it.

        Raises:
            SimulationError: as start_step.
        """
        schedule, close, step_time = self._schedule, self._close, self._step_time
        inner, decoding = self.inner, self.decoding
        has_unfinished = inner.has_unfinished
        step, tick = self.step, self.tick
        clock = self._clock
        try:
            while now < until and has_unfinished():
                if clock is not None:
                    clock.t = now
                plan = schedule()
                if not plan.num_tokens and not plan.preempted:
                    tick = close(plan, now, now, step, tick)
                    step += 1
                    self.stalled = True
                    break
                nd = plan.num_decodes
                if plan.preempted:
                    self._preempt(plan.preempted, step)
                if nd != len(decoding):
                    self._skips(plan, step)
                if plan.admitted:
                    self._admitted(plan.admitted, step)
                end = now + step_time(plan)
                tick = close(plan, now, end, step, tick)
                step += 1
                now = end
        finally:
            self.step, self.tick = step, tick
        return now

    def _close(self, plan: StepPlan, start: float, end: float, step: int, tick: int) -> int:
        """Complete `plan`, step number `step`, run from `start` to `end`, s, and write its row; `tick`:
        the steps with decodes before it. Returns those after it. Its finishes (the scheduler's
        last_finished) are recorded after the row: closing a preempted request's segments reads it. The
        one completion of a step that goes through the scheduler (finish_step, advance, run_steps)."""
        inner = self.inner
        self._complete(plan)
        nd = plan.num_decodes
        if nd:
            tick += 1
        if plan.prefills:
            self._emitted_from_prefill(plan, step)
        a_start, a_end, a_tok, a_dec, a_kv, a_wait, a_tick = self._append
        a_start(start)
        a_end(end)
        a_tok(plan.num_tokens)
        a_dec(nd)
        a_kv(self.res.kv_total - inner.kv_free)
        a_wait(inner.num_waiting)
        a_tick(tick)
        finished = inner.last_finished
        if finished:
            self._finished(finished, step)
            self.num_outstanding -= len(finished)
        if len(self.res.step_end) >= self._fold_at:
            self._fold()
        return tick

    def _admitted(self, rids: Iterable[Hashable], step: int) -> None:
        """Requests admitted in step `step`: the first admission's step is each one's admit_step."""
        admit_step, inflight = self.res.admit_step, self._inflight
        for rid in rids:
            r = cast(int, rid)
            if admit_step[r] < 0:
                admit_step[r] = step
                if inflight is not None:
                    inflight[r] = step

    def _emitted_from_prefill(self, plan: StepPlan, step: int) -> None:
        """A last prefill chunk emitted a token: the first, or the next after a preemption."""
        res = self.res
        for c in plan.prefills:
            if not c.is_last:
                continue
            r = cast(int, c.rid)
            if res.first_step[r] < 0:
                res.first_step[r] = step
            else:
                self.seg_open[r] = step
            self.state[r] = _DECODING
            self.decoding.add(r)

    def _finished(self, finished: dict[Hashable, FinishReason], step: int) -> None:
        res = self.res
        for r, why in finished.items():
            ri = cast(int, r)
            res.finish_step[ri] = step
            res.finish_reason[ri] = _REASONS.get(why) or _reason(why)
            if self.state[ri] == _DECODING:
                self.decoding.discard(ri)
            self.state[ri] = _DONE
            if ri in self.seg_open or ri in res.segments:
                self._close_segment(ri, step)
        if self.tally is not None:
            self._account(finished, step)

    def _skips(self, plan: StepPlan, step: int) -> None:
        """Some decoding requests are not decoding in this step: record it (rare but for steps
        without any decode, which the step arrays already show)."""
        nd = plan.num_decodes
        if nd > len(self.decoding):
            raise SimulationError(
                f"step {step} decodes {nd} requests but only {len(self.decoding)} have a first token"
            )
        if nd == 0:
            return
        present = set(plan.decode_rids)
        for r in self.decoding - present:
            self.res.skips.setdefault(r, []).append(step)

    def _preempt(self, rids: Iterable[Hashable], step: int) -> None:
        """Preempted requests (paged schedulers) stop decoding until their recompute prefill ends."""
        for rid in rids:
            r = cast(int, rid)
            if self.state[r] != _DECODING:
                continue
            self._close_segment(r, step - 1)
            self.state[r] = _WAITING
            self.decoding.discard(r)

    def _close_segment(self, r: int, last: int) -> None:
        """End request r's current stretch at step `last`."""
        res = self.res
        segs = res.segments.setdefault(r, [])
        start = self.seg_open.pop(r, res.first_step[r])
        segs.append((start, last))

    # Keeping no records (tally): a finished request's figures, and the window of step rows.

    def _account(self, finished: dict[Hashable, FinishReason], step: int) -> None:
        """Give the tally the figures of the requests that finished in step `step` (as
        stallfree.sim.outputs.report.latency_arrays defines them), and check each one's tokens (as
        verify_tokens does).

        Raises:
            SimulationError: a request emitted more or fewer tokens than its target.
        """
        res, base, tally = self.res, self.base, cast(RunTally, self.tally)
        end, start = res.step_end, res.step_start
        finish = end[step - base]
        frontend = self._frontend
        inflight = cast("dict[int, int]", self._inflight)
        for rid in finished:
            r = cast(int, rid)
            inflight.pop(r, None)
            first = res.first_step[r]
            if first < 0:
                continue  # shed before its first token: in no latency figure
            arrival, target = res.arrival[r], res.target[r]
            t_first = end[first - base]
            tpot = (finish - t_first) / (target - 1) if target > 1 else None
            queue = start[res.admit_step[r] - base] - arrival
            tally.request(t_first - arrival + frontend, tpot, finish - arrival + frontend, queue, finish,
                          res.prompt_len[r], target)
            if r in res.skips or r in res.segments:
                got = self._irregular_gaps(r, first, step)
                res.skips.pop(r, None)  # what is left of a finished request: its figures
                res.segments.pop(r, None)
            else:
                got = step - first + 1  # a first token, then one in each step after it
            if got != target and res.finish_reason[r] not in ("abort", "timeout"):
                raise SimulationError(f"request {r} emitted {got} tokens, expected {target} "
                                      f"(finish reason {res.finish_reason[r]!r})")

    def _irregular_gaps(self, r: int, first: int, finish: int) -> int:
        """A request left out of some step or preempted: its true inter-token gaps go to the tally and the
        per-step ones counted for its decodes (each step's end minus the previous step's, as _fold counts
        them) are taken back. Returns its tokens."""
        import numpy as np

        res, base = self.res, self.base
        end, dec = res.step_end, res.step_decodes
        skipped = set(res.skips.get(r, ()))
        token_steps: list[int] = []
        decode_steps: list[int] = []
        for a, b in res.segments.get(r) or [(first, finish)]:
            token_steps.append(a)
            for s in range(a + 1, b + 1):
                if dec[s - base] and s not in skipped:
                    token_steps.append(s)
                    decode_steps.append(s)
        tally = cast(RunTally, self.tally)
        if len(token_steps) > 1:
            times = np.array([end[s - base] for s in token_steps], dtype=np.float64)
            true = np.diff(times)
            tally.gaps(true, np.ones(len(true), dtype=np.int64))
        if decode_steps:
            counted = np.array([end[s - base] - end[s - 1 - base] for s in decode_steps], dtype=np.float64)
            tally.gaps(counted, -np.ones(len(counted), dtype=np.int64))
        return len(token_steps)

    def _fold(self, final: bool = False) -> None:
        """Fold the window's rows before the oldest in-flight request's admission (every row when `final`)
        into the tally and let them go: the rows no finish can read any more."""
        tally = self.tally
        if tally is None:
            self._compact_starts()
            return
        import numpy as np

        res = self.res
        n = len(res.step_end)
        inflight = cast("dict[int, int]", self._inflight)
        keep = n if final or not inflight else min(min(inflight.values()) - self.base, n)
        if keep > 0:
            ends = np.array(res.step_end[:keep], dtype=np.float64)
            tally.steps(
                np.array(res.step_start[:keep], dtype=np.float64), ends, self._prev_end,
                np.array(res.step_tokens[:keep], dtype=np.int64), np.array(res.step_decodes[:keep], dtype=np.int64),
                np.array(res.step_kv_used[:keep], dtype=np.int64), np.array(res.step_waiting[:keep], dtype=np.int64),
            )
            self._prev_end = float(ends[-1])
            for column in (res.step_start, res.step_end, res.step_tokens, res.step_decodes, res.step_kv_used,
                           res.step_waiting):
                del column[:keep]
            self.base += keep
        self._fold_at = len(res.step_end) + _FOLD_ROWS

    def _compact_starts(self) -> None:
        """Keeping every row with compact_starts: reduce the starts recorded since the last call to their
        exceptions (StepStarts.of against the step ends, the first of them kept only if it is not the
        previous step's end, bit for bit) and let them go."""
        res = self.res
        start, end = res.step_start, res.step_end
        at, value = cast("array[int]", self._starts_at), cast("array[float]", self._starts_value)
        g, n = self._starts_base, len(start)
        if n:
            mark = len(at)
            StepStarts.of(start, end[g:g + n], g, at, value)  # start[i] against end[g + i - 1], i >= 1
            if g > 0 and at[mark] == g and same_float(value[mark], end[g - 1]):
                del at[mark]
                del value[mark]
            del start[:]
            self._starts_base = g + n
        self._fold_at = len(end) + _COMPACT_ROWS

    def finish_tally(self) -> None:
        """After the run: fold every row left into the tally and flush its buffers (keeping no records);
        with compact_starts, reduce the last starts and leave res.step_start a StepStarts."""
        if self.tally is not None:
            self._fold(final=True)
            self.tally.flush()
        elif self._starts_at is not None:
            self._compact_starts()
            res = self.res
            res.step_start = StepStarts(res.step_end, self._starts_at,  # type: ignore[assignment]
                                        cast("array[float]", self._starts_value))
            self._starts_at = self._starts_value = None
