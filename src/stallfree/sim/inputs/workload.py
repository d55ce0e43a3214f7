"""Workloads for the simulator: real request traces (Azure LLM 2023, BurstGPT, generic CSV/JSONL),
synthetic arrivals (Poisson, Gamma) with length distributions, a shared-prefix synthetic workload, and
rate/window/head/take transforms.

Imports allowed: the standard library only.

Why one module of over 400 lines: the trace readers and the synthetic generator share the row
checks (_int_field, _float_field) and build the same Workload value, and synthetic lengths may be
drawn from a trace ("trace:PATH"); split apart, each half would import the other's internals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from stallfree.core.errors import StallfreeError

__all__ = [
    "TraceError",
    "TraceFileError",
    "Workload",
    "not_json_error",
]

#: Tokens per block of a Mooncake trace's hash_ids.
MOONCAKE_BLOCK = 512


#: How far an arrival time may lie from the trace's first one (in file order), s: 10^8 s, about 3.2
#: years. The longest public LLM traces span weeks to a few months (10^6-10^7 s); a time further out
#: is a typo or a unit error (ms or us read as s), and 1e308 would leave the simulated clock unable to
#: tell a step apart (it stands still past 2^53 s), giving figures such as a TTFT of 6 ms and a TPOT of
#: 0 that enter the averages. Within it, times relative to the start resolve to 15 ns.
MAX_ARRIVAL_SPAN_S = 1e8
#: The largest arrival time a trace may state at all, s: 10^12 s (about 31,700 years since its
#: epoch), which holds Unix times and Azure's wall clock (seconds since year 1, about 6.4e10) while
#: keeping their differences resolved to 0.1 ms or better.
MAX_ARRIVAL_S = 1e12


class TraceError(StallfreeError, ValueError):
    """A trace could not be read: a missing file, an unknown format, or a malformed row (the message
    starts with `path:line:` and names the field and the value)."""


class TraceFileError(TraceError):
    """The trace file itself is missing, a directory, or cannot be opened (the commands exit 2, as for
    any unusable command-line value, and as for a TraceError)."""


def not_json_error(path: str, first_line: str, fmt: str, fields: str) -> TraceError:
    """The error for a JSONL trace whose very first line is not JSON: the wrong format, not a bad row (so
    --skip-bad-rows does not skip the whole file line by line). `fields`: what each line holds."""
    return TraceError(f"{path}:1: not a {fmt} trace (one JSON object per line with {fields}); the first line is "
                      f"{first_line.strip()[:80]!r}" + ("; for a CSV use `trace_format`='csv' or auto"
                                                        if "," in first_line else ""))


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests to replay: per request an arrival time and its prompt and output lengths.

    Requests are in file order (stable-sorted by arrival); equal arrivals keep that order, which is
    the order the simulator adds them in.

    Attributes:
        arrivals: arrival time of each request, s, non-decreasing (traces start at 0).
        prompt_lens: prompt length of each request, tokens (>= 1).
        output_lens: tokens each request really generates (>= 1) before it stops by itself.
        name: a label for reports.
        skipped_rows: malformed rows skipped while loading (with skip_bad_rows).
        notes: lines for the report (what was skipped or excluded, and why).
        prefix_ids: None, or per request the ids of its prompt's blocks of `prefix_block` tokens
            (ceil(prompt_len / prefix_block) of them, the last one covering a partial block), equal
            ids meaning equal prefixes up to and including that block (Mooncake's hash_ids).
        prefix_block: tokens per block of prefix_ids.
        loras: None, or per request the name of its LoRA adapter (None: the base model); a trace's
            `lora` column or field (empty: the base model), or drawn (stallfree.sim.run.lora.assign_loras).
        tenants: None (no tenant column: every request the tenant "default"), or per request the
            client it is served for, None for "default" (a `tenant` CSV column or JSONL field; an
            empty value is "default"); read by SchedulerConfig(fairness="vtc") and `by_tenant`.

    Raises:
        ValueError: the three sequences differ in length, or a length is < 1.
    """

    arrivals: Sequence[float]
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    name: str = "workload"
    skipped_rows: int = 0
    notes: tuple[str, ...] = field(default=())
    prefix_ids: tuple[tuple[int, ...], ...] | None = None
    prefix_block: int = MOONCAKE_BLOCK
    loras: tuple[str | None, ...] | None = None
    tenants: tuple[str | None, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if self.tenants is not None and len(self.tenants) != n:
            raise ValueError(f"workload {self.name!r}: {n} arrivals, {len(self.tenants)} tenants")
        if self.loras is not None and len(self.loras) != n:
            raise ValueError(f"workload {self.name!r}: {n} arrivals, {len(self.loras)} loras")
        if len(self.prompt_lens) != n or len(self.output_lens) != n:
            raise ValueError(
                f"workload {self.name!r}: {n} arrivals, {len(self.prompt_lens)} prompt_lens, "
                f"{len(self.output_lens)} output_lens"
            )
        if n and (min(self.prompt_lens) < 1 or min(self.output_lens) < 1):
            raise ValueError(f"workload {self.name!r}: every prompt_len and output_len must be >= 1")

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        """Time from the first to the last arrival, s (0 for fewer than 2 requests)."""
        return self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0

    @property
    def mean_rate(self) -> float:
        """Arrivals per second over the workload's span (inf when all arrive at once)."""
        d = self.duration
        return (len(self) - 1) / d if d > 0 else math.inf

    def scale_rate(self, factor: float) -> Workload:
        """Replay `factor` times faster: every arrival time divided by factor (> 0).

        Raises:
            ValueError: factor is not a finite number > 0.
        """
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"rate scale must be a finite number > 0, got {factor!r}")
        if factor == 1:
            return self
        return replace(self, arrivals=tuple(t / factor for t in self.arrivals))

    def window(self, start: float = 0.0, end: float = math.inf) -> Workload:
        """The requests arriving in [start, end) s, with times shifted so that `start` is 0.

        Raises:
            ValueError: end <= start or start < 0.
        """
        if start < 0 or end <= start:
            raise ValueError(f"time window needs 0 <= start < end, got start={start!r}, end={end!r}")
        idx = [i for i, t in enumerate(self.arrivals) if start <= t < end]
        return self._select(idx, shift=start)

    def head(self, n: int) -> Workload:
        """The first n requests (all of them when n >= len).

        Raises:
            ValueError: n < 1.
        """
        if n < 1:
            raise ValueError(f"number of requests must be >= 1, got {n!r}")
        return self._select(range(min(n, len(self))), shift=0.0)

    def take(self, idx: Sequence[int]) -> Workload:
        """The requests at positions `idx`, in that order (a position may repeat), each with every
        per-request field (prefix ids, LoRA adapter, tenant) and its arrival time as it is.

        Always a plain Workload: a SessionWorkload's turns become single requests, each with its whole
        prompt (the session's history included) and no session to follow it.

        Raises:
            IndexError: a position outside the workload.
        """
        ids = self.prefix_ids
        return Workload(
            arrivals=tuple(self.arrivals[i] for i in idx),
            prompt_lens=tuple(self.prompt_lens[i] for i in idx),
            output_lens=tuple(self.output_lens[i] for i in idx),
            name=self.name,
            skipped_rows=self.skipped_rows,
            notes=self.notes,
            prefix_ids=tuple(ids[i] for i in idx) if ids is not None else None,
            prefix_block=self.prefix_block,
            loras=tuple(self.loras[i] for i in idx) if self.loras is not None else None,
            tenants=tuple(self.tenants[i] for i in idx) if self.tenants is not None else None,
        )

    def _select(self, idx: range | list[int], shift: float) -> Workload:
        ids = self.prefix_ids
        return replace(
            self,
            arrivals=tuple(self.arrivals[i] - shift for i in idx),
            prompt_lens=tuple(self.prompt_lens[i] for i in idx),
            output_lens=tuple(self.output_lens[i] for i in idx),
            prefix_ids=tuple(ids[i] for i in idx) if ids is not None else None,
            loras=tuple(self.loras[i] for i in idx) if self.loras is not None else None,
            tenants=tuple(self.tenants[i] for i in idx) if self.tenants is not None else None,
        )

    def tenant(self, i: int) -> str | None:
        """Request i's tenant (None: "default")."""
        return self.tenants[i] if self.tenants is not None else None

    def block_hashes(self, i: int, block_size: int) -> tuple[tuple[int, int], ...] | None:
        """Request i's prompt as a scheduler's block hashes (prompt_len // block_size of them), or None
        when the workload has no prefix ids.

        Scheduler block j covers tokens [j*B, (j+1)*B), inside trace block j*B // prefix_block; its hash
        is (that trace block's id, j's position inside it), so two requests share scheduler block j
        exactly when they share the trace block that holds it. A prompt's last, partial trace block
        keeps its id: the full scheduler blocks inside it are shared only with requests that have the
        same id there; its tokens past the last full scheduler block are never cached.

        Raises:
            ValueError: block_size does not divide prefix_block.
        """
        ids = self.prefix_ids
        if ids is None:
            return None
        per = check_block_size(block_size, self.prefix_block)
        row = ids[i]
        return tuple((row[j // per], j % per) for j in range(self.prompt_lens[i] // block_size))

    def prefix_hit_bound(self, block_size: int) -> float | None:
        """The prefix cache hit rate an infinite cache would reach on this workload: hit prompt tokens /
        prompt tokens, each request hitting the longest prefix of its blocks seen in any earlier
        request (capped at prompt_len - 1 tokens, as the scheduler computes the last token), computed
        from the trace alone. None without prefix ids.

        Raises:
            ValueError: block_size does not divide prefix_block.
        """
        if self.prefix_ids is None:
            return None
        seen: set[tuple[int, int]] = set()
        hits = total = 0
        for i, plen in enumerate(self.prompt_lens):
            hashes = self.block_hashes(i, block_size) or ()
            h = 0
            cap = min(len(hashes), (plen - 1) // block_size)
            while h < cap and hashes[h] in seen:
                h += 1
            hits += h * block_size
            total += plen
            seen.update(hashes)
        return hits / total if total else 0.0


def check_block_size(block_size: int, prefix_block: int = MOONCAKE_BLOCK) -> int:
    """Return prefix_block // block_size when block_size (an integer >= 1) divides prefix_block.

    Raises:
        ValueError: otherwise; the message names both numbers.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or prefix_block % block_size:
        raise ValueError(
            f"block_size {block_size!r} must divide the trace's prefix block of {prefix_block} tokens "
            f"(1, 2, 4, ..., {prefix_block} for a power of two)"
        )
    return prefix_block // block_size


# ---------------------------------------------------------------------------------- traces


# ------------------------------------------------------------------------------- synthetic


