"""The decode attention of a step priced between knots, kept across a run of steps (DecodeRuns).

A scheduler hands out one tuple of decode offsets (StepPlan.decode_offsets) for as long as its set of
decodes does not change, every decode one token further along each step; only a decode crossing a
knot changes which knot interval it falls in. So the partition of the decodes over the knot intervals
(how many in each, the sum of their offsets) is worked out once per tuple, with its knot prices, and
reused for every later step until a decode crosses a knot: a step then costs one short loop over the
intervals the decodes occupy (a handful) instead of a pass over the decodes and two dictionary reads per
interval. The scheduler keeps its decodes' offsets sorted through joins and leaves
(StepPlan.decode_offsets_sorted), so a new tuple costs no sort; the partition is then kept from its first
step (without them, from its second: a sort per tuple already, and many tuples last one step).

The sum is the one of kernels.KernelCostModel.decode_attention_s, term by term in the same order and
with the same integer and float operations, so both give the same float, bit for bit (the tests check
it over scheduler runs). No price is approximated: the cache only remembers work.

Imports allowed: the standard library only.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable

from stallfree.core._mypyc import mypyc_attr

__all__ = ["DecodeRuns"]

_NEVER = 1 << 61  # a shift no run reaches (and a compiled build's small int): the partition of one interval
# ending at the last knot


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class DecodeRuns:
    """The decode attention sum of one cost model's steps, cached for the last tuple of decode offsets.

    Owns the cache of the last tuple priced (compared by identity): its sorted offsets (the caller's where
    it has them, else sorted here) and its partition over the knot intervals, valid for a range of shifts
    at one batch size; touches nothing else. One tuple only, as the unbucketed path's sorted offsets: kept
    partitions of tuples the scheduler no longer uses cost more in memory traffic than they save
    (benchmarks/priced_step.py). A cluster's replicas each bind their own view of a shared kernel model, so
    each has one of these (KernelCostModel.bind_replica). Not thread-safe: one per cost model (or replica's
    view), as its other price caches.

    Args:
        knots: the increasing knot positions, tokens (kernels.KNOTS), starting at 0.
        prices: the cost model's cache of decode(nb, knots[k]), seconds, keyed nb x key_stride + k
            (read here; filled by `knot` on a miss).
        key_stride: see `prices` (more than the number of knots).
    """

    __slots__ = ("_knots", "_prices", "_stride", "_offs", "_nb", "_first", "_until", "_terms", "_sorted")

    def __init__(self, knots: tuple[int, ...], prices: dict[int, float], key_stride: int) -> None:
        self._knots, self._prices, self._stride = knots, prices, key_stride
        self.clear()

    def clear(self) -> None:
        """Forget the cached tuple and partition (the next call works them out afresh)."""
        # The tuple priced last (compared by identity), the batch size its partition holds for (-1: none
        # yet, a tuple seen once), the shifts it holds for (first <= shift < until), a term per occupied
        # interval: (n x lo, n, sum of offsets - n x knot, hi - lo, interval width), and its sorted offsets.
        self._offs: tuple[int, ...] | None = None
        self._nb = -1
        self._first = 0
        self._until = 0
        self._terms: tuple[tuple[float, int, int, float, int], ...] = ()
        self._sorted: tuple[int, ...] = ()

    def total(
        self, offs: tuple[int, ...], shift: int, nb: int, knot: Callable[[int, int], float],
        ordered: tuple[int, ...] | None = None,
    ) -> float:
        """Return sum_i f(offs[i] + shift), f(s) = decode(nb, s) linear between the knots, seconds.

        A new tuple's partition is worked out and kept on its first step when `ordered` comes with it,
        else on its second (its first sorted and summed as it comes); later steps read it.

        Args:
            offs: the decode offsets of a plan (StepPlan.decode_offsets; compared by identity), at
                least one, each >= -shift.
            shift: added to every offset to give its keys, tokens (the plan's step + 1).
            nb: the decode batch the attention kernels see (one rank's with data-parallel attention).
            knot: knot(nb, k) -> seconds, decode(nb, knots[k]), filling `prices` on a miss.
            ordered: `offs` in increasing order where the caller has them (StepPlan.decode_offsets_sorted),
                else None (sorted here when the tuple is new).

        Returns:
            The sum over the decodes, seconds (the caller divides by the decodes: each one's share).
        """
        if self._offs is offs:
            if self._nb == nb and self._first <= shift < self._until:
                t = 0.0
                for nlo, n, c, dhl, width in self._terms:
                    t += nlo + (c + n * shift) * dhl / width
                return t
            return self._walk(shift, nb, knot, True)
        self._offs, self._nb, self._first, self._until, self._terms = offs, -1, 0, 0, ()
        if ordered is None:
            self._sorted = tuple(sorted(offs))
            return self._walk(shift, nb, knot, False)
        self._sorted = ordered
        return self._walk(shift, nb, knot, True)

    def _walk(self, shift: int, nb: int, knot: Callable[[int, int], float], keep: bool) -> float:
        """Sum the kept tuple's decodes at `shift` interval by interval; with `keep`, keep the partition with
        the shifts it holds for. One pass over the sorted offsets: each interval's decodes are the run of
        offsets below its upper knot (what a bisection would find), summed as they are passed."""
        ordered = self._sorted
        knots, prices = self._knots, self._prices
        nd = len(ordered)
        k = bisect_right(knots, ordered[0] + shift) - 1
        last = bisect_right(knots, ordered[-1] + shift) - 1
        base = nb * self._stride
        terms: list[tuple[float, int, int, float, int]] = []
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
            bound = nxt - shift if k < last else ordered[-1] + 1  # the last interval takes the rest
            j, offsets = i, 0
            while j < nd and ordered[j] < bound:
                offsets += ordered[j]
                j += 1
            if j > i:
                n = j - i
                # keys - n x at = (sum of offsets - n x at) + n x shift: integers, so exact either way.
                nlo, c, dhl, width = n * lo, offsets - n * at, hi - lo, nxt - at
                total += nlo + (c + n * shift) * dhl / width
                if keep:
                    terms.append((nlo, n, c, dhl, width))
                    # The interval keeps its decodes while its largest stays below the next knot.
                    if nxt - ordered[j - 1] < until:
                        until = nxt - ordered[j - 1]
            if k >= last:
                break
            i, k, lo = j, k + 1, hi
        if keep:
            self._nb, self._first, self._until, self._terms = nb, shift, until, tuple(terms)
        return total
