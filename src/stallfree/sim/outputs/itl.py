"""The inter-token gaps' figures of a run (mean, median, std and percentiles, ms) without holding
every gap: the figures numpy gives on the array of all gaps (stallfree.sim.outputs.report.latency_arrays'
"itl"), to the last bit, in memory that grows with the steps and the requests, not with the tokens.

Imports allowed: the standard library, stallfree.sim.run.result; numpy lazily.

A regular request (no skipped decode, no preemption) emits its first token at step a and then one
token in each step with decodes in (a, b]; its gaps are end[D[i0]] - end[a] (D: the steps with
decodes, in order; D[i0] the first after a) and then end[D[j]] - end[D[j - 1]] for the next ones. So
the gaps are, as a multiset, one "first gap" per request plus each step's gap to the previous step with
decodes, counted once per regular request that decodes in both: the percentiles come from those
values and counts (exact order statistics, then numpy's linear interpolation, `percentile`). The
mean and the standard deviation are sums, and numpy sums an array pairwise (split in halves, a
multiple of 8 long, down to blocks of 128); `pairwise_sum` follows that recursion and lets numpy sum
each piece of at most CHUNK gaps, which it gathers from each step's gap to the previous step with
decodes (one float a step, made once) and the requests' first gaps (`_Gaps.piece`): the same
additions in the same order, so the same result. Irregular requests (rare) keep their gaps as an
array, after the regular ones, as latency_arrays orders them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from stallfree.sim.run.memory import give_back
from stallfree.sim.run.result import SimResult, StepStarts

__all__ = ["CHUNK", "itl_stats", "median", "pairwise_sum", "percentile", "select", "step_durations", "step_numbers",
           "step_starts"]

#: Gaps generated at once (8 bytes each, a few arrays of them): the memory the sums take.
CHUNK = 1 << 16
#: select() sorts up to this many (value, count) pairs at once (24 bytes each while it does) and selects
#: by radix beyond.
SORT_PAIRS = 1 << 20
#: Up to this many gaps (16 MiB of float64), the mean and deviation are summed over one array of them;
#: beyond, piece by piece (pairwise_sum), in memory of a piece.
WHOLE_GAPS = 1 << 21
#: Up to this many steps with decodes (48 MiB), each one's gap to the previous and its count of requests are
#: held as arrays (12 bytes a step); beyond, they are made piece by piece from the step ends whenever read,
#: so that a run's summary needs no memory per step beyond its step rows (docs/costmodel.md, "Whole runs").
HELD_STEPS = 1 << 22


def pairwise_sum(n: int, piece: Callable[[int, int], Any]) -> float:
    """numpy's sum (np.add.reduce) of a float64 array of `n` values, the values [lo, hi) given by
    piece(lo, hi) as a numpy array: numpy's pairwise recursion (halves of a multiple of 8, the first
    half n // 2 rounded down to one), numpy summing each piece of at most CHUNK values itself."""
    return _pairwise(piece, 0, n)


def _pairwise(piece: Callable[[int, int], Any], lo: int, m: int) -> float:
    """pairwise_sum of the m values from lo. A module function, not a closure: a recursive closure refers to
    itself, and the cycle would hold `piece` (and what it reads: a run's gaps, hundreds of MB) until the
    garbage collector's next pass."""
    import numpy as np

    if m <= CHUNK:
        return float(np.add.reduce(piece(lo, lo + m))) if m else 0.0
    m2 = m // 2
    m2 -= m2 % 8
    return _pairwise(piece, lo, m2) + _pairwise(piece, lo + m2, m - m2)


def percentile(n: int, q: float, kth: Callable[[int], float]) -> float:
    """np.percentile(a, q) (method "linear") of a float64 array `a` of `n` >= 1 values, kth(k) its
    k-th smallest (0-based): numpy's virtual index, bounds and interpolation, step for step."""
    virtual = (n - 1) * (q / 100)
    if virtual >= n - 1:
        return kth(n - 1)
    if virtual < 0:
        return kth(0)
    prev = math.floor(virtual)
    gamma = virtual - prev
    a, b = kth(prev), kth(prev + 1)
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


class _DecodeSteps:
    """D, the steps with decodes of a result in order, held as whichever of D and its complement E (the
    steps without) is shorter: on a loaded run nearly every step decodes, and E is a few entries where D
    would be one per step. count_le(s) = how many of D are <= s (np.searchsorted(D, s, side="right")),
    the same integers either way."""

    def __init__(self, dec: Any) -> None:
        import numpy as np

        n = len(dec)
        self.num_steps = n
        nd = sum(int(np.count_nonzero(dec[c:c + CHUNK])) for c in range(0, n, CHUNK))
        self.explicit = nd <= n - nd
        # Counted first, then filled piece by piece: never the pieces and the whole at once.
        dtype = np.int32 if n < 2**31 else np.int64
        kept = np.empty(nd if self.explicit else n - nd, dtype=dtype)
        at = 0
        for c in range(0, n, CHUNK):
            piece = dec[c:c + CHUNK]
            idx = np.flatnonzero(piece if self.explicit else piece == 0)
            kept[at:at + len(idx)] = idx + c
            at += len(idx)
        self.kept = kept
        self.length = nd

    def __len__(self) -> int:
        return self.length

    def step_of(self, j: Any) -> Any:
        """D[j], the j-th step with decodes (0-based), for an integer array j of entries in [0, len(self)):
        read from D, or from E as j plus the steps without decodes before it (E[i] - i of them come before
        E[i], so E[i] precedes D[j] exactly when E[i] - i <= j)."""
        import numpy as np

        if self.explicit:
            return self.kept[j].astype(np.int64)
        before = getattr(self, "_before", None)
        if before is None:
            before = self._before = self.kept.astype(np.int64) - np.arange(len(self.kept), dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        return j + np.searchsorted(before, j, side="right")

    def count_le(self, s: Any) -> Any:
        """How many steps with decodes are <= s, for an integer array s of steps (int64)."""
        import numpy as np

        if self.explicit:
            return np.searchsorted(self.kept, s.astype(self.kept.dtype, copy=False), side="right")
        return s + 1 - np.searchsorted(self.kept, s.astype(self.kept.dtype, copy=False), side="right")


class _Gaps:
    """The gaps of a result, ms (latency_arrays' "itl" times 1e3, as the summary reports them), in
    latency_arrays' order: by index ranges (`piece`) and as (value, count) pairs (`pairs`), never all
    at once. Made of each step with decodes' gap to the previous one (D[j] - D[j - 1]: 0.0 at j = 0,
    which no regular gap reads), each regular request's first gap (`first`) and the irregular requests'
    gaps (`irregular`), and each step's count of requests that decode in it and the step before.
    Up to HELD_STEPS steps with decodes, the per-step gaps and counts are held (`per_step`, `weights`: 12
    bytes a step); beyond, each piece of them is made from the step ends and the requests' spans when read
    (the same floats: an end minus the previous one, times 1e3). About 24 bytes a request either way."""

    def __init__(self, res: SimResult, done: Any) -> None:
        import numpy as np

        end = np.frombuffer(res.step_end, dtype=np.float64)
        dec = np.asarray(res.step_decodes)
        first, fin = step_numbers(res.first_step), step_numbers(res.finish_step)
        irregular = set(res.skips) | set(res.segments)
        mine = done
        if irregular:
            mine = done[np.asarray([r not in irregular for r in done.tolist()], dtype=bool)]
        steps = _DecodeSteps(dec)
        ra = first[mine]
        i0 = steps.count_le(ra)  # D[i0]: the first step with decodes after a
        lengths = steps.count_le(fin[mine]) - i0  # gaps of each request
        keep = lengths > 0
        if not keep.all():
            ra, i0, lengths = ra[keep], i0[keep], lengths[keep]
        del keep, mine
        nd = self.num_decode_steps = len(steps)
        self.i0, self.lengths = i0, lengths
        # Per step with decodes j, how many regular requests decode in both D[j - 1] and D[j] (pairs): those
        # with i0 + 1 <= j, less those with i0 + length <= j.
        starts, ends = np.sort(i0 + 1), np.sort(i0 + lengths)
        if nd <= HELD_STEPS:
            # The end of each step with decodes, then each one's gap to the previous (in place, a piece at a time).
            per_step = np.empty(nd, dtype=np.float64)
            at = 0
            for c in range(0, len(dec), CHUNK):
                piece = end[c:c + CHUNK][dec[c:c + CHUNK] != 0]
                per_step[at:at + len(piece)] = piece
                at += len(piece)
            first_end = per_step[i0] if len(i0) else np.empty(0)
            for c in range(((nd - 1) // CHUNK) * CHUNK, 0, -CHUNK):  # from the back: each reads its left neighbour
                hi = min(c + CHUNK, nd)
                per_step[c:hi] -= per_step[c - 1:hi - 1]
            if nd:
                hi = min(CHUNK, nd)
                per_step[1:hi] -= per_step[0:hi - 1]
                per_step[0] = 0.0
            per_step *= 1e3  # in place: the same floats as gaps * 1e3
            self.per_step: Any = per_step
            weights = np.zeros(nd, dtype=np.int32 if len(i0) < 2**31 else np.int64)
            self.weights: Any = weights
            for c in range(1, nd, CHUNK):
                j = np.arange(c, min(c + CHUNK, nd))
                weights[c:c + CHUNK] = np.searchsorted(starts, j, side="right") - np.searchsorted(ends, j, side="right")
            del starts, ends
        else:
            self.per_step = self.weights = None
            # Step indices below 2**31 kept as C ints: 4 bytes a request each rather than 8.
            narrow = np.int32 if nd < 2**31 else np.int64
            starts, ends = starts.astype(narrow), ends.astype(narrow)
            self._end, self._steps, self._starts, self._ends = end, steps, starts, ends
            first_end = end[steps.step_of(i0)] if len(i0) else np.empty(0)
            self.i0, self.lengths = i0.astype(narrow), lengths.astype(narrow)
        self.first = (first_end - end[ra]) * 1e3
        del first_end, ra
        self.cum = np.cumsum(lengths)
        self.num_regular = int(self.cum[-1]) if len(self.cum) else 0
        parts = [np.empty(0)]
        for r in sorted(irregular):
            if res.finish_step[r] >= 0:
                parts.append(np.diff(np.asarray(res.token_times(r))))
        self.irregular = np.concatenate(parts) * 1e3
        self.n = self.num_regular + len(self.irregular)

    @property
    def num_pairs(self) -> int:
        """An upper bound on the (value, count) pairs pairs() yields: the first gaps, the steps with
        decodes and the irregular gaps."""
        return len(self.first) + self.num_decode_steps + len(self.irregular)

    def _per_step_at(self, j: Any) -> Any:
        """The per-step gaps, ms, of the steps with decodes j (an integer array): held, or made from the
        step ends (D[j]'s end minus D[j - 1]'s, times 1e3; 0.0 at j = 0)."""
        import numpy as np

        if self.per_step is not None:
            return self.per_step[j]
        steps, end = self._steps, self._end
        j = np.asarray(j, dtype=np.int64)
        at = steps.step_of(j)
        out = end[at] - end[steps.step_of(np.maximum(j - 1, 0))]
        out *= 1e3
        out[j == 0] = 0.0
        return out

    def _weights_of(self, lo: int, hi: int) -> Any:
        """The counts of requests decoding in both D[j - 1] and D[j], j in [lo, hi): held, or counted from
        the requests' sorted spans (how many start at or before each j, less how many ended; 0 at j = 0)."""
        import numpy as np

        if self.weights is not None:
            return self.weights[lo:hi]
        counts = np.zeros(hi - lo, dtype=np.int64)
        for bounds, sign in ((self._starts, 1), (self._ends, -1)):
            a, b = np.searchsorted(bounds, [lo, hi], side="left")
            before = a  # bounds < lo, so <= every j of the piece
            inside = np.bincount(bounds[a:b] - lo, minlength=hi - lo)
            counts += sign * (before + np.cumsum(inside))
        if lo == 0 and hi > 0:
            counts[0] = 0
        return counts

    def piece(self, lo: int, hi: int) -> Any:
        """Gaps [lo, hi) in latency_arrays' "itl" order: request j's first, then the per-step gaps of D[i0[j]
        + 1], D[i0[j] + 2], ... (its gaps between steps with decodes), the irregular ones last."""
        import numpy as np

        out = []
        nr = self.num_regular
        if lo < nr:
            h = min(hi, nr)
            cum, lengths = self.cum, self.lengths
            j0 = int(np.searchsorted(cum, lo, side="right"))
            j1 = int(np.searchsorted(cum, h - 1, side="right")) + 1
            ln = lengths[j0:j1]
            begin = cum[j0:j1] - ln  # index of each request's first gap
            # Gap index x of request j reads the per-step gap i0[j] + x - begin[j]; its first is replaced after.
            idx = np.repeat(self.i0[j0:j1] - begin, ln)[lo - int(begin[0]):h - int(begin[0])]
            idx += np.arange(lo, h, dtype=idx.dtype)
            gaps = self._per_step_at(idx)
            inside = begin >= lo
            gaps[begin[inside] - lo] = self.first[j0:j1][inside]
            out.append(gaps)
        if hi > nr:
            out.append(self.irregular[max(lo, nr) - nr:hi - nr])
        return out[0] if len(out) == 1 else np.concatenate(out)

    def pairs(self) -> Iterator[tuple[Any, Any]]:
        """(values, counts) in pieces: each request's first gap, once; the per-step gap of D[j], once per
        regular request with i0 < j < i0 + length (a request decoding in both D[j - 1] and D[j]), those with
        a count; the irregular gaps, once."""
        import numpy as np

        for c in range(0, len(self.first), CHUNK):
            first = self.first[c:c + CHUNK]
            yield first, np.ones(len(first), dtype=np.int64)
        nd = self.num_decode_steps
        for c in range(0, nd, CHUNK):
            hi = min(c + CHUNK, nd)
            w: Any = self._weights_of(c, hi)
            used = w > 0
            values = self.per_step[c:hi] if self.per_step is not None else self._per_step_at(np.arange(c, hi))
            yield values[used], w[used]
        yield self.irregular, np.ones(len(self.irregular), dtype=np.int64)


def select(ranks: Sequence[int], pairs: Callable[[], Iterator[tuple[Any, Any]]],
           num_pairs: int | None = None) -> dict[int, float]:
    """The rank-k smallest (0-based) of a multiset of float64 values for each k of `ranks`, the
    multiset given as (values, counts) pieces by pairs() (called once per pass). Up to SORT_PAIRS
    (value, count) pairs in all, they are sorted at once (a replica's pairs: one pass); beyond, a radix
    selection on the values' 64 bits in order-preserving form, 16 bits a pass (4 passes), in memory of
    a piece and 2**16 counts per rank. Exact either way: the result is one of the values. `num_pairs`,
    when given, is at least the number of pairs: beyond SORT_PAIRS, gathering them to sort is not tried
    (it would hold SORT_PAIRS of them before giving up)."""
    import numpy as np

    values, counts, held = [], [], 0
    sort = num_pairs is None or num_pairs <= SORT_PAIRS
    for v, c in pairs() if sort else ():
        held += len(v)
        if held > SORT_PAIRS:
            break
        values.append(np.asarray(v, dtype=np.float64))
        counts.append(np.asarray(c, dtype=np.int64))
    else:
        if not sort:
            return _radix_select(ranks, pairs)
        every = np.concatenate(values) if values else np.empty(0)
        order = np.argsort(every)  # the order of equal values changes no rank's value (and is deterministic)
        cum = np.cumsum(np.concatenate(counts)[order]) if counts else np.empty(0, dtype=np.int64)
        # The rank-k value is the first in sorted order whose cumulative count passes k.
        return {k: float(every[order[int(np.searchsorted(cum, k, side="right"))]]) for k in ranks}
    del values, counts
    return _radix_select(ranks, pairs)


def _radix_select(ranks: Sequence[int], pairs: Callable[[], Iterator[tuple[Any, Any]]]) -> dict[int, float]:
    """select's radix selection (four passes of 16 bits over the pairs)."""
    import numpy as np

    top = np.uint64(1 << 63)
    prefix = {k: 0 for k in ranks}
    left = {k: k for k in ranks}  # rank within the values sharing the prefix
    for level in range(4):
        shift = np.uint64(48 - 16 * level)
        # Ranks that share the bits chosen so far share the histogram of the next 16.
        hist = {p: np.zeros(1 << 16) for p in set(prefix.values())}
        for values, counts in pairs():
            if not len(values):
                continue
            bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
            keys = np.where(bits >= top, ~bits, bits | top)  # ascending with the values
            buckets = (keys >> shift) & np.uint64(0xFFFF)
            w = np.asarray(counts, dtype=np.float64)
            if not level:
                hist[0] += np.bincount(buckets.astype(np.int64), weights=w, minlength=1 << 16)
                continue
            high = keys >> np.uint64(64 - 16 * level)
            for p, h in hist.items():
                sel = high == np.uint64(p)
                h += np.bincount(buckets[sel].astype(np.int64), weights=w[sel], minlength=1 << 16)
        cums = {p: np.cumsum(h) for p, h in hist.items()}  # integer counts, exact in float64 below 2**53
        for k in ranks:
            below = cums[prefix[k]]
            b = int(np.searchsorted(below, left[k], side="right"))
            left[k] -= int(below[b - 1]) if b else 0
            prefix[k] = (prefix[k] << 16) | b
    out = {}
    for k in ranks:
        key = np.array([prefix[k]], dtype=np.uint64)
        bits = key ^ top if key[0] >= top else ~key
        out[k] = float(bits.view(np.float64)[0])
    return out


def median(n: int, piece: Callable[[int, int], Any]) -> float:
    """np.median of a float64 array of `n` >= 1 values (no NaN), the values [lo, hi) given by piece(lo, hi)
    as a numpy array: the middle value, or the mean of the two middle ones ((a + b) / 2, as numpy's
    mean of two), each found by `select` over pieces of at most CHUNK values, so that the array is never
    held whole. Exact: bit for bit numpy's.

    Raises:
        ValueError: n < 1.
    """
    import numpy as np

    if n < 1:
        raise ValueError(f"the median of no values: n must be >= 1, got {n!r}")

    def pairs() -> Iterator[tuple[Any, Any]]:
        for lo in range(0, n, CHUNK):
            values = piece(lo, min(lo + CHUNK, n))
            yield values, np.ones(len(values), dtype=np.int64)

    if n % 2:
        return select([(n - 1) // 2], pairs, n)[(n - 1) // 2]
    kth = select([n // 2 - 1, n // 2], pairs, n)
    return (kth[n // 2 - 1] + kth[n // 2]) / 2


def step_numbers(values: Sequence[int]) -> Any:
    """A result's per-request step numbers (admit_step, first_step, finish_step) as a numpy integer
    array: an array.array's in its own type, without a copy (a cluster's are C ints), any other sequence
    as int64."""
    from array import array

    import numpy as np

    return np.asarray(values) if isinstance(values, array) else np.asarray(values, dtype=np.int64)


def step_starts(res: SimResult, steps: Any) -> Any:
    """The start times, s, of the steps `steps` (a numpy integer array, entries in [0, num_steps)) of
    `res`, as a numpy float64 array: read from step_start, whether an array or a StepStarts (its
    exceptions, else the previous step's end), the same values either way."""
    import numpy as np

    st = res.step_start
    if not isinstance(st, StepStarts):
        return np.frombuffer(st, dtype=np.float64)[steps]
    end = np.frombuffer(res.step_end, dtype=np.float64)
    at, value = np.asarray(st.at, dtype=np.int64), np.asarray(st.value, dtype=np.float64)
    steps = np.asarray(steps, dtype=np.int64)
    out = end[np.maximum(steps - 1, 0)]
    pos = np.searchsorted(at, steps, side="right") - 1
    own = pos >= 0
    own[own] = at[pos[own]] == steps[own]
    out[own] = value[pos[own]]
    return out


def step_durations(res: SimResult) -> Callable[[int, int], Any]:
    """piece(lo, hi): the durations of steps [lo, hi) of `res`, s (step_end - step_start, numpy float64),
    for pairwise_sum and median: a run's durations without an array of all of them."""
    import numpy as np

    end = np.frombuffer(res.step_end, dtype=np.float64)
    if not isinstance(res.step_start, StepStarts):
        start = np.frombuffer(res.step_start, dtype=np.float64)

        def piece(lo: int, hi: int) -> Any:
            return end[lo:hi] - start[lo:hi]

        return piece

    st = res.step_start
    at, value = np.asarray(st.at, dtype=np.int64), np.asarray(st.value, dtype=np.float64)

    def piece_of_starts(lo: int, hi: int) -> Any:
        # Each start is the previous end, but for the exceptions in [lo, hi) (the first step is one).
        start = np.empty(hi - lo, dtype=np.float64)
        if hi > lo:
            start[1:] = end[lo:hi - 1]
            start[0] = end[lo - 1] if lo > 0 else math.nan
        a, b = np.searchsorted(at, [lo, hi], side="left")
        start[at[a:b] - lo] = value[a:b]
        return end[lo:hi] - start

    return piece_of_starts


def itl_stats(res: SimResult, done: Any, percentiles: Sequence[float]) -> dict[str, float | None]:
    """The "itl" figures of summarize_result (mean_itl_ms, median_itl_ms, std_itl_ms, p{q}_itl_ms)
    of `res`, whose finished requests (latency_arrays' "rids") are `done`: what
    report._stats("itl", latency_arrays(res)["itl"], percentiles) gives, bit for bit (module
    docstring), without that array."""
    keys = ["mean_itl_ms", "median_itl_ms", "std_itl_ms"] + [f"p{q:g}_itl_ms" for q in percentiles]
    out = _figures(_Gaps(res, done), keys, percentiles)
    give_back()  # the pieces' memory, freed in the middle of the heap
    return out


def _figures(g: _Gaps, keys: list[str], percentiles: Sequence[float]) -> dict[str, float | None]:
    n = g.n
    if n == 0:
        return dict.fromkeys(keys, None)
    if n <= WHOLE_GAPS:  # the gaps as one array, summed by numpy itself (what pairwise_sum follows)
        import numpy as np

        every = g.piece(0, n)
        mean = float(np.add.reduce(every)) / n
        every -= mean
        every *= every
        std = math.sqrt(float(np.add.reduce(every)) / n)
        del every
    else:
        mean = pairwise_sum(n, g.piece) / n

        def squares(lo: int, hi: int) -> Any:
            x = g.piece(lo, hi) - mean
            return x * x

        std = math.sqrt(pairwise_sum(n, squares) / n)
    # The ranks the median and the percentiles read, then those values (in ms, as numpy sees them).
    needed: set[int] = set()

    def note(k: int) -> float:
        needed.add(k)
        return 0.0

    for q in percentiles:
        percentile(n, float(q), note)
    needed.update({(n - 1) // 2, n // 2} if n % 2 == 0 else {(n - 1) // 2})
    # Gaps made piece by piece (a large run): the radix selection at once, holding no pairs to sort.
    kth = select(sorted(needed), g.pairs, g.num_pairs if g.per_step is None else None).__getitem__
    median = kth((n - 1) // 2) if n % 2 else (kth(n // 2 - 1) + kth(n // 2)) / 2
    out: dict[str, float | None] = {keys[0]: mean, keys[1]: median, keys[2]: std}
    for q in percentiles:
        out[f"p{q:g}_itl_ms"] = percentile(n, float(q), kth)
    return out
