"""A kernel model's step price read from its caches (KernelStepPrices): the step cache's path of
kernels.KernelCostModel.step_time, in a module of its own so that the compiled build compiles it (setup.py's
NATIVE_MODULES; the kernel model itself reads the package's tables and stays pure Python).

The composition is the kernel model's (kernels.py's module docstring): the decodes' attention from their
runs (decode_runs.DecodeRuns), each prefill chunk's attention linear between the offset knots, shared(T)
and logits(S) from their caches; a miss asks the kernel model, which fills its cache. Term by term in the
same order with the same operations as the kernel model's own methods, so the price is the same float, bit
for bit (tests/costmodel/test_step_cache.py checks it against the unbucketed path over scheduler runs).

Imports allowed: the standard library, stallfree.core and stallfree.costmodel.decode_runs.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.plan import StepPlan
from stallfree.costmodel.decode_runs import DecodeRuns

__all__ = ["KernelStepPrices"]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class KernelStepPrices:
    """The step price of one kernel model (or one replica's view of it) from its price caches.

    Owns nothing but its references: the caches are the kernel model's dictionaries (read here, filled
    by the model's methods on a miss) and the decode runs its view's own. One attention rank only: with
    data-parallel attention (D > 1) the kernel model prices the step itself.

    Args:
        runs: the view's decode attention cache (decode_runs.DecodeRuns).
        knots: kernels.KNOTS, tokens, increasing from 0.
        key_stride: kernels._KEY: a cached chunk price is keyed num_tokens x key_stride + knot index.
        chunk_c: the model's chunk(c, knot) prices, seconds.
        decode_only_c: shared(T) of a decode-only step by T, seconds.
        shared_c: shared(T) by T, seconds.
        logits_c: logits(S) by S, seconds.
        chunk_exact: chunk_exact_s(num_tokens, start) -> seconds (a knot's price on a miss).
        decode_knot: decode(nb, knots[k]) -> seconds, filling the model's cache (DecodeRuns' `knot`).
        decode_shared: decode_shared_s(T) -> seconds, filling decode_only_c.
        shared: shared_s(T) -> seconds, filling shared_c.
        logits: logits_s(S) -> seconds, filling logits_c.
    """

    def __init__(
        self, runs: DecodeRuns, knots: tuple[int, ...], key_stride: int, chunk_c: dict[int, float],
        decode_only_c: dict[int, float], shared_c: dict[int, float], logits_c: dict[int, float],
        chunk_exact: Callable[[int, int], float], decode_knot: Callable[[int, int], float],
        decode_shared: Callable[[int], float], shared: Callable[[int], float], logits: Callable[[int], float],
    ) -> None:
        self._runs, self._knots, self._stride = runs, knots, key_stride
        self._chunk_c, self._decode_only_c, self._shared_c, self._logits_c = chunk_c, decode_only_c, shared_c, logits_c
        self._chunk_exact, self._decode_knot = chunk_exact, decode_knot
        self._decode_shared, self._shared, self._logits = decode_shared, shared, logits

    def _chunk_knot(self, num_tokens: int, k: int) -> float:
        key = num_tokens * self._stride + k
        t = self._chunk_c.get(key)
        if t is None:
            t = self._chunk_c[key] = self._chunk_exact(num_tokens, self._knots[k])
        return t

    def chunk_s(self, num_tokens: int, start: int) -> float:
        """Return chunk(c, p), seconds: linear between the offset knots around `start` (KernelCostModel.chunk_s)."""
        knots = self._knots
        k = bisect_right(knots, start) - 1
        lo = self._chunk_knot(num_tokens, k)
        rem = start - knots[k]
        if not rem:
            return lo
        return lo + (self._chunk_knot(num_tokens, k + 1) - lo) * rem / (knots[k + 1] - knots[k])

    def step_time(self, plan: StepPlan) -> float:
        """Return the time of one step of `plan`, seconds (0.0 for an empty plan): KernelCostModel.step_time
        with its step cache and one attention rank."""
        tokens = plan.num_tokens
        if tokens <= 0:
            return 0.0
        nd = plan.num_decodes
        t = self._runs.total(plan.decode_offsets, plan.step + 1, nd, self._decode_knot,
                             plan.decode_offsets_sorted) / nd if nd else 0.0
        prefills = plan.prefills
        if not prefills:
            shared = self._decode_only_c.get(tokens)
            if shared is None:
                shared = self._decode_shared(tokens)
            logits = self._logits_c.get(nd)
            if logits is None:
                logits = self._logits(nd)
            return t + shared + logits
        sampled = nd
        for c in prefills:
            t += self.chunk_s(c.num_tokens, c.start)
            if c.is_last:
                sampled += 1
        shared = self._shared_c.get(tokens)
        if shared is None:
            shared = self._shared(tokens)
        logits = self._logits_c.get(sampled) if sampled > 0 else 0.0
        if logits is None:
            logits = self._logits(sampled)
        return t + shared + logits

    def plain_decode_times(self, offsets: tuple[int, ...], step: int, count: int) -> list[float]:
        """Return the time of each of `count` decode-only steps, seconds, the first numbered `step`, of the
        decodes at StepPlan offsets `offsets` (at least one), one token each (KernelCostModel.plain_decode_times)."""
        nd = len(offsets)
        shared, logits = self._decode_shared(nd), self._logits(nd)
        total, knot = self._runs.total, self._decode_knot
        return [total(offsets, s + 1, nd, knot) / nd + shared + logits for s in range(step, step + count)]
