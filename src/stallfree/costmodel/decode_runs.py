"""The decode attention of a step priced between knots, kept across a run of steps (DecodeRuns).

A scheduler hands out one tuple of decode offsets (StepPlan.decode_offsets) for as long as its set of
decodes does not change, every decode one token further along each step; only a decode crossing a
knot changes which knot interval it falls in. So the partition of the decodes over the knot intervals
(how many in each, the sum of their offsets) is worked out once per tuple, with its knot prices, and
reused for every later step until a decode crosses a knot: a step then costs one short loop over the
intervals the decodes occupy (a handful) instead of a sort of B offsets and a bisection per interval.

The sum is the one of kernels.KernelCostModel.decode_attention_s, term by term in the same order and
with the same integer and float operations, so both give the same float, bit for bit (the tests check
it over scheduler runs). No price is approximated: the cache only remembers work.

Imports allowed: the standard library only.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable

__all__ = ["DecodeRuns"]

_NEVER = 1 << 62  # a shift no run reaches: the partition of one interval ending at the last knot

#: Tuples of decode offsets kept at once: one per replica of a cluster sharing the cost model, with room.
MAX_RUNS = 512


class DecodeRuns:
    """The decode attention sum of one cost model's steps, cached per tuple of decode offsets.

    Owns the cache of the last MAX_RUNS tuples priced, keyed by the tuple's identity (a cluster's
    replicas share one cost model, each with its own tuple): each one's partition over the knot
    intervals, valid for a range of shifts at one batch size; touches nothing else. Not thread-safe:
    one per cost model, as its other price caches.

    Args:
        knots: the increasing knot positions, tokens (kernels.KNOTS), starting at 0.
        prices: the cost model's cache of decode(nb, knots[k]), seconds, keyed nb x key_stride + k
            (read here; filled by `knot` on a miss).
        key_stride: see `prices` (more than the number of knots).
    """

    __slots__ = ("_knots", "_prices", "_stride", "_runs")

    def __init__(self, knots: tuple[int, ...], prices: dict[int, float], key_stride: int) -> None:
        self._knots, self._prices, self._stride = knots, prices, key_stride
        # id(offs) -> (offs, nb, first shift, shift it holds below, terms); `offs` is held so that its id
        # names it while kept. A term per occupied interval: (n x lo, n, sum of offsets - n x knot, hi - lo,
        # interval width).
        self._runs: dict[int, tuple[tuple[int, ...], int, int, int, tuple[tuple[float, int, int, float, int], ...]]]
        self._runs = {}

    def clear(self) -> None:
        """Forget every cached partition (the next calls work them out afresh)."""
        self._runs.clear()

    def total(self, offs: tuple[int, ...], shift: int, nb: int, knot: Callable[[int, int], float]) -> float:
        """Return sum_i f(offs[i] + shift), f(s) = decode(nb, s) linear between the knots, seconds.

        Args:
            offs: the decode offsets of a plan (StepPlan.decode_offsets; compared by identity), at
                least one, each >= -shift.
            shift: added to every offset to give its keys, tokens (the plan's step + 1).
            nb: the decode batch the attention kernels see (one rank's with data-parallel attention).
            knot: knot(nb, k) -> seconds, decode(nb, knots[k]), filling `prices` on a miss.

        Returns:
            The sum over the decodes, seconds (the caller divides by the decodes: each one's share).
        """
        run = self._runs.get(id(offs))
        if run is not None and run[0] is offs and run[1] == nb and run[2] <= shift < run[3]:
            t = 0.0
            for nlo, n, c, dhl, width in run[4]:
                t += nlo + (c + n * shift) * dhl / width
            return t
        return self._partition(offs, shift, nb, knot)

    def _partition(self, offs: tuple[int, ...], shift: int, nb: int, knot: Callable[[int, int], float]) -> float:
        """Work out the partition of `offs` at `shift`, keep it with the shifts it holds for, return the sum."""
        ordered = sorted(offs)
        knots, prices = self._knots, self._prices
        nd = len(ordered)
        k = bisect_right(knots, ordered[0] + shift) - 1
        last = bisect_right(knots, ordered[-1] + shift) - 1
        base = nb * self._stride
        terms = []
        add = terms.append
        total, i, until = 0.0, 0, _NEVER
        lo = prices.get(base + k)
        if lo is None:
            lo = knot(nb, k)
        nxt = knots[k]
        while True:
            at, nxt = nxt, knots[k + 1]
            hi = prices.get(base + k + 1)
            if hi is None:
                hi = knot(nb, k + 1)
            j = nd if k == last else bisect_left(ordered, nxt - shift, i)
            if j > i:
                n = j - i
                # keys - n x at = (sum of offsets - n x at) + n x shift: integers, so exact either way.
                nlo, c, dhl, width = n * lo, sum(ordered[i:j]) - n * at, hi - lo, nxt - at
                total += nlo + (c + n * shift) * dhl / width
                add((nlo, n, c, dhl, width))
                # The interval keeps its decodes while its largest stays below the next knot.
                if nxt - ordered[j - 1] < until:
                    until = nxt - ordered[j - 1]
            if k >= last:
                break
            i, k, lo = j, k + 1, hi
        runs = self._runs
        if len(runs) >= MAX_RUNS:
            runs.clear()  # all at once: dropping the oldest one by one makes each next drop scan the freed slots
        runs[id(offs)] = (offs, nb, shift, until, tuple(terms))
        return total
