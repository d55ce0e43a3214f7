"""A run's summary built as its steps and requests finish, for runs that keep no records (`simulate
--no-records`): memory that grows with the requests in flight and the distinct latencies, not with the
steps or the requests that finished.

Imports allowed: the standard library and stallfree.sim.outputs.buckets (a leaf); numpy lazily (a flush of a
buffer).

A replica in this mode keeps its step rows as a window (stallfree.sim.run.replica.Replica, `tally`): a
request's figures are computed from the window when it finishes, with the definitions of
stallfree.sim.outputs.report.latency_arrays, and the rows no request in flight can still read are folded
into the step figures and let go. What is exact and what is not:

- Counts and integer totals (completed, tokens, steps, queued steps, the largest KV in use) are exact.
- Means, standard deviations and the step figures' sums are sums of floats in another order than
  numpy's over the whole array: they agree to about 1e-12 relative (the test suite checks 1e-9).
- Percentiles come from a quantile sketch (QuantileSketch: Masson, Rim and Lee, "DDSketch: a fast
  and fully-mergeable quantile sketch with relative-error guarantees", VLDB 2019) of relative accuracy
  ALPHA: each value is held as its bucket's representative, within ALPHA of it, and the percentile is
  numpy's linear interpolation between the representatives of the two order statistics it reads, so
  it is within ALPHA (relative) of numpy's percentile on the exact values (both values >= 0).

Inter-token gaps are counted per step: a step with d decodes gives d gaps of (its end - the previous
step's end), which is every regular request's gap (one that decodes in every step from its first
token to its last); a request that was left out of a step or preempted (rare) has its true gaps added
and those per-step ones taken back when it finishes.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

from stallfree.sim.outputs.buckets import prompt_bucket

__all__ = ["ALPHA", "FLUSH", "Moments", "QuantileSketch", "RunTally"]

#: The sketches' relative accuracy: every percentile of a --no-records run is within ALPHA of the exact one.
ALPHA = 1e-3
#: Values buffered before they are added to a sketch at once (numpy, vectorised): 8 bytes each.
FLUSH = 1 << 14


class Moments:
    """Count, mean and population standard deviation of weighted values added in batches, summed about a
    shift (the first value seen: the "shifted data" algorithm, so that a small spread about a large mean
    keeps its digits). Weights may be negative (a correction takes values back).

    Attributes:
        n: total weight (values counted), an int.
    """

    __slots__ = ("_k", "_s1", "_s2", "n")

    def __init__(self) -> None:
        self.n = 0
        self._k: float | None = None
        self._s1: list[float] = []  # partial sums, added with math.fsum at the end
        self._s2: list[float] = []

    def add(self, values: Any, weights: Any = None) -> None:
        """Add numpy float64 `values` (any unit), each `weights` times (an int array or None: once)."""
        import numpy as np

        if not len(values):
            return
        if self._k is None:
            self._k = float(values[0])
        x = values - self._k
        if weights is None:
            self.n += len(values)
            self._s1.append(math.fsum(x))
            self._s2.append(math.fsum(x * x))
        else:
            w = np.asarray(weights, dtype=np.float64)
            self.n += int(np.asarray(weights).sum())
            self._s1.append(math.fsum(x * w))
            self._s2.append(math.fsum(x * x * w))
        if len(self._s1) > 1024:  # folded now and then: a run holds a few floats, not one per batch
            self._s1 = [math.fsum(self._s1)]
            self._s2 = [math.fsum(self._s2)]

    def merge(self, other: Moments) -> None:
        """Add `other`'s values to these (re-shifted to this shift)."""
        if other.n == 0 and not other._s1:
            return
        if self._k is None:
            self._k = other._k
        d = (other._k or 0.0) - (self._k or 0.0)
        s1, s2, n = math.fsum(other._s1), math.fsum(other._s2), other.n
        # sum(x - k) = sum(x - k') + n d; sum((x - k)^2) = sum((x - k')^2) + 2 d sum(x - k') + n d^2
        self._s1.append(s1 + n * d)
        self._s2.append(s2 + 2 * d * s1 + n * d * d)
        self.n += n

    @property
    def mean(self) -> float:
        """The mean (nan with no values)."""
        if self.n <= 0:
            return math.nan
        return (self._k or 0.0) + math.fsum(self._s1) / self.n

    @property
    def std(self) -> float:
        """The population standard deviation, as numpy's std (nan with no values)."""
        if self.n <= 0:
            return math.nan
        m1 = math.fsum(self._s1) / self.n
        return math.sqrt(max(math.fsum(self._s2) / self.n - m1 * m1, 0.0))


class QuantileSketch:
    """Weighted values >= 0 in logarithmic buckets of relative width 2 alpha: a value x > 0 is counted in
    bucket ceil(log_gamma(x)), gamma = (1 + alpha) / (1 - alpha), and read back as that bucket's
    representative 2 gamma^i / (gamma + 1), within alpha of x (DDSketch, VLDB 2019); zeros are kept
    exactly. Counts live in one numpy int64 array over the buckets between the smallest and the largest
    seen (8 bytes a bucket: about ln(max / min) / (2 alpha) of them).

    Args:
        alpha: relative accuracy, 0 < alpha < 1 (default ALPHA).

    Raises:
        ValueError: alpha out of range; add() of a negative or non-finite value.
    """

    __slots__ = ("_counts", "_lg", "_lo", "alpha", "gamma", "zeros")

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        self.alpha = alpha
        self.gamma = (1 + alpha) / (1 - alpha)
        self._lg = math.log(self.gamma)
        self.zeros = 0
        self._lo = 0  # bucket index of _counts[0]
        self._counts: Any = None  # numpy int64 array, or None before the first positive value

    @property
    def n(self) -> int:
        """Values counted (their total weight)."""
        return self.zeros + (int(self._counts.sum()) if self._counts is not None else 0)

    def add(self, values: Any, weights: Any = None) -> None:
        """Count numpy float64 `values` (>= 0), each `weights` times (an int array, negative to take values
        back, or None: once each)."""
        import numpy as np

        if not len(values):
            return
        values = np.asarray(values, dtype=np.float64)
        if not np.isfinite(values).all() or (values < 0).any():
            bad = values[~np.isfinite(values) | (values < 0)][0]
            raise ValueError(f"QuantileSketch: values must be finite and >= 0, got {float(bad)!r}")
        w = np.ones(len(values), dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64)
        pos = values > 0
        self.zeros += int(w[~pos].sum())
        if not pos.all():
            values, w = values[pos], w[pos]
            if not len(values):
                return
        idx = np.ceil(np.log(values) / self._lg).astype(np.int64)
        lo, hi = int(idx.min()), int(idx.max())
        self._grow(lo, hi)
        counts = np.bincount(idx - self._lo, weights=w, minlength=len(self._counts))
        self._counts += np.rint(counts).astype(np.int64)

    def _grow(self, lo: int, hi: int) -> None:
        import numpy as np

        c = self._counts
        if c is None:
            self._lo, self._counts = lo, np.zeros(hi - lo + 1, dtype=np.int64)
            return
        new_lo, new_hi = min(lo, self._lo), max(hi, self._lo + len(c) - 1)
        if new_lo == self._lo and new_hi == self._lo + len(c) - 1:
            return
        grown = np.zeros(new_hi - new_lo + 1, dtype=np.int64)
        grown[self._lo - new_lo:self._lo - new_lo + len(c)] = c
        self._lo, self._counts = new_lo, grown

    def merge(self, other: QuantileSketch) -> None:
        """Add `other`'s counts (the same alpha).

        Raises:
            ValueError: the sketches' alphas differ.
        """
        if other.alpha != self.alpha:
            raise ValueError(f"QuantileSketch.merge: alpha {other.alpha!r} against {self.alpha!r}")
        self.zeros += other.zeros
        if other._counts is None:
            return
        self._grow(other._lo, other._lo + len(other._counts) - 1)
        start = other._lo - self._lo
        self._counts[start:start + len(other._counts)] += other._counts

    def kth(self, ranks: Sequence[int]) -> dict[int, float]:
        """The representatives of the values of 0-based `ranks` in ascending order (each < n)."""
        import numpy as np

        out: dict[int, float] = {}
        rest = []
        for k in ranks:
            if k < self.zeros:
                out[k] = 0.0
            else:
                rest.append(k)
        if rest:
            cum = np.cumsum(self._counts)
            where = np.searchsorted(cum, np.asarray(rest, dtype=np.int64) - self.zeros, side="right")
            for k, i in zip(rest, where.tolist(), strict=True):
                out[k] = 2 * self.gamma ** (self._lo + i) / (self.gamma + 1)
        return out

    def percentiles(self, qs: Sequence[float]) -> list[float]:
        """numpy's percentile (method "linear") of each q in `qs` (0-100) over the representatives.

        Raises:
            ValueError: the sketch is empty.
        """
        n = self.n
        if n <= 0:
            raise ValueError("QuantileSketch.percentiles: no values")
        spots = []
        for q in qs:
            virtual = (n - 1) * (q / 100)
            lo = min(max(math.floor(virtual), 0), n - 1)
            spots.append((lo, min(lo + 1, n - 1), virtual - lo))
        kth = self.kth(sorted({k for lo, hi, _ in spots for k in (lo, hi)}))
        out = []
        for lo, hi, frac in spots:
            a, b = kth[lo], kth[hi]
            out.append(a + (b - a) * frac if frac > 0 else a)  # numpy's lerp
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the counts hold."""
        return 0 if self._counts is None else int(self._counts.nbytes)


class _Stream:
    """Values of one figure (s) buffered and added in batches to its sketch and moments."""

    __slots__ = ("buf", "moments", "sketch")

    def __init__(self) -> None:
        self.buf = array("d")
        self.sketch = QuantileSketch()
        self.moments = Moments()

    def flush(self) -> None:
        import numpy as np

        if not self.buf:
            return
        values = np.array(self.buf, dtype=np.float64)
        self.sketch.add(values)
        self.moments.add(values)
        del self.buf[:]

    def merge(self, other: _Stream) -> None:
        other.flush()
        self.flush()
        self.sketch.merge(other.sketch)
        self.moments.merge(other.moments)


#: Per-request figures streamed: TTFT, TPOT, E2E and queueing delay (s).
_FIGURES = ("ttft", "tpot", "e2e", "queue")
#: Prompt-length buckets' figures (stallfree.sim.outputs.buckets): median and p99 only.
_BUCKET_FIGURES = ("ttft", "tpot", "e2e")


class RunTally:
    """What a --no-records run's summary needs, added to as requests and steps finish and mergeable across
    a cluster's replicas (stallfree.sim.outputs.report.summarize_result reads it for a result that holds one).

    Attributes:
        completed: requests finished with a first token; input_tokens, output_tokens: theirs (tokens).
        last_finish: the latest finish, s (-inf before any).
        good: requests that met the SLOs (slo_ttft, slo_tpot, s; None: no objective).
        num_steps, token_sum, queued_steps, kv_max: steps, their tokens, steps after which requests
            waited, the most KV reserved after a step (tokens; None before any step).
        busy_s, kv_s, decodes_s: sums over steps of the duration, s, of KV reserved x duration (token s)
            and decodes x duration (s).
        bucket_requests: per prompt-length bucket name, finished requests.
    """

    def __init__(self, slo_ttft: float | None = None, slo_tpot: float | None = None) -> None:
        self.slo_ttft, self.slo_tpot = slo_ttft, slo_tpot
        self.completed = self.input_tokens = self.output_tokens = self.good = 0
        self.last_finish = -math.inf
        self.figures = {name: _Stream() for name in _FIGURES}
        self.buckets: dict[str, dict[str, _Stream]] = {}
        self.bucket_requests: dict[str, int] = {}
        self.itl = QuantileSketch()
        self.itl_moments = Moments()
        self.num_steps = self.token_sum = self.queued_steps = 0
        self.kv_max: int | None = None
        self._busy: list[float] = []
        self._kv: list[float] = []
        self._dec: list[float] = []

    def request(self, ttft: float, tpot: float | None, e2e: float, queue: float, finish: float,
                prompt_len: int, tokens: int) -> None:
        """A request finished with `tokens` >= 1 tokens at `finish`, s: its figures (s; tpot None with one token)."""
        self.completed += 1
        self.input_tokens += prompt_len
        self.output_tokens += tokens
        if finish > self.last_finish:
            self.last_finish = finish
        figs = self.figures
        figs["ttft"].buf.append(ttft)
        figs["e2e"].buf.append(e2e)
        figs["queue"].buf.append(queue)
        if tpot is not None:
            figs["tpot"].buf.append(tpot)
        good = (self.slo_ttft is None or ttft <= self.slo_ttft) and (
            self.slo_tpot is None or tpot is None or tpot <= self.slo_tpot)
        self.good += good
        name = prompt_bucket(prompt_len)
        bucket = self.buckets.get(name)
        if bucket is None:
            bucket = self.buckets[name] = {key: _Stream() for key in _BUCKET_FIGURES}
            self.bucket_requests[name] = 0
        self.bucket_requests[name] += 1
        bucket["ttft"].buf.append(ttft)
        bucket["e2e"].buf.append(e2e)
        if tpot is not None:
            bucket["tpot"].buf.append(tpot)
        if len(figs["ttft"].buf) >= FLUSH:
            self._flush_requests()

    def gaps(self, values: Any, weights: Any) -> None:
        """Inter-token gaps (s), each counted `weights` times (negative: taken back); numpy arrays."""
        self.itl.add(values, weights)
        self.itl_moments.add(values, weights)

    def steps(self, start: Any, end: Any, prev_end: float, tokens: Any, decodes: Any, kv: Any,
              waiting: Any) -> None:
        """Fold step rows (numpy arrays of equal length: start and end, s; tokens, decodes, KV reserved, tokens,
        waiting requests, after each); `prev_end`: the end, s, of the step before the first (its decodes'
        gaps are measured from it; any value when the first has no decodes)."""
        import numpy as np

        k = len(end)
        if not k:
            return
        self.num_steps += k
        self.token_sum += int(tokens.sum(dtype=np.int64))
        self.queued_steps += int(np.count_nonzero(waiting))
        top = int(kv.max())
        self.kv_max = top if self.kv_max is None or top > self.kv_max else self.kv_max
        dur = end - start
        self._busy.append(math.fsum(dur))
        self._kv.append(math.fsum(kv * dur))
        self._dec.append(math.fsum(decodes * dur))
        if len(self._busy) > 1024:
            self._busy, self._kv, self._dec = [math.fsum(self._busy)], [math.fsum(self._kv)], [math.fsum(self._dec)]
        with_decodes = decodes > 0
        if with_decodes.any():
            gaps = np.empty(k, dtype=np.float64)
            gaps[0] = end[0] - prev_end
            gaps[1:] = end[1:] - end[:-1]
            self.gaps(gaps[with_decodes], decodes[with_decodes])

    @property
    def busy_s(self) -> float:
        return math.fsum(self._busy)

    @property
    def kv_s(self) -> float:
        return math.fsum(self._kv)

    @property
    def decodes_s(self) -> float:
        return math.fsum(self._dec)

    def _flush_requests(self) -> None:
        for s in self.figures.values():
            s.flush()
        for bucket in self.buckets.values():
            for s in bucket.values():
                s.flush()

    def flush(self) -> None:
        """Add every buffered value to its sketch (before a read or a merge)."""
        self._flush_requests()

    def merge(self, other: RunTally) -> None:
        """Add `other`'s requests and steps to these (a cluster's figures from its replicas')."""
        other.flush()
        self.flush()
        self.completed += other.completed
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.good += other.good
        self.last_finish = max(self.last_finish, other.last_finish)
        for name in _FIGURES:
            self.figures[name].merge(other.figures[name])
        for name, bucket in other.buckets.items():
            mine = self.buckets.setdefault(name, {key: _Stream() for key in _BUCKET_FIGURES})
            self.bucket_requests[name] = self.bucket_requests.get(name, 0) + other.bucket_requests[name]
            for key in _BUCKET_FIGURES:
                mine[key].merge(bucket[key])
        self.itl.merge(other.itl)
        self.itl_moments.merge(other.itl_moments)
        self.num_steps += other.num_steps
        self.token_sum += other.token_sum
        self.queued_steps += other.queued_steps
        if other.kv_max is not None:
            self.kv_max = other.kv_max if self.kv_max is None else max(self.kv_max, other.kv_max)
        self._busy.append(other.busy_s)
        self._kv.append(other.kv_s)
        self._dec.append(other.decodes_s)

    @property
    def nbytes(self) -> int:
        """Bytes the sketches' counts hold (what grows with the distinct latencies)."""
        total = self.itl.nbytes + sum(s.sketch.nbytes for s in self.figures.values())
        return total + sum(s.sketch.nbytes for b in self.buckets.values() for s in b.values())
