"""Engine against simulator: per-request latencies, their percentiles, and the errors between two runs
of the same requests; the vLLM benchmark result reader. No torch here.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim.

Metrics (DESIGN.md section 4, vLLM's serving-benchmark definitions), per request, seconds:
TTFT = first token - arrival; TPOT = (E2E - TTFT) / (tokens - 1); ITL = each gap between consecutive
tokens (pooled over requests for percentiles; per request, its mean gap); E2E = finish - arrival.
Errors, percent: the absolute percentage error of each request, |sim - engine| / engine x 100, summarised
by its median and p90 over the compared requests (`<m>_median_ape_pct`, `<m>_p90_ape_pct`); and the
signed error of each percentile of the distribution, (sim - engine) / engine x 100 (`<m>_p50_err_pct`,
`<m>_p90_err_pct`, `<m>_p99_err_pct`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree._files import FileLimitError, read_json
from stallfree.core.metrics import RequestTimeline, percentile
from stallfree.validate.errors import ValidateDataError

__all__ = [
    "METRICS",
    "PERCENTILES",
    "Latencies",
    "VllmResult",
    "compare",
    "latencies",
    "read_vllm_result",
    "summary",
]

METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class Latencies:
    """One request's latencies, seconds; tpot and itl_mean are None for a one-token request.

    Attributes:
        ttft, tpot, e2e: as in the module docstring.
        itl_mean: the mean gap between its consecutive tokens.
        itls: every gap.
    """

    ttft: float
    tpot: float | None
    e2e: float
    itl_mean: float | None
    itls: tuple[float, ...]

    def value(self, metric: str) -> float | None:
        """Return the per-request value of `metric` ('ttft', 'tpot', 'itl' (mean gap) or 'e2e')."""
        return {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl_mean, "e2e": self.e2e}[metric]


def latencies(timelines: Iterable[RequestTimeline]) -> dict[Hashable, Latencies]:
    """Return each finished request's Latencies, by rid (requests that emitted nothing are left out)."""
    out = {}
    for tl in timelines:
        t = tl.token_times
        finish = tl.finish_time
        if not t or finish is None:
            continue
        gaps = tuple(t[i] - t[i - 1] for i in range(1, len(t)))
        n = len(t)
        out[tl.rid] = Latencies(
            ttft=t[0] - tl.arrival,
            tpot=(finish - t[0]) / (n - 1) if n > 1 else None,
            e2e=finish - tl.arrival,
            itl_mean=sum(gaps) / len(gaps) if gaps else None,
            itls=gaps,
        )
    return out


def _values(lat: dict[Hashable, Latencies], rids: Sequence[Hashable], metric: str) -> list[float]:
    if metric == "itl":
        return [g for r in rids if r in lat for g in lat[r].itls]
    return [v for r in rids if r in lat for v in [lat[r].value(metric)] if v is not None]


def summary(lat: dict[Hashable, Latencies], rids: Sequence[Hashable]) -> dict[str, Any]:
    """Return the mean and p50 / p90 / p99 of each metric over `rids`, in ms (`p50_ttft_ms`, ...),
    and the number of requests; None where a metric has no sample."""
    out: dict[str, Any] = {"requests": sum(1 for r in rids if r in lat)}
    for m in METRICS:
        vals = _values(lat, rids, m)
        out[f"mean_{m}_ms"] = sum(vals) / len(vals) * 1e3 if vals else None
        for q in PERCENTILES:
            out[f"p{q:g}_{m}_ms"] = percentile(vals, q) * 1e3 if vals else None
    return out


def compare(
    engine: dict[Hashable, Latencies], sim: dict[Hashable, Latencies], rids: Sequence[Hashable]
) -> dict[str, float | None]:
    """Return the errors of the module docstring for each metric over `rids` (requests in both runs).

    Raises:
        ValueError: no request of `rids` is in both runs.
    """
    both = [r for r in rids if r in engine and r in sim]
    if not both:
        raise ValueError("no request finished in both the engine and the simulator")
    out: dict[str, float | None] = {"requests": float(len(both))}
    es, ss = summary(engine, both), summary(sim, both)
    for m in METRICS:
        apes = []
        for r in both:
            e, s = engine[r].value(m), sim[r].value(m)
            if e is not None and s is not None and e > 0:
                apes.append(abs(s - e) / e * 100.0)
        out[f"{m}_median_ape_pct"] = percentile(apes, 50.0) if apes else None
        out[f"{m}_p90_ape_pct"] = percentile(apes, 90.0) if apes else None
        for q in PERCENTILES:
            e, s = es[f"p{q:g}_{m}_ms"], ss[f"p{q:g}_{m}_ms"]
            out[f"{m}_p{q:g}_err_pct"] = (s - e) / e * 100.0 if e and s is not None else None
    return out


# ------------------------------------------------------------------------------------ vLLM results
@dataclass(frozen=True, slots=True)
class VllmResult:
    """A `vllm bench serve` result saved with per-request details.

    Attributes:
        prompt_lens, output_lens: per request, tokens.
        ttfts: per request, seconds.
        itls: per request, the gaps between its tokens, seconds.
        request_rate: the offered rate, requests/s (inf: all at once).
        burstiness: the gamma shape of the arrival gaps (1.0: Poisson).
        arrivals: per request arrival times, s, when the file has them (start times), else None.
    """

    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    ttfts: tuple[float, ...]
    itls: tuple[tuple[float, ...], ...]
    request_rate: float
    burstiness: float = 1.0
    arrivals: tuple[float, ...] | None = None

    def timelines(self) -> list[RequestTimeline]:
        """Return the measured requests as timelines, each arriving at its arrival (or at 0)."""
        out = []
        for i, (ttft, gaps) in enumerate(zip(self.ttfts, self.itls, strict=True)):
            a = self.arrivals[i] if self.arrivals is not None else 0.0
            t = [a + ttft]
            for g in gaps:
                t.append(t[-1] + g)
            out.append(RequestTimeline(i, a, tuple(t), self.prompt_lens[i]))
        return out

    def arrival_times(self, seed: int = 0) -> tuple[float, ...]:
        """Return the arrival times: the file's, else gamma-distributed gaps at request_rate (vLLM's
        arrival process: Poisson at burstiness 1), seeded; all at 0 for an infinite rate."""
        if self.arrivals is not None:
            return self.arrivals
        n = len(self.prompt_lens)
        if math.isinf(self.request_rate):
            return (0.0,) * n
        rng = random.Random(seed)
        theta = 1.0 / (self.request_rate * self.burstiness)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(self.burstiness, theta)
        return tuple(out)


def _list(data: dict[str, Any], where: str, *names: str) -> list[Any]:
    for name in names:
        value = data.get(name)
        if isinstance(value, list):
            return value
    raise ValidateDataError(f"{where}: no per-request list {' or '.join(repr(n) for n in names)} (save the result "
                     "with per-request details: vllm bench serve --save-result --save-detailed)")


def read_vllm_result(path: str | Path) -> VllmResult:
    """Read a `vllm bench serve --save-result --save-detailed` JSON file.

    Keys read: input_lens, output_lens, ttfts (s), itls (per request, s), request_rate ("inf" or a
    number), burstiness (default 1.0), and start_times (per request, s) when present. Requests with a
    ttft of 0 or an output of 0 tokens (failed) are left out.

    Raises:
        ValueError: the file cannot be read or parsed, a list is missing or of the wrong length, or a
            value is not a number; the message names the key.
    """
    p = Path(path)
    where = f"--vllm-result {str(p)!r}"
    try:
        data = read_json(p)
    except FileLimitError as exc:
        raise ValidateDataError(f"{where}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot read: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidateDataError(f"{where}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise ValidateDataError(f"{where}: must hold a JSON object")
    ins, outs = _list(data, where, "input_lens"), _list(data, where, "output_lens")
    ttfts, itls = _list(data, where, "ttfts"), _list(data, where, "itls")
    starts = data.get("start_times")
    n = len(ins)
    for name, lst in (("output_lens", outs), ("ttfts", ttfts), ("itls", itls)):
        if len(lst) != n:
            raise ValidateDataError(f"{where}: {name} has {len(lst)} entries, input_lens {n}")
    rate_raw = data.get("request_rate", "inf")
    try:
        rate = float(rate_raw)
        burst = float(data.get("burstiness", 1.0))
        keep = [i for i in range(n) if float(ttfts[i]) > 0 and int(outs[i]) > 0]
        res = VllmResult(
            prompt_lens=tuple(int(ins[i]) for i in keep),
            output_lens=tuple(int(outs[i]) for i in keep),
            ttfts=tuple(float(ttfts[i]) for i in keep),
            itls=tuple(tuple(float(g) for g in itls[i]) for i in keep),
            request_rate=rate,
            burstiness=burst,
            arrivals=None
            if not isinstance(starts, list) or len(starts) != n
            else tuple(float(starts[i]) - float(min(starts)) for i in keep),
        )
    except (TypeError, ValueError) as exc:
        raise ValidateDataError(f"{where}: a value is not a number ({exc})") from None
    if not res.prompt_lens:
        raise ValidateDataError(f"{where}: no successful request")
    if not rate > 0:
        raise ValidateDataError(f"{where}: request_rate must be > 0, got {rate_raw!r}")
    return res
