"""The session run: the event loop (stallfree.sim.run.loop) over a SessionWorkload, each turn sent its think
or tool time after its predecessor's last token, and the session figures of the report.

Imports allowed: the standard library and stallfree.sim (sessions, load, loop, replica, result).

Three parts of the loop are the session's own: the arrivals (SessionArrivals: the turn-0 times known in
advance, each later turn inserted when its predecessor finishes, at end + delay_s), the entry
(SessionEntry: slot -> turn, refusals for the context length) and the gate (SessionGate: a turn the KV
cache can never hold is refused). A refused turn ends its session: its later turns are never sent; they
are recorded as rejected with kind "session_ended" at the instant the session ended.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from stallfree.core.request import FinishReason, Request
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.run.load import Arrivals
from stallfree.sim.run.loop import Entry, EventLoop, Router
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import SimResult

__all__ = [
    "SESSION_ENDED",
    "SessionArrivals",
    "SessionEntry",
    "SessionGate",
    "close_sessions",
    "run_sessions",
    "session_summary",
]

#: Rejection kind of a turn never sent because an earlier turn of its session was refused.
SESSION_ENDED = "session_ended"


class SessionArrivals(Arrivals):
    """The arrivals of a session run, filled in as it goes (module docstring).

    The event loop reads `times` by slot: slots [0, sent) hold the arrival times known so far,
    sorted; the rest are math.inf. `order[slot]` is the rid (turn) that arrives in that slot.
    A new turn is inserted after every slot due by its time, so never before a slot the loop has
    already taken (its time is at least the loop's clock).

    Args:
        wl: the sessions.
        frontend_s: the engine profile's front end, s: a turn reaches the engine that much after its
            client sent it, so its successor's delay runs from that much after its last token (as a
            closed-loop client's think time does: stallfree.sim.inputs.setup.Setup.engine_closed_loop).

    Attributes:
        order: rid per slot (-1 while unsent).
        sent_at: per rid, when it reached the engine (or its session ended), s; math.inf until then.
        ended_why: rid -> why its session ended before it was sent.
    """

    __slots__ = ("ended_why", "frontend_s", "order", "sent_at", "wl")

    def __init__(self, wl: SessionWorkload, frontend_s: float = 0.0) -> None:
        self.frontend_s = float(frontend_s)
        n = len(wl)
        firsts = [i for i in range(n) if wl.turn[i] == 0]
        self.wl = wl
        self.closed = None
        self.think = 0.0
        self.times = [wl.arrivals[i] for i in firsts] + [math.inf] * (n - len(firsts))
        self.order = firsts + [-1] * (n - len(firsts))
        self.sent = len(firsts)
        self.sent_at = [math.inf] * n
        for i in firsts:
            self.sent_at[i] = wl.arrivals[i]
        self.ended_why: dict[int, str] = {}

    def send(self, rid: int, when: float) -> None:
        """Turn `rid` arrives at `when`, s (>= the loop's clock)."""
        times, order, k = self.times, self.order, self.sent
        pos = bisect_right(times, when, 0, k)
        if pos < k:
            # Only the turns sent but not yet arrived move (a session's think time ahead): O(those), not O(n).
            times[pos + 1:k + 1] = times[pos:k]
            order[pos + 1:k + 1] = order[pos:k]
        times[pos] = when
        order[pos] = rid
        self.sent = k + 1
        self.sent_at[rid] = when

    def ended(self, now: float) -> None:
        """Not used: a session's next turn follows its own turn's finish (on_finish, end_session)."""

    def end_session(self, rid: int, now: float, why: str) -> None:
        """Turn `rid` was refused at `now`, s: its session's later turns are never sent; each takes a
        slot at `now` and is recorded as ended (SessionEntry)."""
        wl = self.wl
        nxt = wl.next_turn(rid)
        while nxt >= 0:
            self.ended_why[nxt] = (f"session {wl.session_ids[wl.session[nxt]]!r} turn {wl.turn[nxt]}: not sent, "
                                   f"its session ended at turn {wl.turn[rid]} ({why})")
            self.send(nxt, now)
            nxt = wl.next_turn(nxt)

    def on_finish(self, replica: object, finished: dict[Hashable, FinishReason], end: float) -> None:  # type: ignore[override]
        """The finish hook: each finished turn sends its session's next one, delay_s (plus the front end)
        after `end`, s."""
        wl = self.wl
        for rid in finished:
            nxt = wl.next_turn(rid)  # type: ignore[arg-type]
            if nxt >= 0:
                self.send(nxt, end + wl.delay_s[nxt] + self.frontend_s)


class SessionEntry(Entry):
    """Entry for sessions: slot -> turn (SessionArrivals.order); a turn too long for the context is
    refused (Entry.refused) and ends its session; a turn of an ended session is recorded in `ended`."""

    def __init__(self, replicas: Sequence[Replica], router: Router | None, make_request: Callable[[int], Request],
                 too_long: dict[int, str], arrivals: SessionArrivals) -> None:
        super().__init__(replicas, router, make_request, too_long, arrivals, track_imbalance=router is not None)
        self.sessions = arrivals
        self.ended: list[tuple[int, str]] = []

    def __call__(self, slot: int, now: float) -> None:
        """The turn of `slot` arrives at `now`, s."""
        arr = self.sessions
        rid = arr.order[slot]
        why = arr.ended_why.get(rid)
        if why is not None:
            self.ended.append((rid, why))
            return
        if rid in self.too_long:
            self.refused.append((rid, self.too_long[rid]))
            arr.end_session(rid, now, "context_length")
            return
        self.dispatch(rid)


class SessionGate:
    """Admission gate for sessions: every pending turn goes to the scheduler, in order; a turn it
    rejects (it can never fit the KV cache) ends its session."""

    def __init__(self, arrivals: SessionArrivals) -> None:
        self.arrivals = arrivals

    def admit(self, replica: Replica, now: float) -> None:
        """Add every pending turn, then clear the list."""
        for req in replica.pending:
            if not replica.add(req):
                self.arrivals.end_session(req.rid, now, "kv_capacity")  # type: ignore[arg-type]
        replica.pending.clear()

    def recorded(self, replica: Replica) -> None:
        """Nothing to correct."""


def run_sessions(
    reps: list[Replica], router: Router | None, wl: SessionWorkload, max_new: list[int], too_long: dict[int, str]
) -> tuple[SessionArrivals, SessionEntry, float]:
    """Run the event loop over sessions (module docstring); return (arrivals, entry, wall time, s).
    A session-affinity router is told each turn's session. Turns carry their stream's block hashes
    when the replicas cache prefixes.

    Raises:
        SimulationError, ClusterError: as EventLoop.run and route_to.
    """
    arrivals = SessionArrivals(wl, float(getattr(reps[0].cost, "frontend_s", 0.0)))
    st = reps[0].inner.stats()
    caching, bs = st.enable_prefix_caching, st.block_size or 1
    targets = reps[0].res.target
    plens, sent = wl.prompt_lens, arrivals.sent_at
    hashes = wl.stream_hashes

    def make(i: int) -> Request:
        return Request(i, plens[i], max_new[i], 0, sent[i], hashes(i, bs, targets[i]) if caching else None)

    if router is not None and hasattr(router, "sessions"):
        router.sessions = wl.session
    entry = SessionEntry(reps, router, make, too_long, arrivals)
    loop = EventLoop(reps, arrivals, entry, arrivals.on_finish, SessionGate(arrivals))
    t0 = time.perf_counter()
    loop.run()
    return arrivals, entry, time.perf_counter() - t0


def close_sessions(res: SimResult, wl: SessionWorkload, arrivals: SessionArrivals, entry: SessionEntry) -> None:
    """After a session run: each turn's arrival is when it was sent (or its session ended), s; the turns
    never sent join the rejected (kind SESSION_ENDED); each turn's (session_id, turn) is recorded."""
    res.arrival = tuple(arrivals.sent_at)
    for rid, why in entry.ended:
        res.rejected.append((rid, why))
        res.rejected_kind[rid] = SESSION_ENDED
    res.rejected.sort()
    res.session_keys = tuple((wl.session_ids[s], t) for s, t in zip(wl.session, wl.turn, strict=True))


def session_summary(res: SimResult, frontend_s: float = 0.0) -> dict[str, Any]:
    """The session figures of a run with session_keys: ttft_by_turn (per turn number: requests, mean,
    median and p99 TTFT, ms, over the turns that emitted), and `sessions`: how many, how many completed
    every turn, ended early by reason, duration (first arrival to last finish of a completed session,
    s: mean, median, max) and KV held per session (its last turn's prompt plus output, tokens: the
    history a cache keeps for the next turn; mean and max)."""
    keys = res.session_keys
    assert keys is not None
    end = res.step_end
    by_turn: dict[int, list[float]] = {}
    per_session: dict[Any, list[int]] = {}
    for rid, (sid, t) in enumerate(keys):
        per_session.setdefault(sid, []).append(rid)
        a = res.first_step[rid]
        if a >= 0:
            by_turn.setdefault(t, []).append((end[a] - res.arrival[rid] + frontend_s) * 1e3)
    rows = []
    for t in sorted(by_turn):
        v = sorted(by_turn[t])
        rows.append({"turn": t, "num_requests": len(v), "mean_ttft_ms": sum(v) / len(v),
                     "median_ttft_ms": _pct(v, 50), "p99_ttft_ms": _pct(v, 99)})
    durations, kv = [], []
    ended: dict[str, int] = {}
    rejected = dict(res.rejected)
    for rids in per_session.values():
        last = rids[-1]
        kv.append(res.prompt_len[last] + res.target[last])
        bad = [r for r in rids if r in rejected]
        if bad:
            kind = res.rejected_kind.get(bad[0], "kv_capacity")
            ended[kind] = ended.get(kind, 0) + 1
        elif res.finish_step[last] >= 0:
            durations.append(end[res.finish_step[last]] - res.arrival[rids[0]])
    durations.sort()
    return {
        "ttft_by_turn": rows,
        "sessions": {
            "num_sessions": len(per_session),
            "completed": len(durations),
            "ended_by_reason": ended,
            "mean_duration_s": sum(durations) / len(durations) if durations else None,
            "median_duration_s": _pct(durations, 50) if durations else None,
            "max_duration_s": durations[-1] if durations else None,
            "mean_kv_tokens_per_session": sum(kv) / len(kv) if kv else None,
            "max_kv_tokens_per_session": max(kv) if kv else None,
        },
    }


def _pct(sorted_values: list[float], p: float) -> float:
    """The p-th percentile of sorted values, linear interpolation (numpy's default)."""
    n = len(sorted_values)
    x = (n - 1) * p / 100
    lo = int(x)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)
