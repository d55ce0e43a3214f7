"""Overload and bursts said out loud: whether a run was offered more than its replicas sustain (or its
queue grew through the run), the rate they sustain and the fix; and, when the TTFT tail comes from a
burst of arrivals, when it happened and how many requests arrived in it.

Imports allowed: the standard library and stallfree.sim; numpy lazily.

Definitions (docs/simulator.md, "Overload and bursts"):

- Sustained rate, mu (requests/s): the replicas' saturated throughput (simulator.saturated_throughput
  of one replica times the replicas: 5,000 requests of the workload, in runs spread over it, all at
  once). When the queue grows through the run it is instead the rate requests finished over the
  second half of the arrival window, if lower: a backlogged server runs at its throughput for this mix.
- The queue grows through the run when the requests arriving in the last quarter of the arrival
  window waited (arrival to admission) at median more than QUEUE_GROWTH_MIN_S and more than twice
  the median wait of the requests arriving in the second quarter.
- Overloaded: the offered rate exceeds mu, or the queue grows through the run. The fix is a rate
  scale below rate_scale x mu / offered, or ceil(offered / (mu / replicas)) replicas.
- Burst: each request brings 1/mu seconds of work to a fluid server of rate mu; the backlog after
  arrival i is W_i = max(0, W_(i-1) - (t_i - t_(i-1))) + 1/mu (Lindley's recursion). A busy period
  runs from an arrival that finds W drained until W drains again; within it, arrivals exceed mu from
  its first arrival to the arrival of its peak backlog. That stretch is a burst when it lasts at
  least BURST_MIN_STEPS median step times of the run.
- The TTFT tail comes from a burst when at least half of the requests with TTFT >= the run's p99
  arrived within that burst's busy period (the stretch plus its drain).
- Saturated: the run is at or past what the replicas sustain once the simulator's own step-time error
  is allowed for (stallfree.sim.studies.ranges: real steps up to STEP_TIME_HIGH times the simulated ones, the
  90th percentile measured on the dev data), so its tails cannot be trusted: it is overloaded, or its
  offered rate is at least mu / STEP_TIME_HIGH (SATURATION_LOAD of mu), or in some window the queue
  grows through it: a burst against the fluid server of rate mu / STEP_TIME_HIGH whose backlog peaks
  at QUEUE_GROWTH_MIN_S or more, in which the replay itself queued (the requests arriving in its busy
  period waited for admission QUEUE_GROWTH_MIN_S or more at p90: a batching server absorbs a burst
  into its batch, and the fluid server alone would call that a queue). Every overloaded run is
  saturated; a saturated run need not be overloaded (a run at 90% of mu, or one burst past it, keeps
  up on average). `saturated_window_s` is [first, last arrival] when the whole run is saturated, else
  the worst window's [start, drain], s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from stallfree.sim.outputs.itl import median, step_durations
from stallfree.sim.outputs.report import latency_arrays, served_share
from stallfree.sim.studies.ranges import STEP_TIME_HIGH

__all__ = [
    "BURST_MIN_STEPS",
    "QUEUE_GROWTH_MIN_S",
    "SATURATION_LOAD",
    "Burst",
    "annotate",
    "burst_line",
    "fluid_bursts",
    "median_step_s",
    "overload",
    "overload_line",
    "queue_grows",
    "saturation",
    "saturation_line",
    "tail_burst",
]

#: A burst lasts at least this many of the run's median step times ("several steps").
BURST_MIN_STEPS = 8
#: The last quarter's median wait must exceed this, s, for the queue to count as growing.
QUEUE_GROWTH_MIN_S = 1.0
#: Saturated at this share of the sustained rate or above: 1 / STEP_TIME_HIGH, the rate the replicas
#: sustain when every step takes the 90th percentile of the measured step-time error longer.
SATURATION_LOAD = 1.0 / STEP_TIME_HIGH


@dataclass(frozen=True, slots=True)
class Burst:
    """One busy period of the fluid server whose arrivals exceed its rate for long enough.

    Attributes:
        start_s: the first arrival of the busy period, s (replay time).
        peak_s: the arrival at which the backlog peaks, s: arrivals exceed the rate in [start_s, peak_s].
        end_s: when the backlog drains, s.
        requests: arrivals in [start_s, peak_s].
        busy_requests: arrivals in the whole busy period [start_s, end_s).
        peak_backlog_s: the backlog at peak_s, s of work at the sustained rate.
        first: the index of the busy period's first arrival; busy_requests follow it.
    """

    start_s: float
    peak_s: float
    end_s: float
    requests: int
    busy_requests: int
    peak_backlog_s: float
    first: int


def fluid_bursts(arrivals: Sequence[float], rate: float, min_duration: float) -> list[Burst]:
    """The bursts of an arrival list against a sustained rate (module docstring).

    Args:
        arrivals: arrival times, s, non-decreasing.
        rate: the sustained rate mu, requests/s (> 0).
        min_duration: the least peak_s - start_s of a burst, s (>= 0; 0 keeps every busy period
            of two or more arrivals).

    Returns:
        The bursts in time order.

    Raises:
        ValueError: rate <= 0 or not finite, or min_duration < 0.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    if not min_duration >= 0:
        raise ValueError(f"min_duration must be >= 0 s, got {min_duration!r}")
    work = 1.0 / rate
    out: list[Burst] = []
    w, first, peak, peak_w = 0.0, 0, 0, 0.0
    for i, t in enumerate(arrivals):
        left = w - (t - arrivals[i - 1]) if i else 0.0
        if left <= 0.0:
            if i:
                _close(out, arrivals, first, peak, peak_w, i, arrivals[i - 1] + w, min_duration)
            first, peak, peak_w, left = i, i, 0.0, 0.0
        w = left + work
        if w > peak_w:
            peak, peak_w = i, w
    if len(arrivals):
        _close(out, arrivals, first, peak, peak_w, len(arrivals), arrivals[-1] + w, min_duration)
    return out


def _close(out: list[Burst], arrivals: Sequence[float], first: int, peak: int, peak_w: float, stop: int,
           end: float, min_duration: float) -> None:
    if peak > first and arrivals[peak] - arrivals[first] >= min_duration:
        out.append(Burst(arrivals[first], arrivals[peak], end, peak - first + 1, stop - first, peak_w, first))


def queue_grows(arrival: Any, queue: Any) -> bool:
    """Whether the queue grows through the run (module docstring).

    Args:
        arrival: arrival times of the admitted requests, s (numpy array [n]).
        queue: their waits, arrival to admission, s (numpy array [n], same order).
    """
    import numpy as np

    if len(arrival) < 8:
        return False
    lo, hi = float(arrival.min()), float(arrival.max())
    span = hi - lo
    if span <= 0:
        return False
    second = queue[(arrival >= lo + span / 4) & (arrival < lo + span / 2)]
    last = queue[arrival >= lo + 3 * span / 4]
    if not len(second) or not len(last):
        return False
    late = float(np.median(last))
    return late > QUEUE_GROWTH_MIN_S and late > 2 * float(np.median(second))


def _finish_rate(res: Any, lat: dict[str, Any]) -> float | None:
    """Requests finished per second over the second half of the arrival window, or None."""
    import numpy as np

    arrival = np.asarray(res.arrival, dtype=np.float64)
    lo, hi = float(arrival.min()), float(arrival.max())
    if hi <= lo:
        return None
    finish = arrival[lat["rids"]] + lat["e2e"] - float(res.config.get("frontend_s", 0.0))
    mid = (lo + hi) / 2
    return float(((finish >= mid) & (finish < hi)).sum()) / (hi - mid)


def overload(res: Any, lat: dict[str, Any], summary: dict[str, Any], offered: float | None, rate_scale: float,
             replicas: int = 1) -> dict[str, Any] | None:
    """The run's overload, or None when it keeps up (module docstring).

    Args:
        res: the run's SimResult (merged, for a cluster).
        lat: its stallfree.sim.outputs.report.latency_arrays.
        summary: its summary (capacity_req_s: the replicas' saturated throughput, req/s, or None).
        offered: the offered rate, requests/s (None or inf: every request at once, never overload).
        rate_scale: the run's rate scale.
        replicas: replicas behind the router.

    Returns:
        None, or {"offered_rate", "sustained_rate" (req/s), "load" (offered / sustained),
        "queue_grows" (bool), "rate_scale_below", "replicas_needed"}.
    """
    capacity = summary.get("capacity_req_s")
    if capacity is None or offered is None or not math.isfinite(offered) or offered <= 0 or not len(lat["rids"]):
        return None
    import numpy as np

    arrival = np.asarray(res.arrival, dtype=np.float64)[lat["rids"]]
    grows = queue_grows(arrival, lat["queue"])
    sustained = float(capacity)
    if grows:
        measured = _finish_rate(res, lat)
        if measured is not None and measured > 0:
            sustained = min(sustained, measured)
    if offered <= sustained and not grows:
        return None
    per_replica = sustained / replicas
    return {
        "offered_rate": offered,
        "sustained_rate": sustained,
        "load": offered / sustained,
        "queue_grows": grows,
        "rate_scale_below": rate_scale * sustained / offered,
        "replicas_needed": max(replicas + 1, math.ceil(offered / per_replica)),
    }


def median_step_s(res: Any) -> float:
    """The median step duration of `res` (a SimResult), s: float(np.median(step_end - step_start)) bit
    for bit, without an array of every duration (stallfree.sim.outputs.itl.median); 0.0 with no step."""
    n = len(res.step_end)
    return median(n, step_durations(res)) if n else 0.0


def overload_line(label: str, o: dict[str, Any], replicas: int = 1) -> str:
    """The one warning line of an overload (overload's dict)."""
    who = "the replica sustains" if replicas == 1 else f"the {replicas} replicas sustain"
    why = "the queue grows through the run" if o["queue_grows"] else "the queue grows without bound"
    return (f"warning: {label}: overloaded: {o['offered_rate']:,.2f} req/s offered, {who} ~{o['sustained_rate']:,.2f} "
            f"({o['load']:.0%}); {why}, so TTFT is mostly waiting: use --rate-scale below "
            f"{o['rate_scale_below']:.3g} or --replicas {o['replicas_needed']} (stallfree plan finds the count "
            "that meets the SLOs)")


def tail_burst(res: Any, lat: dict[str, Any], sustained: float | None,
               median_s: Callable[[], float] | None = None) -> dict[str, Any] | None:
    """The burst the TTFT tail comes from (module docstring), or None. `median_s`: gives the run's median
    step duration, s (default median_step_s(res); annotate passes one that computes it once per run).

    Returns:
        None, or {"start_s", "peak_s", "end_s", "requests", "busy_requests", "peak_backlog_s", "first"
        (Burst's fields), "sustained_rate" (req/s), "p99_ttft_ms", "tail_requests" (requests with TTFT
        >= p99), "tail_in_burst" (of them, arrived in its busy period)}.
    """
    import numpy as np

    if sustained is None or not (math.isfinite(sustained) and sustained > 0) or len(lat["rids"]) < 2:
        return None
    min_duration = BURST_MIN_STEPS * (median_s() if median_s is not None else median_step_s(res))
    bursts = fluid_bursts(res.arrival, sustained, min_duration)
    if not bursts:
        return None
    p99 = float(np.percentile(lat["ttft"], 99))
    tail = lat["rids"][lat["ttft"] >= p99]
    best, best_n = None, 0
    for b in bursts:
        n = int(((tail >= b.first) & (tail < b.first + b.busy_requests)).sum())
        if n > best_n:
            best, best_n = b, n
    if best is None or 2 * best_n < len(tail):
        return None
    return asdict(best) | {"sustained_rate": sustained, "p99_ttft_ms": p99 * 1e3, "tail_requests": len(tail),
                           "tail_in_burst": best_n}


def burst_line(label: str, b: dict[str, Any], rate_scale: float) -> str:
    """The one line naming the burst a TTFT tail comes from (tail_burst's dict)."""
    span = b["peak_s"] - b["start_s"]
    trace = ""
    if rate_scale != 1:
        trace = f" (trace time {b['start_s'] * rate_scale:,.1f}-{b['peak_s'] * rate_scale:,.1f} s)"
    return (f"note: {label}: TTFT p99 {b['p99_ttft_ms']:,.0f} ms comes from a burst at {b['start_s']:,.1f}-"
            f"{b['peak_s']:,.1f} s{trace}: {b['requests']:,} requests arrived in {span:,.1f} s "
            f"({b['requests'] / span:,.1f} req/s against the ~{b['sustained_rate']:,.2f} sustained); "
            f"{b['tail_in_burst']} of the {b['tail_requests']} requests at or above p99 arrived before its "
            f"backlog drained at {b['end_s']:,.1f} s")


def saturation(res: Any, lat: dict[str, Any], summary: dict[str, Any], offered: float | None,
               over: dict[str, Any] | None, median_s: Callable[[], float] | None = None) -> dict[str, Any]:
    """Whether the run is saturated, and where (module docstring). `median_s`: as tail_burst's.

    Args:
        res: the run's SimResult (merged, for a cluster).
        lat: its stallfree.sim.outputs.report.latency_arrays.
        summary: its summary (capacity_req_s: the replicas' saturated throughput, req/s, or None).
        offered: the offered rate, requests/s (None or inf: every request at one instant).
        over: overload's dict for the run, or None.

    Returns:
        {"saturated" (bool), "saturated_window_s" ([start, end] s, or None), "saturated_by" ("overload",
        "load", "window", "one instant" or None)}.
    """
    import numpy as np

    arrival = np.asarray(res.arrival, dtype=np.float64)
    whole = [float(arrival.min()), float(arrival.max())] if len(arrival) else None
    if not len(lat["rids"]):
        return {"saturated": False, "saturated_window_s": None, "saturated_by": None}
    if offered is None or not math.isfinite(offered):
        return {"saturated": True, "saturated_window_s": whole, "saturated_by": "one instant"}
    if over is not None:
        return {"saturated": True, "saturated_window_s": whole, "saturated_by": "overload"}
    capacity = summary.get("capacity_req_s")
    if capacity is None or not capacity > 0:
        return {"saturated": False, "saturated_window_s": None, "saturated_by": None}
    if offered >= SATURATION_LOAD * capacity:
        return {"saturated": True, "saturated_window_s": whole, "saturated_by": "load"}
    min_duration = BURST_MIN_STEPS * (median_s() if median_s is not None else median_step_s(res))
    rids, waits = lat["rids"], lat["queue"]

    def queued(b: Burst) -> bool:
        mine = waits[(rids >= b.first) & (rids < b.first + b.busy_requests)]
        return bool(len(mine)) and float(np.percentile(mine, 90)) >= QUEUE_GROWTH_MIN_S

    bursts = [b for b in fluid_bursts(res.arrival, capacity * SATURATION_LOAD, min_duration)
              if b.peak_backlog_s >= QUEUE_GROWTH_MIN_S and queued(b)]
    if not bursts:
        return {"saturated": False, "saturated_window_s": None, "saturated_by": None}
    worst = max(bursts, key=lambda b: b.peak_backlog_s)
    return {"saturated": True, "saturated_window_s": [worst.start_s, worst.end_s], "saturated_by": "window"}


def saturation_line(label: str, s: dict[str, Any]) -> str:
    """The header line of a saturated run (a summary with saturation's keys; its "range", when it has one,
    is what the line tells the reader to read, else how to get it). A window's arrivals average
    SATURATION_LOAD of capacity, whatever the run's mean: the window is a busy period of the fluid server of
    that rate, which works through it without a pause (its arrivals bring exactly its length of work)."""
    a, b = s["saturated_window_s"] or (0.0, 0.0)
    mean = f", against {s['load']:.0%} over the run" if s.get("load") is not None else ""
    why = {"overload": "overloaded", "one instant": "every request arrives at one instant",
           "load": f"offered {s.get('load') or 0:.0%} of capacity, at or above {SATURATION_LOAD:.0%}",
           "window": f"arrivals there average {SATURATION_LOAD:.0%} of capacity{mean}"}[s["saturated_by"]]
    where = f"at {a:,.1f}-{b:,.1f} s" if s["saturated_by"] == "window" else "through the run"
    # A run without its range (simulate --no-range) is told where the range comes from, not to read it.
    advice = "read the range" if s.get("range") else "run without --no-range to see the range"
    return (f"warning: {label}: saturated {where} ({why}): TTFT and queueing tails there are unreliable, "
            f"as steps {STEP_TIME_HIGH - 1:.1%} slower (the 90th percentile of the measured step-time error) "
            f"would queue there; {advice}")


def annotate(results: Sequence[Any], summaries: Sequence[dict[str, Any]], header: dict[str, Any],
             replicas: int = 1) -> list[str]:
    """Add "overload" and "tail_burst" (None or their dicts) and saturation's keys to each summary;
    return the lines to print: one overload warning for the study (its first overloaded run, "(k of n
    runs)" when several are) and a burst note per run whose TTFT tail comes from a burst. A run without
    records (its result has a tally) gets None for all five and a note that says so."""
    rate_scale = float(header.get("rate_scale") or 1.0)
    offered = header.get("offered_rate")
    warn: list[str] = []
    notes: list[str] = []
    for res, s in zip(results, summaries, strict=True):
        if s.get("achieved_request_rate") is not None:  # closed loop: the clients set the rate
            s["overload"] = s["tail_burst"] = s["saturated_window_s"] = s["saturated_by"] = None
            s["saturated"] = False
            continue
        if getattr(res, "tally", None) is not None:  # no records: the queue and tail analyses read them
            s["overload"] = s["tail_burst"] = s["saturated_window_s"] = s["saturated_by"] = s["saturated"] = None
            load = s.get("load")
            against = f"; offered load {load:.2f} of the sustained rate" if load is not None else ""
            notes.append(f"note: {s['label']}: run without records: no overload, saturation or burst analysis "
                         f"(they read each request's queueing delay){against}")
            continue
        lat = latency_arrays(res, itl=False)  # overload and bursts read no inter-token gap
        med: list[float] = []

        def median_s(res: Any = res, med: list[float] = med) -> float:
            if not med:
                med.append(median_step_s(res))
            return med[0]

        # A request rejected at add() is no load: the rate judged is the servable requests'.
        served = offered * served_share(s) if offered is not None else None
        o = overload(res, lat, s, served, rate_scale, replicas)
        s["overload"] = o
        s.update(saturation(res, lat, s, served, o, median_s))
        if o is not None:
            warn.append(overload_line(s["label"], o, replicas))
            s["tail_burst"] = None
            continue
        s["tail_burst"] = b = tail_burst(res, lat, s.get("capacity_req_s"), median_s)
        if b is not None:
            notes.append(burst_line(s["label"], b, rate_scale))
    if len(warn) > 1:
        warn = [f"{warn[0]} ({len(warn)} of {len(summaries)} runs overloaded)"]
    return warn + notes
