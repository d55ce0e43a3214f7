"""The one record of a live request that the core's schedulers keep, and the one owner of the decode
set (LiveRequest, DecodeSet), in vLLM's words: num_prompt_tokens, num_computed_tokens,
num_output_tokens, status, block table.

Imports allowed: the standard library and stallfree.core only.

Progress of a decoding request is derived, not counted every step: a decode's record holds an
`offset` such that its entry at clock value c starts at offset + c (the tokens already in its KV),
where the clock is the owner's step number (Scheduler) or its count of decode steps (the baselines of
stallfree.sim.run.baselines, which have steps without decodes). So a step that serves every decode one
token changes no record; only the rare irregular ones (a skipped decode, speculative tokens, a
preemption) touch the records they concern. The DecodeSet keeps the decodes in batch order as
aligned lists, tuples that plans share while the set does not change, the sum of the offsets, and
the index of decodes by the clock value of their last token (`due`).
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort
from collections.abc import Hashable
from typing import Any

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.request import Request, RequestStatus

__all__ = ["DecodeSet", "LiveRequest", "position_of"]

_DECODING = RequestStatus.DECODING


def position_of(items: list[Any], obj: Any) -> int:
    """Index of `obj` (by identity) in a decode list, looking at the newest few first.

    Short requests, the ones that most often finish (or run out of speculative room), were admitted
    last and sit at the end of the list, where list.index() would look last.

    Raises:
        ValueError: `obj` is not in `items`.
    """
    n = len(items)
    for i in range(n - 1, max(n - 9, -1), -1):
        if items[i] is obj:
            return i
    return items.index(obj)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class LiveRequest:
    """A scheduler's record of one live request; mutated by that scheduler only.

    An admission starts an *episode*: the request prefills `target` = num_prompt_tokens + gen0
    tokens (gen0 = tokens generated before it was last preempted; 0 on the first admission) and its
    last chunk samples token gen0 + 1. Under the reservation policy there is one episode.

    Attributes (tokens unless said otherwise):
        req: the Request as added.
        rid: its id.
        seq: add() order among the scheduler's requests (ties of priority are broken by it).
        admit_seq: admission order of the current episode (-1 while waiting).
        arrival_step: the step of add().
        num_prompt_tokens, max_new: from the request.
        status: a RequestStatus.
        num_prefilled: tokens of the current episode's prefill scheduled and completed.
        target: tokens the current episode prefills.
        gen0: tokens generated before the last preemption.
        kv: tokens reserved at admission (reservation policy; 0 under paged).
        block_table: its KV block ids, in token order (paged; empty while waiting).
        bucket: the paged policy's filing key while decoding, -1 otherwise.
        offset: while decoding, its entry at clock c starts at offset + c.
        finish_step: while decoding, the clock value whose step samples its last token; else -1.
        admitted_step, first_token_step, decode_step: step numbers (None / -1 until they happen).
        num_preemptions: times it was preempted.
        limit: the tokens after which it ends: max_new (reason "length"), or fewer when the caller said
            so through stop_after() (reason "stop").
        num_cached_tokens: prefix caching: prompt tokens found cached at its first admission (set by
            the KV manager; 0 without caching).
        drafts: draft tokens set for its next step (Scheduler.set_draft_tokens); 0: none.
        unsettled: per earlier step whose drafts were counted provisionally (complete() without a
            verdict), oldest first, the number of those drafts; Scheduler.take_back settles them.
        lora_passes: steps in which a later request was admitted past it while its LoRA adapter could
            not join (core/lora.py); 0 without max_loras.
    """

    __slots__ = (
        "req", "rid", "seq", "admit_seq", "arrival_step", "num_prompt_tokens", "max_new", "status",
        "num_prefilled", "target", "gen0", "kv", "block_table", "bucket", "offset", "finish_step",
        "admitted_step", "first_token_step", "decode_step", "num_preemptions", "limit", "num_cached_tokens",
        "drafts", "unsettled", "_decodes", "lora_passes",
    )

    def __init__(self, req: Request, kv: int, seq: int, arrival_step: int, decodes: DecodeSet) -> None:
        self.req = req
        self.rid = req.rid
        self.seq = seq
        self.admit_seq = -1
        self.arrival_step = arrival_step
        self.num_prompt_tokens = req.prompt_len
        self.max_new = req.max_new
        self.status = RequestStatus.WAITING
        self.num_prefilled = 0
        self.target = req.prompt_len
        self.gen0 = 0
        self.kv = kv
        self.block_table: list[int] = []
        self.bucket = -1
        self.offset = 0
        self.finish_step = -1
        self.admitted_step: int | None = None
        self.first_token_step: int | None = None
        self.decode_step = -1
        self.num_preemptions = 0
        self.limit = req.max_new
        self.num_cached_tokens = 0
        self.drafts = 0
        self.unsettled: tuple[int, ...] = ()
        self._decodes = decodes
        self.lora_passes = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> LiveRequest:
        # Scheduler.snapshot(): the Request is immutable and shared, the block table (ints) copied flat;
        # only the decode set is copied deeply (through `memo`, so that it is copied once).
        new = LiveRequest.__new__(LiveRequest)
        memo[id(self)] = new
        for name in _fields(LiveRequest):
            setattr(new, name, getattr(self, name))
        new.block_table = list(self.block_table)
        new._decodes = copy.deepcopy(self._decodes, memo)
        return new

    @property
    def prompt_len(self) -> int:
        """The contract's name of num_prompt_tokens."""
        return self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (emitted, or recomputed after a preemption)."""
        if self.finish_step >= 0:
            return self.offset + self._decodes.clock + 1 - self.num_prompt_tokens
        if self.status is _DECODING:  # finished on its first token of this episode
            return self.gen0 + 1
        return self.gen0

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed: the episode's prefill so far, or prompt + generated - 1."""
        if self.finish_step >= 0:
            return self.offset + self._decodes.clock
        return self.num_prefilled


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class DecodeSet:
    """The running decodes of one scheduler, in batch order, with their derived progress.

    The one owner of the decode bookkeeping (the Scheduler and the baselines use it; the simulator
    reads plans and finishes only). `clock` is the owner's next step number or decode-step count;
    a decode's entry at that clock starts at record.offset + clock.
    """

    __slots__ = ("recs", "_rids", "_offsets", "_rids_t", "_offsets_t", "_dirty", "_stale", "_offset_sum",
                 "due", "clock", "_shift", "_shifted_t", "_sorted", "_sorted_t")

    def __init__(self) -> None:
        self.recs: list[LiveRequest] = []
        self._rids: list[Hashable] = []
        self._offsets: list[int] = []
        self._rids_t: tuple[Hashable, ...] = ()
        self._offsets_t: tuple[int, ...] = ()
        self._dirty = False
        self._stale = False
        self._offset_sum = 0
        self.due: dict[int, list[LiveRequest]] = {}
        self.clock = 0
        self._shift: int | None = None
        self._shifted_t: tuple[int, ...] = ()
        # The offsets in increasing order, kept through joins and leaves (a cost model prices the decodes
        # by how they fall between its knots), and their tuple for the current `_offsets_t` (None: not made).
        self._sorted: list[int] = []
        self._sorted_t: tuple[int, ...] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> DecodeSet:
        # Scheduler.snapshot(): the records through `memo`; the tuples (of rids and ints) are shared.
        new = DecodeSet.__new__(DecodeSet)
        memo[id(self)] = new
        for name in _fields(DecodeSet):
            setattr(new, name, getattr(self, name))
        new.recs = [copy.deepcopy(r, memo) for r in self.recs]
        new._rids, new._offsets, new._sorted = list(self._rids), list(self._offsets), list(self._sorted)
        due = memo.get(id(self.due))  # the owner's alias of `due` (Scheduler._due) may be copied first
        if due is None:
            due = memo[id(self.due)] = {}
            due.update((k, [copy.deepcopy(r, memo) for r in v]) for k, v in self.due.items())
        new.due = due
        return new

    def __len__(self) -> int:
        return len(self.recs)

    def join(self, rec: LiveRequest, offset: int, finish: int) -> None:
        """Append a new decode at the end of the batch order; its last token is due at clock `finish`."""
        rec.offset = offset
        rec.finish_step = finish
        self.due.setdefault(finish, []).append(rec)
        self.recs.append(rec)
        self._rids.append(rec.rid)
        self._offsets.append(offset)
        self._offset_sum += offset
        insort(self._sorted, offset)
        self._dirty = True

    def leave(self, rec: LiveRequest) -> None:
        """Remove a decode (finish, abort, preemption)."""
        i = position_of(self.recs, rec)
        del self.recs[i], self._rids[i]
        offset = self._offsets.pop(i)
        self._offset_sum -= offset
        ordered = self._sorted
        del ordered[bisect_left(ordered, offset)]
        rec.finish_step = -1
        self._dirty = True

    def shift(self, rec: LiveRequest, delta: int) -> None:
        """Move a decode's progress by `delta` tokens (-1 for a skipped step, n - 1 for n accepted)."""
        rec.offset += delta
        rec.finish_step -= delta
        self.due.setdefault(rec.finish_step, []).append(rec)
        self._stale = True

    def tuples(self) -> tuple[tuple[Hashable, ...], tuple[int, ...]]:
        """(rids, offsets) in batch order, shared with plans until the set or an offset changes."""
        if self._stale:
            self._refresh()
        if self._dirty:
            self._rids_t = tuple(self._rids)
            self._offsets_t = tuple(self._offsets)
            self._dirty = False
            self._shift = None
            self._sorted_t = None
        return self._rids_t, self._offsets_t

    def sorted_offsets(self) -> tuple[int, ...]:
        """The offsets of tuples() in increasing order (the same tuple until the set or an offset
        changes); kept through joins and leaves, so made without a sort."""
        if self._stale or self._dirty:
            self.tuples()
        found = self._sorted_t
        if found is None:
            found = self._sorted_t = tuple(self._sorted)
        return found

    def shifted_offsets(self, shift: int) -> tuple[int, ...]:
        """The offsets plus `shift` (for an owner whose clock is not its step number), cached."""
        offsets = self.tuples()[1]
        if shift == 0:
            return offsets
        if self._shift != shift:
            self._shifted_t = tuple(o + shift for o in offsets)
            self._shift = shift
        return self._shifted_t

    def offsets_at(self, indices: list[int]) -> tuple[tuple[Hashable, ...], tuple[int, ...]]:
        """(rids, offsets) of the decodes at `indices` (batch positions)."""
        rids, offsets = self.tuples()
        return tuple(rids[i] for i in indices), tuple(offsets[i] for i in indices)

    @property
    def offset_sum(self) -> int:
        """Sum of the decodes' offsets (refreshed first if some moved)."""
        if self._stale:
            self._refresh()
        return self._offset_sum

    def context_sum(self, clock: int) -> int:
        """Sum over the decodes of their start at `clock`, tokens."""
        return self.offset_sum + len(self.recs) * clock

    def spec_costs(self, spec: int, clock: int) -> tuple[tuple[int, ...], int]:
        """Per-decode tokens with `spec` speculative tokens at `clock`, in batch order, and their sum:
        1 + min(spec, finish_step - clock) each (a decode never verifies past its last token), found
        through the finish index `due` (a copy plus a lookup per decode due within `spec` steps)."""
        n = len(self.recs)
        short: dict[int, tuple[LiveRequest, int]] = {}
        for d in range(spec):
            for obj in self.due.get(clock + d, ()):
                if obj.status is _DECODING and obj.finish_step == clock + d:
                    short[id(obj)] = (obj, d)
        full = (1 + spec,) * n
        if not short:
            return full, n * (1 + spec)
        costs = list(full)
        total = n * (1 + spec)
        for obj, d in short.values():
            costs[position_of(self.recs, obj)] = 1 + d
            total -= spec - d
        return tuple(costs), total

    def _refresh(self) -> None:
        self._offsets = [r.offset for r in self.recs]
        self._offset_sum = sum(self._offsets)
        self._sorted = sorted(self._offsets)
        self._stale = False
        self._dirty = True


def _fields(cls: type) -> tuple[str, ...]:
    """The attributes a copy takes over: the class's __slots__, or in the compiled build (setup.py), which
    keeps no __slots__, mypyc's list of them."""
    names: tuple[str, ...] = getattr(cls, "__slots__", ()) or getattr(cls, "__mypyc_attrs__", ())
    return names
