"""The plan of one step (StepPlan) and its entries (ScheduledChunk): the only thing a scheduler emits.

Imports allowed: the standard library only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple, overload

__all__ = ["ScheduledChunk", "StepPlan"]


class ScheduledChunk(NamedTuple):
    """One entry of a step's flat batch (immutable).

    A named tuple rather than a frozen dataclass: a plan makes one per decode when it is read, and a
    tuple is built about four times faster (benchmarks/bench_plan_read.py); fields are read by name.

    Attributes:
        rid: the request.
        num_tokens: tokens this entry puts in the batch (1 for a plain decode; a chunk's length).
        is_prefill: True for a prompt chunk (or a recompute chunk after preemption), False for a decode.
        start: tokens of this request already in the KV cache before this entry, i.e. the position
            of its first token here; the entry attends to start + num_tokens keys.
        is_last: True when this entry samples a token: every decode, and the last chunk of a prefill.
    """

    rid: Hashable
    num_tokens: int
    is_prefill: bool
    start: int
    is_last: bool


class StepPlan(Sequence[ScheduledChunk]):
    """What one forward pass holds: decodes first (oldest admitted first), then prefill chunks
    (the partial prefill, then admissions), in flat-batch order.

    The decodes are kept compactly, as tuples shared with the scheduler and reused across steps while
    the set of decodes does not change; ScheduledChunk objects for them are made only when the plan
    is iterated or indexed, so building or pricing a plan costs no Python object per running request.

    Compact reading (the engine's fast path, no object per decode): `decode_rids`, `decode_starts`
    (or `decode_offsets`, shared across steps, start = offset + step) and `decode_tokens` are plain
    tuples aligned in batch order; `num_decodes` and `decode_context_sum` are
    their count and the sum of the starts.

    Attributes:
        step: the step number (from 0).
        decode_rids: the decoding requests, in batch order.
        prefills: the prefill chunks, in batch order.
        num_tokens: tokens in the batch (at most the step's token budget).
        num_decodes: len(decode_rids).
        decode_context_sum: sum over the decodes of their `start` (tokens already in KV), in tokens;
            a decode attends to start + its tokens keys.
        token_budget: the budget this step was planned under, in tokens.
        admitted: rids admitted this step (their first chunk is in `prefills`).
        preempted: rids preempted this step (paged scheduler only; they are not in the batch).
        kv_offloads: KV blocks copied from the GPU to the CPU tier before this step runs, as
            (gpu_block, cpu_block) pairs: cached blocks the step evicts from the GPU, whose GPU
            blocks the step overwrites (stallfree.core.kv_tier.TieredKV; () without a CPU tier).
        kv_loads: KV blocks copied from the CPU tier into GPU blocks before this step runs, after
            the offloads, as (cpu_block, gpu_block) pairs: the CPU-tier hits of the requests
            admitted in it, whose chunks read them (() without a CPU tier). An engine performs the
            offloads, then the loads, then the forward pass; a cost model prices them.
        timed_out: the rids of the waiting requests finished in this step with FinishReason "timeout"
            (SchedulerConfig.max_queue_time_s), in queue order; they hold no KV and have no entry in
            the plan; complete() lists them in last_finished. () without queue time limits.
    """

    __slots__ = (
        "step",
        "decode_rids",
        "prefills",
        "num_tokens",
        "num_decodes",
        "decode_context_sum",
        "token_budget",
        "admitted",
        "preempted",
        "kv_offloads",
        "kv_loads",
        "timed_out",
        "_decode_offsets",
        "_decode_tokens",
        "_decode_sorted",
    )

    def __init__(
        self,
        step: int,
        decode_rids: tuple[Hashable, ...],
        decode_offsets: tuple[int, ...],
        prefills: tuple[ScheduledChunk, ...],
        num_tokens: int,
        decode_context_sum: int,
        token_budget: int,
        admitted: tuple[Hashable, ...] = (),
        preempted: tuple[Hashable, ...] = (),
        decode_tokens: tuple[int, ...] | None = None,
        kv_offloads: tuple[tuple[int, int], ...] = (),
        kv_loads: tuple[tuple[int, int], ...] = (),
        decode_offsets_sorted: tuple[int, ...] | None = None,
    ) -> None:
        """Build a plan; schedulers call this, users read plans.

        Args:
            decode_offsets: per decode, start - step (so a decode's start is offset + step); the
                scheduler shares one tuple across steps while its decodes do not change.
            decode_tokens: per decode, its tokens when some cost more than 1 (speculative
                decoding: 1 + its speculative or draft tokens); None means every decode costs 1 token.
            kv_offloads, kv_loads: the step's KV copies between the GPU and a CPU tier (above).
            decode_offsets_sorted: `decode_offsets` in increasing order where the scheduler keeps them
                (shared across steps as that tuple is); None: not kept.
        """
        self.step = step
        self.decode_rids = decode_rids
        self._decode_offsets = decode_offsets
        self.prefills = prefills
        self.num_tokens = num_tokens
        self.num_decodes = len(decode_rids)
        self.decode_context_sum = decode_context_sum
        self.token_budget = token_budget
        self.admitted = admitted
        self.preempted = preempted
        self._decode_tokens = decode_tokens
        self.kv_offloads = kv_offloads
        self.kv_loads = kv_loads
        self.timed_out: tuple[Hashable, ...] = ()
        self._decode_sorted = decode_offsets_sorted

    @property
    def decodes(self) -> tuple[ScheduledChunk, ...]:
        """The decode entries as ScheduledChunk objects (made now, one per decode; nothing is cached)."""
        step = self.step
        new, cls = tuple.__new__, ScheduledChunk
        if self._decode_tokens is None:
            return tuple([
                new(cls, (rid, 1, False, off + step, True))
                for rid, off in zip(self.decode_rids, self._decode_offsets, strict=True)
            ])
        return tuple([
            new(cls, (rid, n, False, off + step, True))
            for rid, off, n in zip(self.decode_rids, self._decode_offsets, self._decode_tokens, strict=True)
        ])

    @property
    def decode_offsets(self) -> tuple[int, ...]:
        """Per decode, in batch order, start - step, in tokens: the tuple the scheduler shares across
        steps while the set of decodes does not change (a decode's start is its offset + `step`).

        An engine may cache what it derives from it by identity: the same tuple object means the same
        decodes in the same order, each one token further along. O(1), no copy.
        """
        return self._decode_offsets

    @property
    def decode_offsets_sorted(self) -> tuple[int, ...] | None:
        """`decode_offsets` in increasing order, tokens, where the scheduler keeps them (its decode set
        does, through joins and leaves: no sort per new tuple), shared across steps as `decode_offsets`
        is; None when the plan's maker did not keep them (sort decode_offsets). A cost model whose price
        of a decode depends only on its keys reads the decodes as a sorted multiset. O(1), no copy.
        """
        return self._decode_sorted

    @property
    def decode_starts(self) -> tuple[int, ...]:
        """Per decode, in batch order, its `start` (tokens already in its KV), as one tuple of ints.

        With `decode_rids` and `decode_tokens`, the engine's fast path: a batch is built from these
        compact sequences (tensor operations) without one ScheduledChunk per decode.
        """
        step = self.step
        return tuple([off + step for off in self._decode_offsets])

    @property
    def decode_tokens(self) -> tuple[int, ...] | None:
        """Per decode, in batch order, its tokens when some cost more than 1: 1 + its speculative tokens
        (num_spec_tokens) or drafts (Scheduler.set_draft_tokens); None: all cost 1."""
        return self._decode_tokens

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens in this step."""
        return sum(c.num_tokens for c in self.prefills)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens spent on decodes (num_decodes unless speculative tokens are on)."""
        return self.num_tokens - self.num_prefill_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Tokens beyond one per decode: speculative tokens (num_spec_tokens) or drafts (set_draft_tokens)
        to verify in this step; 0 without them."""
        return 0 if self._decode_tokens is None else sum(self._decode_tokens) - self.num_decodes

    @property
    def sampled_rids(self) -> tuple[Hashable, ...]:
        """Requests that sample a token in this step: every decode, and each last prefill chunk."""
        last = tuple(c.rid for c in self.prefills if c.is_last)
        return self.decode_rids + last if last else self.decode_rids

    def __len__(self) -> int:
        return self.num_decodes + len(self.prefills)

    def __iter__(self) -> Iterator[ScheduledChunk]:
        # A tuple built at C speed, then its iterator: no generator frame per entry.
        return iter(self.decodes + self.prefills if self.prefills else self.decodes)

    @overload
    def __getitem__(self, index: int) -> ScheduledChunk: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ScheduledChunk]: ...
    def __getitem__(self, index: int | slice) -> ScheduledChunk | Sequence[ScheduledChunk]:
        if isinstance(index, slice):
            return tuple(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"StepPlan index {index} out of range for {n} entries")
        if index < self.num_decodes:
            tokens = self._decode_tokens[index] if self._decode_tokens else 1
            return ScheduledChunk(
                self.decode_rids[index], tokens, False, self._decode_offsets[index] + self.step, True
            )
        return self.prefills[index - self.num_decodes]

    def __bool__(self) -> bool:
        return self.num_tokens > 0

    def __repr__(self) -> str:
        entries = ", ".join(f"({c.rid!r}, {c.num_tokens})" for c in self)
        return f"StepPlan(step={self.step}, num_tokens={self.num_tokens}, [{entries}])"
