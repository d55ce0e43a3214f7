"""Arrivals under a rate that changes over time: a 24-hour diurnal curve (`--synthetic diurnal`) or a
rate profile read from a CSV file (`--rate-profile FILE`), so that a day can be simulated without a
day-long trace.

Imports allowed: the standard library, stallfree._files and stallfree.sim (workload).

The rate r(t), requests/s, is linear between points (t_i, r_i). Arrivals are a unit-rate process
(exponential gaps of mean 1: Poisson; Gamma gaps of shape `burstiness` and mean 1: gamma) mapped
through the inverse of the cumulative rate R(t) = integral of r from the first point to t (time
rescaling): arrival k is at R^-1(s_k), where s_k is the unit process's k-th time. Under Poisson gaps
this is exactly the inhomogeneous Poisson process of rate r(t); under Gamma gaps, the bursts of the
gamma process scaled to the rate of the moment. Arrivals stop at the last point's time.

The diurnal curve: r(t) = rate x (1 + a cos(2 pi (t / 3600 - peak_hour) / 24)) with
a = (peak_ratio - 1) / (peak_ratio + 1), so that the busiest hour's rate is peak_ratio times the
quietest's and the mean over the day is `rate`; sampled every DIURNAL_STEP_S (the trapezoid rule of a
cosine over whole periods is exact, so the linear profile keeps the mean).
"""

from __future__ import annotations

import csv
import math
import random
from bisect import bisect_right
from dataclasses import replace
from pathlib import Path
from typing import Any

from stallfree._files import duplicated_column, open_text
from stallfree.sim.inputs.synthetic import LengthSpec, synthetic
from stallfree.sim.inputs.workload import Workload

__all__ = [
    "DAY_S",
    "DEFAULT_PEAK_HOUR",
    "DEFAULT_PEAK_RATIO",
    "DIURNAL_STEP_S",
    "diurnal_profile",
    "options_workload",
    "profile_times",
    "profile_workload",
    "read_rate_profile",
]

#: A day, s.
DAY_S = 86_400.0
#: The diurnal curve's points, every 5 minutes.
DIURNAL_STEP_S = 300.0
#: The busiest hour's rate over the quietest's: an example default, not a measurement (give yours).
DEFAULT_PEAK_RATIO = 3.0
#: The hour of the day, 0 to 24, of the busiest rate: an example default (mid-afternoon).
DEFAULT_PEAK_HOUR = 14.0


def diurnal_profile(rate: float, peak_ratio: float = DEFAULT_PEAK_RATIO,
                    peak_hour: float = DEFAULT_PEAK_HOUR) -> list[tuple[float, float]]:
    """The diurnal curve (module docstring) as (t_s, requests/s) points every DIURNAL_STEP_S over a day.

    Raises:
        ValueError: rate <= 0, peak_ratio < 1, or peak_hour outside [0, 24] (named as their flags).
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--rate {rate!r}: must be a number of requests/s > 0")
    if not (math.isfinite(peak_ratio) and peak_ratio >= 1):
        raise ValueError(f"--peak-ratio {peak_ratio!r}: must be a number >= 1 (the busiest rate over the quietest)")
    if not (math.isfinite(peak_hour) and 0 <= peak_hour <= 24):
        raise ValueError(f"--peak-hour {peak_hour!r}: must be an hour in [0, 24]")
    a = (peak_ratio - 1) / (peak_ratio + 1)
    n = int(DAY_S / DIURNAL_STEP_S)
    return [(k * DIURNAL_STEP_S, rate * (1 + a * math.cos(2 * math.pi * (k * DIURNAL_STEP_S / 3600 - peak_hour) / 24)))
            for k in range(n + 1)]


def read_rate_profile(path: str | Path) -> list[tuple[float, float]]:
    """Read a rate profile: CSV with a header `t_s,rate` (s and requests/s), one point a row.

    Raises:
        ValueError: a missing column, a value that is not a finite number, a time not above the last
            one or below 0, a negative rate, fewer than two points, or no rate above 0 (the message
            names the file, the row and the value).
        OSError: the file cannot be read.
    """
    where = f"--rate-profile {path}"
    points: list[tuple[float, float]] = []
    with open_text(Path(path)) as fh:
        rows = csv.DictReader(fh)
        if rows.fieldnames is None or not {"t_s", "rate"} <= {f.strip() for f in rows.fieldnames}:
            raise ValueError(f"{where}: expected a header with the columns t_s,rate, got {rows.fieldnames!r}")
        twice = duplicated_column(rows.fieldnames)
        if twice is not None:
            raise ValueError(f"{where}: column {twice!r} appears twice in the header; give each column once")
        for line, row in enumerate(rows, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            try:
                t, r = float(row["t_s"]), float(row["rate"])
            except ValueError:
                raise ValueError(f"{where}: row {line}: t_s={row['t_s']!r}, rate={row['rate']!r} are not numbers") \
                    from None
            if not (math.isfinite(t) and t >= 0) or (points and t <= points[-1][0]):
                raise ValueError(f"{where}: row {line}: t_s={row['t_s']} must be >= 0 and above the row before")
            if not (math.isfinite(r) and r >= 0):
                raise ValueError(f"{where}: row {line}: rate={row['rate']} must be a number of requests/s >= 0")
            points.append((t, r))
    if len(points) < 2:
        raise ValueError(f"{where}: needs at least two points, got {len(points)}")
    if not any(r > 0 for _, r in points):
        raise ValueError(f"{where}: every rate is 0: no request would arrive")
    return points


def _cumulative(points: list[tuple[float, float]]) -> list[float]:
    """R at each point: the expected arrivals from the first point (trapezoids)."""
    out = [0.0]
    for (t0, r0), (t1, r1) in zip(points, points[1:], strict=False):
        out.append(out[-1] + (r0 + r1) / 2 * (t1 - t0))
    return out


def profile_times(points: list[tuple[float, float]], unit: list[float]) -> list[float]:
    """Map unit-rate times (non-decreasing, >= 0) through R^-1 (module docstring); those past the
    profile's total are dropped. Returns arrival times, s."""
    cum = _cumulative(points)
    total = cum[-1]
    out = []
    for s in unit:
        if s >= total:
            break
        i = min(bisect_right(cum, s) - 1, len(points) - 2)
        while cum[i + 1] <= s and i < len(points) - 2:
            i += 1
        (t0, r0), (t1, r1) = points[i], points[i + 1]
        x = s - cum[i]
        k = (r1 - r0) / (t1 - t0)
        # Solve r0 tau + k tau^2 / 2 = x for the root in [0, t1 - t0] (the stable form of the quadratic).
        disc = max(0.0, r0 * r0 + 2 * k * x)
        denom = r0 + math.sqrt(disc)
        tau = 2 * x / denom if denom > 0 else 0.0
        out.append(min(t0 + tau, t1))
    return out


def profile_workload(points: list[tuple[float, float]], prompt_len: LengthSpec, output_len: LengthSpec,
                     burstiness: float = 1.0, seed: int = 0, name: str = "profile",
                     max_requests: int | None = None) -> Workload:
    """Draw the requests arriving under the rate profile `points` (module docstring), with lengths drawn
    as stallfree.sim.inputs.synthetic.synthetic draws them.

    Args:
        points: (t_s, requests/s), t strictly increasing.
        prompt_len, output_len: length distributions, tokens.
        burstiness: Gamma shape of the unit process's gaps (1: Poisson).
        seed: seeds every draw (same seed, same workload).
        name: the workload's label.
        max_requests: refuse a profile expecting more requests than this (None: no bound).

    Raises:
        ValueError: the profile expects more than max_requests, or no request arrives.
    """
    expected = _cumulative(points)[-1]
    # Enough unit-rate gaps to pass the total almost surely (mean + 10 standard deviations of a
    # gamma renewal count, whose variance is about total / burstiness).
    n = int(expected + 10 * math.sqrt(expected / min(burstiness, 1.0)) + 20)
    if max_requests is not None and expected > max_requests:
        raise ValueError(f"the rate profile expects {expected:,.0f} requests, more than a synthetic run draws "
                         f"(at most {max_requests:,})")
    arrival = "poisson" if burstiness == 1.0 else "gamma"
    drawn = synthetic(n + 1, 1.0, prompt_len, output_len, arrival, burstiness, seed)
    # The first draw is at 0 by construction: start the unit process after one gap.
    gap = random.Random(seed ^ 0x5EED).expovariate(1.0) if arrival == "poisson" else \
        random.Random(seed ^ 0x5EED).gammavariate(burstiness, 1.0 / burstiness)
    unit = [gap + s for s in drawn.arrivals[:-1]]
    times = profile_times(points, unit)
    if not times:
        raise ValueError("no request arrives under the rate profile: its total is below one request")
    wl = drawn.head(len(times))
    return replace(wl, arrivals=tuple(times), name=name)


def options_workload(opts: Any, prompt_len: LengthSpec, output_len: LengthSpec,
                     max_requests: int) -> tuple[Workload, float]:
    """The workload of stallfree.sim.inputs.options.WorkloadOptions with synthetic "diurnal" or a rate_profile,
    and its rate scale (rate_scale, default 1): Gamma gaps when burstiness is not 1, the first
    num_requests when given.

    Raises:
        ValueError: the profile with a trace or another synthetic mode, more requests than `max_requests`,
            a bad profile file or a diurnal figure out of range (the message names the flag; setup turns
            it into a usage error).
        OSError: the profile file cannot be read.
    """
    if opts.trace:
        raise ValueError("--trace and a rate profile (--synthetic diurnal or --rate-profile) are exclusive")
    if opts.rate_profile is not None and opts.synthetic not in (None, "diurnal"):
        raise ValueError(f"--rate-profile gives the arrival rate: drop --synthetic {opts.synthetic}")
    if opts.rate_profile is not None:
        points, name = read_rate_profile(opts.rate_profile), f"rate-profile({Path(opts.rate_profile).name}"
    else:
        ratio = DEFAULT_PEAK_RATIO if opts.peak_ratio is None else opts.peak_ratio
        hour = DEFAULT_PEAK_HOUR if opts.peak_hour is None else opts.peak_hour
        points = diurnal_profile(opts.rate, ratio, hour)
        name = f"diurnal(rate={opts.rate:g}, peak-ratio={ratio:g}, peak-hour={hour:g}"
    if opts.burstiness != 1.0:
        name += f", burstiness={opts.burstiness:g}"
    name += f"; prompt {opts.prompt_len}; output {opts.output_len}; seed {opts.seed})"
    wl = profile_workload(points, prompt_len, output_len, opts.burstiness, opts.seed, name, max_requests)
    if opts.num_requests:
        wl = wl.head(opts.num_requests)
    return wl, opts.rate_scale or 1.0
