"""The prefill phases of a step (contract steps 2 and 3) as two strategies behind one interface, and the
step budget they spend.

Imports allowed: the standard library and stallfree.core only.

- OnePartialPrefill: the contract. The prompt started in an earlier step continues, then waiting
  requests are admitted strictly in queue order; at most one prompt is ever partially prefilled.
- PartialPrefills(K, L, T): up to K prompts partially prefilled at once, at most L of them long (more
  than T tokens still to compute); the rules are in Scheduler's docstring and docs/scheduling.md.

A strategy decides which chunks the step holds; it asks the scheduler for everything else (its waiting
queue, its chunking hook, the KV manager through `_grow`, `_kv_admits` and `_take_in`, and the one
victim rule), so KV policy, caching and preemption stay out of it. Scheduler(max_num_partial_prefills=)
picks the strategy; schedule() calls `plan` once per step, after the decodes.

Source: chunked prefill and stall-free batching (Sarathi-Serve, Agrawal et al., OSDI'24); several partial
prefills with a long-prompt limit as in vLLM's scheduler (max_num_partial_prefills,
max_long_partial_prefills, long_prefill_token_threshold); the budget as an object the phases spend, as
mini-sglang's PrefillAdder.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from stallfree.core.plan import ScheduledChunk
from stallfree.core.request import RequestStatus

if TYPE_CHECKING:
    from stallfree.core.kv import KVManager
    from stallfree.core.live import LiveRequest
    from stallfree.core.policies import Chunking, WaitingQueue

__all__ = ["OnePartialPrefill", "PartialPrefills", "PrefillHost", "PrefillRule", "StepBudget"]

_PREFILLING = RequestStatus.PREFILLING


class StepBudget:
    """The tokens a step has left for prefill chunks after its decodes; the prefill phases spend it.

    Attributes:
        left: tokens left, >= 0 once a phase has spent (a phase may read a negative budget as none).
    """

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self, n: int) -> None:
        """Take `n` tokens for a chunk."""
        self.left -= n

    def close(self) -> None:
        """Leave nothing for later phases (a prompt that does not finish keeps what is left)."""
        self.left = 0


class PrefillHost(Protocol):
    """What a prefill rule reads and calls on the scheduler that hosts it (Scheduler is the one host):
    its queues and partial prefills, its chunking and KV manager, and the admission, growth and
    preemption steps it shares with the decode phase. Declared here, below the scheduler, so that the
    strategies need no import of it."""

    _chunking: Chunking
    _kv: KVManager
    _live: dict[Hashable, LiveRequest]
    _partials: list[LiveRequest]
    _prefilling: LiveRequest | None
    _waiting: WaitingQueue
    max_seqs: int
    num_recomputed_tokens: int
    policy: str

    @property
    def step(self) -> int:
        """The step being planned (1-based)."""

    @property
    def num_running(self) -> int:
        """Requests running (decoding or in prefill)."""

    def priority_key(self, obj: LiveRequest) -> tuple[float, int]:
        """The request's queue key under the priority policy (smaller runs first)."""

    def _count_recomputed(self, out: list[ScheduledChunk]) -> None: ...

    def _grow(self, obj: LiveRequest, tokens: int, step: int, victims: list[LiveRequest]) -> bool: ...

    def _kv_admits(self, obj: LiveRequest, first_chunk: int, hits: Sequence[int]) -> bool: ...

    def _preempt(self, obj: LiveRequest, step: int, victims: list[LiveRequest]) -> None: ...

    def _take_in(self, obj: LiveRequest, first_chunk: int, hits: Sequence[int], start: int) -> None: ...

    def _victim(self, obj: LiveRequest, running: list[LiveRequest]) -> LiveRequest: ...


class PrefillRule(Protocol):
    """Contract steps 2 and 3 for one step: which chunks run, and which waiting requests are admitted."""

    def plan(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[LiveRequest],
             decoding: bool) -> tuple[Hashable, ...]:
        """Append the step's prefill chunks to `out`, spending `budget`; return the admitted rids.

        Args:
            s: the scheduler planning the step.
            budget: the tokens left after the decodes.
            out: the step's chunks, in prefill order (appended to).
            victims: the requests preempted in this step so far (appended to); a step that preempted
                admits nothing.
            decoding: whether the step has decodes.
        """


class OnePartialPrefill:
    """The contract: the partial prefill continues, then strict admission in queue order."""

    def plan(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[LiveRequest],
             decoding: bool) -> tuple[Hashable, ...]:
        """Contract step 2, then (unless it preempted) step 3."""
        self._continue(s, budget, out, victims)
        return () if victims else self._admit(s, budget, out)

    @staticmethod
    def _continue(s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[LiveRequest]) -> None:
        """Contract step 2: the rest of the prompt started in an earlier step, up to the budget."""
        obj = s._prefilling
        if obj is None or budget.left <= 0:
            return
        done = obj.num_prefilled
        rest = obj.target - done
        n = s._chunking.chunk(rest, budget.left)
        if n and not s._grow(obj, done + n, s.step, victims):
            return  # it was its own victim: nothing was admitted after it
        if n:
            if obj.num_preemptions:
                s.num_recomputed_tokens += n
            out.append(ScheduledChunk(obj.rid, n, True, done, n == rest))
        # A prompt that does not finish this step keeps what is left (less than a block when chunks are
        # block-aligned): admitting behind it would let a newer prompt reach its first token first.
        if n == rest:
            budget.spend(n)
        else:
            budget.close()

    @staticmethod
    def _admit(s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk]) -> tuple[Hashable, ...]:
        """Contract step 3: admission in queue order; the first head that does not fit stops it."""
        waiting = s._waiting
        if not len(waiting):
            return ()
        admitted: list[Hashable] = []
        kv = s._kv
        while budget.left > 0 and len(waiting):
            obj: LiveRequest | None = waiting.head()
            if obj is None or s.num_running >= s.max_seqs:
                break
            # A cached prefix (none without caching) is kept; the prefill starts after it.
            start, hits = kv.lookup(obj)
            n = s._chunking.chunk(obj.target - start, budget.left)
            if n == 0 or not s._kv_admits(obj, n, hits):  # never a 0-token first chunk
                break
            waiting.pop_head()
            s._take_in(obj, n, hits, start)
            if obj.num_preemptions:
                s.num_recomputed_tokens += n
            last = n == obj.target - start
            out.append(ScheduledChunk(obj.rid, n, True, start, last))
            admitted.append(obj.rid)
            if last:  # as for the partial prefill above
                budget.spend(n)
            else:
                budget.close()
        return tuple(admitted)


class PartialPrefills:
    """K > 1: the partial prefills in admission (or priority) order, admissions, then the budget left
    back to the partial prefills (only to the short ones when the step has decodes).

    Args:
        max_num_partial_prefills: K, >= 2.
        max_long_partial_prefills: L, 1 to K.
        long_prefill_token_threshold: T, tokens, >= 1.
    """

    def __init__(self, max_num_partial_prefills: int, max_long_partial_prefills: int,
                 long_prefill_token_threshold: int) -> None:
        self.k = max_num_partial_prefills
        self.lng = max_long_partial_prefills
        self.thr = long_prefill_token_threshold

    def plan(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[LiveRequest],
             decoding: bool) -> tuple[Hashable, ...]:
        """The K/L/T step after the decodes; `out` gets one chunk per prompt in prefill order."""
        thr = self.thr
        chunking = s._chunking
        partials = s._partials
        if s.policy == "priority" and len(partials) > 1:
            partials = sorted(partials, key=s.priority_key)
        else:
            partials = list(partials)
        # Prompts still partial after this step, and how many of them are long (rest > T at the step's start).
        num_partial = num_long = 0
        for obj in partials:
            if obj.status is not _PREFILLING:
                continue  # a victim of a decode's block in this step
            done = obj.num_prefilled
            rest = obj.target - done
            left = budget.left
            n = chunking.chunk(rest, min(left, thr) if rest > thr else left) if left > 0 else 0
            if n and not self._grow(s, obj, done + n, partials, victims):
                n = 0
            if n:
                out.append(ScheduledChunk(obj.rid, n, True, done, n == rest))
                budget.spend(n)
            if n != rest:
                num_partial += 1
                num_long += rest > thr
        if victims:
            live = s._live
            out[:] = [c for c in out if live[c.rid].status is _PREFILLING]
            s._count_recomputed(out)
            return ()
        admitted = self._admit(s, budget, out, num_partial, num_long)
        self._top_up(s, budget, out, thr if decoding else None)
        s._count_recomputed(out)
        return admitted

    @staticmethod
    def _grow(s: PrefillHost, obj: LiveRequest, tokens: int, partials: list[LiveRequest],
              victims: list[LiveRequest]) -> bool:
        """KV for a partial prefill's chunk, preempting only newer partial prefills (the victim rule
        among them); False (no chunk this step) when they do not suffice."""
        kv = s._kv
        while not kv.grow(obj, tokens, s.step):
            victim = s._victim(obj, [o for o in partials if o.status is _PREFILLING])
            if victim is obj:
                return False
            s._preempt(victim, s.step, victims)
        return True

    def _admit(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], num_partial: int,
               num_long: int) -> tuple[Hashable, ...]:
        """Admission in queue order: a long head takes at most T tokens and is passed by the requests
        behind it while L long prompts are partially prefilled; any other head that does not fit (slot,
        budget, KV, or a K-th partial prefill) stops admission."""
        waiting = s._waiting
        if not len(waiting) or budget.left <= 0:
            return ()
        thr = self.thr
        kv = s._kv
        admitted: list[Hashable] = []
        for obj in waiting.in_order():
            left = budget.left
            if left <= 0 or s.num_running >= s.max_seqs:
                break
            # As with one partial prefill: a cached prefix is kept at admission, the prefill starts
            # after it, and long or short is judged on the tokens left to compute.
            start, hits = kv.lookup(obj)
            rest = obj.target - start
            is_long = rest > thr
            if is_long and num_long >= self.lng:
                continue  # the one case where a short prompt may pass a long one
            n = s._chunking.chunk(rest, min(left, thr) if is_long else left)
            last = n == rest
            if n == 0 or (not last and num_partial >= self.k) or not s._kv_admits(obj, n, hits):
                break
            waiting.remove(obj)
            s._take_in(obj, n, hits, start)
            s._partials.append(obj)
            out.append(ScheduledChunk(obj.rid, n, True, start, last))
            admitted.append(obj.rid)
            if not last:
                num_partial += 1
                num_long += is_long
            # A short prompt that does not finish keeps what is left, as under the contract.
            if last or is_long:
                budget.spend(n)
            else:
                budget.close()
        return tuple(admitted)

    @staticmethod
    def _top_up(s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], long_over: int | None) -> None:
        """The budget left goes to the unfinished chunks in order (only with KV to spare; nothing is
        preempted for it). With `long_over` = T (a step with decodes), a long prompt (more than T tokens
        to compute at the step's start) gets none: its chunk stays at most T tokens, because a chunk deep
        into a long prompt attends over its whole prefix and would slow the step every decode in it waits
        for; without decodes the top-up is work-conserving."""
        live = s._live
        for i, c in enumerate(out):
            if budget.left <= 0:
                break
            if c.is_last:
                continue
            obj = live[c.rid]
            if long_over is not None and obj.target - c.start > long_over:
                continue
            end = c.start + c.num_tokens
            rest = obj.target - end
            n = s._chunking.chunk(rest, budget.left)
            if n == 0 or not s._kv.grow(obj, end + n, s.step):
                break
            out[i] = c._replace(num_tokens=c.num_tokens + n, is_last=n == rest)
            budget.spend(n)
            if n != rest:
                break
