"""Closed-loop load (ClosedLoop): a fixed number of requests in flight, the next sent when one ends
(stallfree.sim.run.load reads it; the module docstring there says how a run uses it).

Kept apart from load.py, which the compiled build compiles: its checks read the values as given (a bool
is not a count), which a compiled dataclass would have converted already.

Imports allowed: the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ClosedLoop"]


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """Closed-loop load: `concurrency` requests in flight, the next sent when one ends.

    Args:
        concurrency: requests in flight (clients), >= 1.
        think_time: seconds between a request's end and its client's next request, >= 0.

    Raises:
        ValueError: concurrency not an integer >= 1, or think_time not a finite number >= 0 s;
            the message names the field and the value.
    """

    concurrency: int
    think_time: float = 0.0

    def __post_init__(self) -> None:
        c = self.concurrency
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"ClosedLoop.concurrency must be an integer >= 1 request, got {c!r}")
        t = self.think_time
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"ClosedLoop.think_time must be a finite number >= 0 s, got {t!r}")
