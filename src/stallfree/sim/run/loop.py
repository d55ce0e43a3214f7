"""The simulator's one event loop: replicas on one simulated clock, driven by a heap of events keyed
by (time, kind, sequence), with pluggable parts for what differs between a single replica, a
cluster and disaggregated prefill and decode.

Imports allowed: the standard library and stallfree.sim (result, replica, load).

Parts (each a plain callable or object, supplied by the topology that builds the loop):
  - `arrive(rid, now)`: a request of the load arrives; the topology's router picks a replica and
    appends the request to its `pending` list (or refuses it). Single replica: the trivial router.
  - `on_finish(replica, finished, end)`: requests finished in a step ending at `end`; where
    disaggregation schedules a KV transfer (`EventLoop.at`) and closed-loop load sends the next
    request (stallfree.sim.run.load.Arrivals.ended).
  - `gate`: the admission gate that hands a replica's pending requests to its scheduler when the
    replica is idle (default: all of them, in order; Replica.add), and may correct a recorded
    step's row (`recorded`, after on_finish).

Time order. At each instant t, in this order: events due by t pop in (time, kind, sequence) order,
a step's end (kind STEP_END) before a scheduled callback (kind CALLBACK) at the same time, each
kind in the order it was pushed (ties never depend on hashing or dict order); then every request
arriving by t arrives, in workload order; then every idle replica with work, in the order given,
gets its pending requests and starts a step at t. A request arriving during a replica's step
waits for the step's end, so one replica reproduces the classic loop (add the arrivals, run a step,
repeat) step for step. Replicas that meet only at arrivals (open-loop arrivals through an Entry, the
default gate, no hook or callback: a cluster's `simulate`) are run each on its own between two
arrivals (_run_apart), which keeps this order for every replica without a heap event per step.

Asynchronous scheduling (a replica's `async_scheduling`, vLLM's `--async-scheduling`). vLLM's engine
core with a batch queue of two (step_with_batch_queue in vllm/v1/engine/core.py) plans step k + 1
as soon as step k is launched, with the requests it has taken in by then, and processes step k's
outputs only after that; when step k's outputs are processed it plans step k + 2 at once. So the
plan of the step that starts when step k ends was made when step k started. The loop models it at
admission (admit_async): when a replica starts a step at the instant its previous step ended, the
scheduler gets only the pending requests that arrived strictly before that previous step started
(a request sent at a step's end, as closed-loop load sends one, comes after the plan made then);
the others stay pending for the next step. A replica that was idle takes every pending request at
once (vLLM's engine core waits on its input queue and plans as soon as a request comes), and so
does one whose scheduler would have nothing else to run (the plan made at the previous step's
start was empty and took no time). A request that arrives while step k runs therefore first runs
in step k + 2, one step later than without the option. Not modelled: vLLM frees a finished
request's KV blocks and seat when the step's outputs are processed, after the next step was planned,
so a request waiting for that seat joins one step later too; here the freed seat is reused by the
very next step.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Hashable, Sequence
from operator import attrgetter
from typing import Protocol

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.request import FinishReason, Request
from stallfree.sim.run.load import Arrivals
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import ClusterError, SimulationError

_OUTSTANDING = attrgetter("num_outstanding")  # a replica's, read for every one at each arrival

__all__ = [
    "CALLBACK",
    "STEP_END",
    "AdmissionGate",
    "Entry",
    "EventLoop",
    "FinishHook",
    "PassGate",
    "Router",
    "admit_async",
    "route_to",
]

#: Event kinds, in the order they run at one instant.
STEP_END = 0
CALLBACK = 1

#: on_finish(replica, finished requests (rid -> reason), step end time s).
FinishHook = Callable[[Replica, dict[Hashable, FinishReason], float], None]


class AdmissionGate(Protocol):
    """Hands a replica's pending requests to its scheduler, and may correct its recorded rows."""

    def admit(self, replica: Replica, now: float) -> None:
        """Called at `now`, s, when `replica` is idle and has pending requests: add those that may enter."""
        ...

    def recorded(self, replica: Replica) -> None:
        """Called after a step's row of `replica` is recorded (and after on_finish)."""
        ...


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PassGate:
    """The default gate: every pending request goes to the scheduler, in order (Replica.add).

    Args:
        on_refuse: called with the time, s, of each request the scheduler rejects (closed-loop
            load sends the next request then), or None.
    """

    def __init__(self, on_refuse: Callable[[float], None] | None = None) -> None:
        self.on_refuse = on_refuse

    def admit(self, replica: Replica, now: float) -> None:
        """Add every pending request, then clear the list."""
        add, refused = replica.add, self.on_refuse
        for req in replica.pending:
            if not add(req) and refused is not None:
                refused(now)
        replica.pending.clear()

    def recorded(self, replica: Replica) -> None:
        """Nothing to correct."""


def admit_async(gate: AdmissionGate, replica: Replica, now: float) -> None:
    """Admission under asynchronous scheduling (module docstring): hand `replica`'s scheduler, through
    `gate`, the pending requests that the engine had taken in when it planned the step starting at
    `now`, s.

    When the replica's last step ended at `now` (a step back to back), that plan was made when the last
    step started (replica.last_start): only requests with arrival < last_start go to the gate, the
    others stay pending (in order, after any the gate kept); if the scheduler then has nothing to run,
    they go too (that plan was empty). Otherwise (the replica was idle) every pending request goes.
    A request's arrival is its Request.arrival, s (when it reached the group; routing is at arrival).
    """
    pend = replica.pending
    if replica.last_end == now:
        cut = replica.last_start
        late = [r for r in pend if not r.arrival < cut]
        if late:
            pend[:] = [r for r in pend if r.arrival < cut]
            if pend:
                gate.admit(replica, now)
            pend.extend(late)
            if replica.inner.has_unfinished():
                return
    if pend:
        gate.admit(replica, now)


class Router(Protocol):
    """Chooses a replica for each arriving request: one method.

    `route` gets the request and the replicas (a sequence of Replica, index order) and returns an
    index in [0, len(replicas)). It may keep state of its own (a round-robin cursor, a seeded RNG).
    """

    def route(self, request: Request, replicas: Sequence[Replica]) -> int: ...


def route_to(router: Router, request: Request, replicas: Sequence[Replica]) -> Replica:
    """Route `request` with `router` and append it to the chosen replica's pending list.

    Raises:
        ClusterError: the router returned something other than an index in [0, len(replicas)).
    """
    # Read as an object: the router is the caller's and its answer is checked here (a compiled build would
    # have turned True into 1 on the way).
    route: Callable[[Request, Sequence[Replica]], object] = router.route
    return _send(replicas, route(request, replicas), request, router)


def _send(replicas: Sequence[Replica], k: object, request: Request, router: Router) -> Replica:
    """Append `request` to replica `k`'s pending list, `k` as `router` chose it (route_to)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(replicas):
        raise ClusterError(f"router {type(router).__name__} returned replica {k!r}; expected 0..{len(replicas) - 1}")
    rep = replicas[k]
    rep.num_routed += 1
    rep.num_outstanding += 1
    rep.pending.append(request)
    rep.stalled = False
    return rep


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Entry:
    """The arrival of a request into a group of replicas: refused at once if too long for the
    context (a server's 400, before any router sees it), else built and routed (route_to).

    Args:
        replicas: the group arrivals enter.
        router: picks the replica; None: the group's single replica (the trivial router).
        make_request: make_request(rid) -> the Request the group's schedulers see.
        too_long: rid -> reason of the requests refused for the context length.
        arrivals: the load; a refusal under closed-loop load sends the next request.
        track_imbalance: record max / mean outstanding requests per replica at each arrival that
            finds at least as many requests in the group as replicas (`ratios`).

    Attributes:
        routed: per request, the index of its replica (-1: refused or not arrived).
        refused: (rid, reason) of the requests refused for the context length, in arrival order.
        ratios: the imbalance ratios, with track_imbalance.
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        router: Router | None,
        make_request: Callable[[int], Request],
        too_long: dict[int, str],
        arrivals: Arrivals,
        track_imbalance: bool = False,
    ) -> None:
        self.replicas, self.router, self.make_request = list(replicas), router, make_request
        self.too_long, self.arrivals, self.track = too_long, arrivals, track_imbalance
        self.routed = [-1] * len(arrivals.times)
        self.refused: list[tuple[int, str]] = []
        # 8 bytes an arrival (a list of floats takes 32): only their mean and maximum are reported.
        self.ratios: array[float] = array("d")
        # A router that chooses from the replicas' num_outstanding alone takes the loads read for the ratios
        # (not a subclass that routes otherwise: its route is not the one beside pick_by_outstanding).
        self._pick: Callable[[list[int]], int] | None = None
        pick = getattr(router, "pick_by_outstanding", None)
        if pick is not None:
            home = next(c for c in type(router).__mro__ if "pick_by_outstanding" in vars(c))
            if vars(home).get("route") is getattr(type(router), "route", None):
                self._pick = pick

    def __call__(self, rid: int, now: float) -> None:
        """Request `rid` arrives at `now`, s."""
        if self.too_long and rid in self.too_long:
            self.refused.append((rid, self.too_long[rid]))
            self.arrivals.ended(now)
            return
        self.dispatch(rid)

    def dispatch(self, rid: int) -> None:
        """Send request `rid`, not refused, to its replica's pending list (through the router, if any)."""
        req = self.make_request(rid)
        reps = self.replicas
        if self.router is None:
            rep = reps[0]
            rep.num_routed += 1
            rep.num_outstanding += 1
            rep.pending.append(req)
            rep.stalled = False
            self.routed[rid] = 0
            return
        if self.track:
            outstanding = list(map(_OUTSTANDING, reps))
            total = sum(outstanding)
            if total >= len(reps):
                self.ratios.append(max(outstanding) * len(reps) / total)
            pick = self._pick
            if pick is not None:  # the router's choice from the loads just read (route would read them again)
                self.routed[rid] = _send(reps, pick(outstanding), req, self.router).index
                return
        self.routed[rid] = route_to(self.router, req, reps).index


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class EventLoop:
    """One run of the event loop (module docstring).

    Args:
        replicas: every replica, in the order idle ones start steps at one instant.
        arrivals: the load's arrival times (open or closed loop).
        arrive: called as arrive(rid, now) for each request as it arrives, in workload order.
        on_finish: the finish hook, or None.
        gate: the admission gate (default PassGate()).
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        arrivals: Arrivals,
        arrive: Callable[[int, float], None],
        on_finish: FinishHook | None = None,
        gate: AdmissionGate | None = None,
    ) -> None:
        self.replicas = list(replicas)
        self.arrivals, self.arrive, self.on_finish = arrivals, arrive, on_finish
        self.gate = gate if gate is not None else PassGate()
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        #: With one replica, run the equivalent single-replica path (_run_solo); False forces the
        #: general one (tests compare the two).
        self.solo = True
        #: The single-replica path may hand requests that arrive during a step to the replica at the
        #: step's end without stopping at each arrival: the same result when the router depends on
        #: nothing (Entry without a router) and nothing depends on the arrival instant (open loop).
        #: Set by the caller that knows both (simulate).
        self.arrivals_at_step_ends = False
        #: With replicas that meet only at arrivals (_apart), run each on its own between two arrivals
        #: (_run_apart); False forces the heap (tests compare the two).
        self.apart = True

    def at(self, time: float, callback: Callable[[float], None]) -> None:
        """Run callback(time) at `time`, s (a CALLBACK event: after the step ends due then)."""
        heapq.heappush(self.heap, (time, CALLBACK, self.seq, callback))
        self.seq += 1

    def run(self) -> None:
        """Run until every request has arrived and no replica has work left.

        Raises:
            SimulationError: replicas with work left made no progress, or a closed-loop request is
                never sent.
        """
        if len(self.replicas) == 1 and self.solo:
            self._run_solo()
            return
        if self.apart and self._apart():
            self._run_apart()
            return
        heap, reps, times = self.heap, self.replicas, self.arrivals.times
        arrive, gate, on_finish = self.arrive, self.gate, self.on_finish
        recorded = None if type(gate) is PassGate else gate.recorded  # the default gate corrects nothing
        push, pop = heapq.heappush, heapq.heappop
        n = len(times)
        i = 0
        now = times[0] if n else 0.0
        while True:
            while heap and heap[0][0] <= now:
                t, kind, _, payload = pop(heap)
                if kind == STEP_END:
                    finished = payload.finish_step(t)  # type: ignore[attr-defined]
                    if finished and on_finish is not None:
                        on_finish(payload, finished, t)  # type: ignore[arg-type]
                    if recorded is not None:
                        recorded(payload)  # type: ignore[arg-type]
                else:
                    payload(t)  # type: ignore[operator]
            while i < n and times[i] <= now:
                arrive(i, now)
                i += 1
            for rep in reps:
                if rep.busy or rep.stalled:
                    continue
                if rep.pending:
                    if rep.async_scheduling:
                        admit_async(gate, rep, now)
                    else:
                        gate.admit(rep, now)
                if not rep.inner.has_unfinished():
                    continue
                end = rep.start_step(now)
                if end is None:
                    if recorded is not None:
                        recorded(rep)
                    continue
                push(heap, (end, STEP_END, self.seq, rep))
                self.seq += 1
            nxt = heap[0][0] if heap else math.inf
            if i < n and times[i] < nxt:
                nxt = times[i]
            if nxt == math.inf:
                self._check_done(i)
                return
            if nxt > now:
                now = nxt

    def _apart(self) -> bool:
        """Whether the replicas meet only at arrivals: open-loop arrivals through an Entry over these
        replicas (its router reads them only then), the default gate with nothing to call on a refusal, no
        finish hook, no callback. Between two arrivals each replica's steps then depend on its own state
        alone (admit_async's too: its replica's last step and its requests' arrivals)."""
        gate, arrive, reps = self.gate, self.arrive, self.replicas
        return (type(arrive) is Entry and arrive.replicas == reps and type(gate) is PassGate
                and gate.on_refuse is None and self.on_finish is None and not self.heap
                and self.arrivals.closed is None and [r.index for r in reps] == list(range(len(reps))))

    def _run_apart(self) -> None:
        """run() for replicas that meet only at arrivals (_apart), in the same order of events for each
        replica: at each arrival instant the requests arriving then are routed, every idle replica with
        work (in the order given) gets its pending requests and starts a step, then each replica runs on
        its own up to the next arrival (Replica.advance), rather than step by step through the heap. The
        steps, rows and routes are those of the general path: a router sees every step that ended by the
        arrival, as there. Only the replicas something happened to are visited at an instant (a request
        routed to one, its step ended then, or the first instant), and the heap holds one entry per busy
        replica (the end of its step in flight), not one per step. With a router that reads only
        num_outstanding, a replica in a run of plain decode steps (stallfree.core.plain_steps) parks in it
        and is visited at its wake_at (no request of it finishes before) or when a request is routed to it;
        a stale heap entry (its replica pushed a newer one) is skipped."""
        times, arrive, gate = self.arrivals.times, self.arrive, self.gate
        routed = arrive.routed  # type: ignore[attr-defined]

        def admit_later(rep: Replica, now: float) -> None:
            admit_async(gate, rep, now)

        # Each replica with its admission, as run() chooses it.
        each = [(rep, admit_later if rep.async_scheduling else gate.admit) for rep in self.replicas]
        # A router that reads only num_outstanding lets a replica in a run of plain decode steps sleep until
        # a request of it could finish (Replica.wake_at), instead of being visited at every arrival.
        router = arrive.router  # type: ignore[attr-defined]
        park = router is None or bool(getattr(router, "reads_only_outstanding", False))
        # (time to visit, replica index, entry number): an entry is live while it is its replica's latest.
        busy: list[tuple[float, int, int]] = []
        latest = [0] * len(each)
        push, pop = heapq.heappush, heapq.heappop
        visit = list(range(len(each)))  # the replicas to visit at this instant: every one at the first
        n = len(times)
        i = 0
        now = times[0] if n else 0.0
        while True:
            while i < n and times[i] <= now:
                arrive(i, now)
                k = routed[i]
                if k >= 0:
                    visit.append(k)
                i += 1
            until = times[i] if i < n else math.inf
            if visit:
                for k in sorted(set(visit)) if len(visit) > 1 else visit:
                    rep, admit = each[k]
                    if rep.parked and rep.pending and not rep.cut_at(now):
                        # Given a request while asleep, with a step of its run ending now: the steps that
                        # ended by now are taken first (without it), and it is admitted now. Otherwise
                        # (cut_at) the replica wakes at the end of its step in flight to admit it.
                        held, rep.pending = rep.pending, []
                        rep.advance(now, admit, park)
                        rep.pending = held
                    if rep.parked and rep.pending:
                        if rep.busy:
                            latest[k] += 1
                            push(busy, (rep.wake_at, k, latest[k]))
                            continue
                    if rep.busy or rep.stalled:
                        continue
                    if rep.pending:
                        admit(rep, now)
                    if rep.inner.has_unfinished() and rep.start_step(now) is not None:
                        latest[k] += 1
                        push(busy, (rep.step_end, k, latest[k]))
                visit = []
            while busy and busy[0][0] <= until:
                _, k, entry = pop(busy)
                if entry != latest[k]:
                    continue
                rep, admit = each[k]
                rep.advance(until, admit, park)
                if rep.busy:
                    latest[k] += 1
                    push(busy, (rep.wake_at, k, latest[k]))
                elif not rep.stalled:
                    visit.append(k)  # idle: its step ended at `until` (its next starts then) or it has no work
            if i >= n:
                self._check_done(i)
                return
            now = until

    def _run_solo(self) -> None:
        """run() for one replica, in the same event order, with its step end held in a local rather
        than the heap (which holds only callbacks): the hot path of `simulate`, where a heap entry
        per step costs about a tenth of the loop's time."""
        heap, rep, times = self.heap, self.replicas[0], self.arrivals.times
        arrive, gate, on_finish = self.arrive, self.gate, self.on_finish
        recorded = None if type(gate) is PassGate else gate.recorded
        lazy = self.arrivals_at_step_ends and self.arrivals.closed is None and not rep.async_scheduling
        admit = gate.admit if not rep.async_scheduling else lambda r, t: admit_async(gate, r, t)
        if lazy and on_finish is None and recorded is None and not heap:
            self._run_steps()
            return
        start_step, finish_step, has_unfinished = rep.start_step, rep.finish_step, rep.inner.has_unfinished
        n = len(times)
        i = 0
        now = times[0] if n else 0.0
        end: float | None = None  # the step in flight ends then
        while True:
            while True:
                # A step's end before a callback due at the same time (kind STEP_END < CALLBACK).
                if end is not None and end <= now and not (heap and heap[0][0] < end):
                    t, end = end, None
                    finished = finish_step(t)
                    if finished and on_finish is not None:
                        on_finish(rep, finished, t)
                    if recorded is not None:
                        recorded(rep)
                elif heap and heap[0][0] <= now:
                    t, _, _, payload = heapq.heappop(heap)
                    payload(t)  # type: ignore[operator]
                else:
                    break
            while i < n and times[i] <= now:
                arrive(i, now)
                i += 1
            if end is None and not rep.stalled:
                if rep.pending:
                    admit(rep, now)
                if has_unfinished():
                    end = start_step(now)
                    if end is None and recorded is not None:
                        recorded(rep)
            nxt = end if end is not None else math.inf
            if heap and heap[0][0] < nxt:
                nxt = heap[0][0]
            if i < n and times[i] < nxt and (end is None or not lazy):
                nxt = times[i]
            if nxt == math.inf:
                self._check_done(i)
                return
            if nxt > now:
                now = nxt

    def _run_steps(self) -> None:
        """_run_solo when nothing can happen during a step (no hook, no callback, arrivals that may
        wait for the step's end): the arrivals by now added, then steps back to back until one
        would start at or after the next arrival (Replica.run_steps), the clock jumping to the next
        arrival when the replica is idle or stalled; the classic loop, with the same rows as the
        general path."""
        rep, times, arrive, gate = self.replicas[0], self.arrivals.times, self.arrive, self.gate
        run_steps, has_unfinished = rep.run_steps, rep.inner.has_unfinished
        n = len(times)
        i = 0
        now = times[0] if n else 0.0
        while True:
            while i < n and times[i] <= now:
                arrive(i, now)
                i += 1
            if not rep.stalled:
                if rep.pending:
                    gate.admit(rep, now)
                if has_unfinished():
                    now = run_steps(now, times[i] if i < n else math.inf)
                    if not rep.stalled and i < n and times[i] <= now:
                        continue
            if i >= n:
                self._check_done(i)
                return
            if times[i] > now:
                now = times[i]

    def _check_done(self, i: int) -> None:
        if i < len(self.arrivals.times):
            raise SimulationError(f"closed-loop load: request {i} is never sent with nothing in flight")
        stuck = [r.index for r in self.replicas if r.inner.has_unfinished() or r.pending]
        if stuck:
            raise SimulationError(f"replicas {stuck} made no progress with work left")
