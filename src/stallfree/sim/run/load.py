"""The load a simulation offers: open-loop arrivals read from the workload, or closed-loop clients
that keep a fixed number of requests in flight.

Imports allowed: the standard library and stallfree.sim.inputs.workload.

Open loop (the default): request i arrives at workload.arrivals[i], whatever the replica does.
Closed loop (ClosedLoop): `concurrency` clients each send a request, wait for its last token,
think for `think_time` seconds and send the next one, as benchmark clients with a concurrency cap
do (vLLM's `bench serve --max-concurrency`, a closed-loop load generator). Requests are sent in
workload order, so the workload supplies the prompt and output lengths only; its arrival times
are ignored. The first min(concurrency, n) requests arrive at 0 s; each later one arrives
think_time after a request ends. A request ends at the end of the step that emits its last token,
or, when it is refused, at once: at its arrival when it is too long for the context (a server's
400), or when the simulator hands it to the scheduler when it can never fit the KV cache.
"""

from __future__ import annotations

import math
from collections.abc import MutableSequence, Sized
from typing import cast

from stallfree.core._mypyc import mypyc_attr
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.closed_loop import ClosedLoop

__all__ = ["Arrivals", "ClosedLoop"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Arrivals:
    """The arrival time of every request of one run, filled in as the run goes (closed loop) or
    the workload's own (open loop: read, never written, so not copied). Owned by the event loop that
    drives the run.

    Attributes:
        times: per request (workload order), its arrival, s; math.inf while a closed-loop
            request is not sent yet. Non-decreasing at every moment.
        sent: requests whose arrival time is known.
        closed: the ClosedLoop, or None for open-loop load.
    """

    __slots__ = ("closed", "sent", "think", "times")

    def __init__(self, workload: Workload, closed: ClosedLoop | None = None) -> None:
        n = len(workload)
        self.closed = closed
        if closed is None:
            # Read only under open loop: the workload's own sequence (a tuple or an array), not a copy.
            self.times: MutableSequence[float] = cast("MutableSequence[float]", workload.arrivals)
            self.sent = n
            self.think = 0.0
        else:
            k = min(closed.concurrency, n)
            self.times = [0.0] * k + [math.inf] * (n - k)
            self.sent = k
            self.think = float(closed.think_time)

    def ended(self, now: float) -> None:
        """A request ended (finished or refused) at `now`, s: under closed-loop load, send the
        next unsent request, arriving think_time later. Open loop: nothing happens."""
        if self.closed is not None and self.sent < len(self.times):
            self.times[self.sent] = now + self.think
            self.sent += 1

    def on_finish(self, replica: object, finished: Sized, end: float) -> None:
        """The event loop's finish hook (stallfree.sim.run.loop.FinishHook): each request finished in a
        step ending at `end`, s, sends the next one."""
        for _ in range(len(finished)):
            self.ended(end)
