"""Latency metrics of served requests (TTFT, TPOT, ITL, E2E latency, goodput) as pure functions.

Imports allowed: the standard library only; nothing else from stallfree.

Definitions (docs/DESIGN.md section 4; the usual serving-benchmark ones, with vLLM's result names):

- TTFT = first token time - arrival.
- TPOT = (E2E - TTFT) / (output tokens - 1): a per-request mean, defined only for >= 2 tokens.
- ITL = each gap between consecutive tokens of one request: a per-token distribution.
- E2E latency = finish - arrival (vLLM calls it e2el).
- Goodput = completed requests that meet every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot; a
  one-token request is judged on TTFT alone) divided by the time from the first arrival to the last
  finish, in requests/s (DistServe, Zhong et al., OSDI'24).

Percentiles interpolate linearly between order statistics (Hyndman and Fan type 7, numpy's default),
so the numbers match those of benchmarks that call numpy.percentile.

All times are seconds (float) unless a name ends in `_ms`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_PERCENTILES",
    "RequestTimeline",
    "e2e",
    "goodput",
    "itl",
    "meets_slo",
    "parse_duration",
    "percentile",
    "queueing_delay",
    "stats_ms",
    "summarize",
    "throughput_figures",
    "tpot",
    "ttft",
]

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    """The observed life of one request: when it arrived, was admitted, and emitted each token.

    Args:
        rid: the request id.
        arrival: arrival time, s.
        token_times: the time each output token was emitted, s, non-decreasing and >= arrival;
            empty if it emitted none.
        prompt_len: prompt length, tokens (for throughput counts); 0 if unknown.
        admitted: admission time (first prefill chunk scheduled), s; None if never admitted.
        finish: finish time, s; None means the time of the last token.

    Raises:
        ValueError: a token time is earlier than arrival or than the token before it, or finish
            is earlier than the last token; the message names the value.
    """

    rid: Hashable
    arrival: float
    token_times: tuple[float, ...]
    prompt_len: int = 0
    admitted: float | None = None
    finish: float | None = None

    def __post_init__(self) -> None:
        prev = self.arrival
        for i, t in enumerate(self.token_times):
            if t < prev:
                raise ValueError(
                    f"request {self.rid!r}: token_times[{i}] = {t!r} is earlier than "
                    f"{'arrival' if i == 0 else f'token_times[{i - 1}]'} = {prev!r}"
                )
            prev = t
        if self.finish is not None and self.finish < prev:
            raise ValueError(f"request {self.rid!r}: finish = {self.finish!r} is earlier than {prev!r}")

    @property
    def num_generated(self) -> int:
        """Output tokens emitted."""
        return len(self.token_times)

    @property
    def finish_time(self) -> float | None:
        """finish if given, else the last token's time; None if it emitted nothing."""
        if self.finish is not None:
            return self.finish
        return self.token_times[-1] if self.token_times else None


def ttft(tl: RequestTimeline) -> float | None:
    """Time to first token, s; None when no token was emitted."""
    return tl.token_times[0] - tl.arrival if tl.token_times else None


def tpot(tl: RequestTimeline) -> float | None:
    """Time per output token after the first, s: (E2E - TTFT) / (tokens - 1); None below 2 tokens."""
    n = len(tl.token_times)
    if n < 2:
        return None
    finish = tl.finish_time
    assert finish is not None
    return (finish - tl.token_times[0]) / (n - 1)


def itl(tl: RequestTimeline) -> list[float]:
    """Inter-token latencies, s: the gaps between consecutive tokens (tokens - 1 values)."""
    t = tl.token_times
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def e2e(tl: RequestTimeline) -> float | None:
    """End-to-end latency, s: finish - arrival; None when it never finished or emitted."""
    finish = tl.finish_time
    return None if finish is None else finish - tl.arrival


def queueing_delay(tl: RequestTimeline) -> float | None:
    """Time from arrival to admission, s; None when it was never admitted."""
    return None if tl.admitted is None else tl.admitted - tl.arrival


def meets_slo(tl: RequestTimeline, slo_ttft: float | None = None, slo_tpot: float | None = None) -> bool:
    """Whether a completed request meets every SLO given (a one-token request: TTFT alone).

    Args:
        tl: the request.
        slo_ttft: the most TTFT allowed, s; None for no TTFT objective.
        slo_tpot: the most TPOT allowed, s; None for no TPOT objective.

    Returns:
        False when it emitted nothing; otherwise whether each given bound holds (inclusive).
    """
    first = ttft(tl)
    if first is None:
        return False
    if slo_ttft is not None and first > slo_ttft:
        return False
    per_token = tpot(tl)
    return not (slo_tpot is not None and per_token is not None and per_token > slo_tpot)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default).

    Args:
        values: the sample (any order); not modified.
        q: percentile in [0, 100].

    Raises:
        ValueError: `values` is empty or q is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pct_label(q: float) -> str:
    return f"p{q:g}"


def stats_ms(
    name: str, values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES
) -> dict[str, float | None]:
    """Mean, median, std (population) and percentiles of a sample in s, as `{stat}_{name}_ms` keys.

    Example: stats_ms("ttft", [0.1, 0.3]) -> {"mean_ttft_ms": 200.0, "median_ttft_ms": 200.0,
    "std_ttft_ms": 100.0, "p50_ttft_ms": 200.0, ...}. Every value is None for an empty sample.
    """
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"{_pct_label(q)}_{name}_ms" for q in percentiles]
    if not values_s:
        return dict.fromkeys(keys, None)
    n = len(values_s)
    mean = math.fsum(values_s) / n
    var = math.fsum((v - mean) ** 2 for v in values_s) / n
    out: dict[str, float | None] = {
        keys[0]: mean * 1e3,
        keys[1]: percentile(values_s, 50.0) * 1e3,
        keys[2]: math.sqrt(var) * 1e3,
    }
    for q in percentiles:
        out[f"{_pct_label(q)}_{name}_ms"] = percentile(values_s, q) * 1e3
    return out


def goodput(
    timelines: Sequence[RequestTimeline],
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> float:
    """Requests per second that meet every SLO, over first arrival to last finish.

    Raises:
        ValueError: no request finished (the duration is undefined).
    """
    done = [tl for tl in timelines if tl.finish_time is not None]
    if not done:
        raise ValueError("goodput needs at least one finished request")
    duration = _duration(timelines)
    good = sum(1 for tl in done if meets_slo(tl, slo_ttft, slo_tpot))
    return good / duration if duration > 0 else math.inf


def _duration(timelines: Sequence[RequestTimeline]) -> float:
    first = min(tl.arrival for tl in timelines)
    last = max(f for tl in timelines if (f := tl.finish_time) is not None)
    return last - first


def throughput_figures(completed: int, input_tokens: int, output_tokens: int,
                       duration: float) -> dict[str, float | int | None]:
    """The totals and rates of vLLM's serving benchmark, in its key order: completed, total_input_tokens,
    total_output_tokens, duration_s, request_throughput (req/s), output_throughput and
    total_token_throughput (tokens/s), each over `duration` s (inf when it is 0), and request_goodput
    (None here: the caller fills it when an SLO is given)."""
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: math.inf)
    return {
        "completed": completed,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "duration_s": duration,
        "request_throughput": rate(completed),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "request_goodput": None,
    }


def summarize(
    timelines: Sequence[RequestTimeline],
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, float | int | None]:
    """Summarize requests with the keys of vLLM's serving benchmark.

    Keys: completed, total_input_tokens, total_output_tokens, duration_s (first arrival to last
    finish), request_throughput (req/s), output_throughput and total_token_throughput (tokens/s),
    request_goodput (req/s; None without an SLO), then mean/median/std/pXX of ttft, tpot, itl,
    e2el and queue (queueing delay) in ms. Requests that emitted nothing are not counted as
    completed but still bound the duration by their arrival.

    Raises:
        ValueError: no request finished.
    """
    pcts = tuple(percentiles)
    done = [tl for tl in timelines if tl.finish_time is not None and tl.token_times]
    if not done:
        raise ValueError("summarize needs at least one finished request")
    duration = _duration(timelines)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: math.inf)
    n_out = sum(tl.num_generated for tl in done)
    n_in = sum(tl.prompt_len for tl in done)
    out = throughput_figures(len(done), n_in, n_out, duration)
    if slo_ttft is not None or slo_tpot is not None:
        out["request_goodput"] = rate(sum(1 for tl in done if meets_slo(tl, slo_ttft, slo_tpot)))
    ttfts = [v for tl in done if (v := ttft(tl)) is not None]
    tpots = [v for tl in done if (v := tpot(tl)) is not None]
    itls = [g for tl in done for g in itl(tl)]
    e2es = [v for tl in done if (v := e2e(tl)) is not None]
    queues = [v for tl in done if (v := queueing_delay(tl)) is not None]
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es), ("queue", queues)):
        out.update(stats_ms(name, vals, pcts))
    return out


def parse_duration(text: str) -> float:
    """Parse a duration such as "200ms", "0.5s" or "200" (a bare number is ms) into seconds.

    Raises:
        ValueError: not a number with an optional "ms" or "s" suffix, or negative; the message
            quotes the text.
    """
    s = text.strip().lower()
    scale = 1e-3
    if s.endswith("ms"):
        s = s[:-2]
    elif s.endswith("s"):
        s, scale = s[:-1], 1.0
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 200ms, 0.5s or 200)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"a duration must be finite and >= 0, got {text!r}")
    return value * scale
