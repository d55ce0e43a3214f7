"""The prefill phases of a step (contract steps 2 and 3) as two strategies behind one interface, and the
step budget they spend.

Imports allowed: the standard library and stallfree.core only.

- OnePartialPrefill: the contract. The prompt started in an earlier step continues, then waiting
  requests are admitted strictly in queue order; at most one prompt is ever partially prefilled.
- PartialPrefills(K, L, T): up to K prompts partially prefilled at once, at most L of them long (more
  than T tokens still to compute); the rules are in Scheduler's docstring and docs/scheduling.md.

A strategy decides which chunks the step holds; it asks the scheduler for everything else (its waiting
queue, its chunking hook, the KV manager, growth with preemption, admission and the one victim rule)
through a PrefillHost, a narrow view with public members, so KV policy, caching and preemption stay
out of it. Scheduler picks the strategy from max_num_partial_prefills; schedule() calls `plan` once per
step, after the decodes.

Source: chunked prefill and stall-free batching (Sarathi-Serve, Agrawal et al., OSDI'24); several partial
prefills with a long-prompt limit as in vLLM's scheduler (max_num_partial_prefills,
max_long_partial_prefills, long_prefill_token_threshold); the budget as an object the phases spend, as
mini-sglang's PrefillAdder.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import SchedulerStateError
from stallfree.core.plan import ScheduledChunk
from stallfree.core.request import RequestStatus

if TYPE_CHECKING:
    from stallfree.core.kv import KVManager
    from stallfree.core.live import LiveRequest
    from stallfree.core.lora import LoraSlots
    from stallfree.core.policies import Chunking, WaitingQueue

__all__ = [
    "NO_LIMITS", "OnePartialPrefill", "PartialPrefills", "PrefillHost", "PrefillRule", "StepBudget", "StepLimits",
]

_PREFILLING = RequestStatus.PREFILLING


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class StepBudget:
    """The tokens a step has left for prefill chunks after its decodes; the prefill phases spend it.

    Attributes:
        left: tokens left, >= 0 once a phase has spent (a phase may read a negative budget as none).
        placed: tokens the step holds before its prompt chunks (its decodes, drafts included).
    """

    __slots__ = ("left", "placed")

    def __init__(self, left: int, placed: int = 0) -> None:
        self.left = left
        self.placed = placed

    def spend(self, n: int) -> None:
        """Take `n` tokens for a chunk."""
        self.left -= n

    def close(self) -> None:
        """Leave nothing for later phases (a prompt that does not finish keeps what is left)."""
        self.left = 0


class StepLimits(NamedTuple):
    """What one schedule() call asks of its prefill phase beyond the budget (Scheduler.schedule's admit=
    and chunk_cap=); NO_LIMITS for a step that asks nothing.

    Attributes:
        admitting: whether this step may admit waiting requests.
        chunk_cap: the step's chunk cap (rid, start, n) -> tokens, or None.
        refused: None, or the ids (`id(rec)`) of the waiting records the step's admission filter refused.
    """

    admitting: bool = True
    chunk_cap: Callable[[Hashable, int, int], int] | None = None
    refused: frozenset[int] | None = None


#: The limits of a step that asks for nothing beyond its budget.
NO_LIMITS = StepLimits()


class _Counts(Protocol):
    @property
    def step(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    _limits: StepLimits  # the step's limits, set once per schedule()


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PrefillHost:
    """The narrow view of the scheduler that a prefill rule acts through: its queue, its partial
    prefills, its chunking hook and KV manager, and the admission, growth and preemption steps it
    shares with the decode phase, each a documented member. The scheduler makes one at construction
    (the collections are its own, shared, so the view stays current); defined here, below the
    scheduler, so that the strategies need no import of it.

    Attributes:
        chunking: the chunking hook (core/policies.py): chunk(rest, left) -> tokens of the next chunk.
        kv: the KV manager (core/kv/); a rule asks it `lookup(rec)` and, for a top-up that never
            preempts, `grow(rec, tokens, step)`.
        waiting: the waiting queue in admission order (head, pop_head, remove, in_order).
        live: rid -> record of every live request (read only).
        partials: the prompts admitted and not done with their prefill, in admission order (read only;
            `admit` appends, the scheduler removes); with one partial prefill at most one is left at
            the start of a step.
        max_seqs: the most running requests.
        policy: "fcfs" or "priority".
        priority_key(rec): the record's queue key under "priority" (smaller runs first).
        grow(rec, tokens, step, victims) -> bool: the KV for `tokens` tokens of a running request,
            preempting by the victim rule (victims appended) while blocks are short; False when it
            was its own victim.
        can_admit(rec, first_chunk, hits) -> bool: whether the KV manager admits `rec` now with a
            first chunk of `first_chunk` tokens after its cached prefix `hits` (from kv.lookup).
        admit(rec, first_chunk, hits, start): admit `rec` (already out of the queue): its KV, its
            status and admission order; its prefill starts at token `start`; it joins `partials`.
        preempt(rec, step, victims): preempt a running request by recompute (appended to victims).
        victim(rec, running) -> rec: the one victim rule among `running` (rec itself when none).
        recomputed(tokens): count prefill tokens scheduled in a recompute episode.
        admitting: whether this step may admit waiting requests (schedule(admit=...); True by default).
        chunk_cap: the step's chunk cap (schedule(chunk_cap=...)) or None; a rule asks it through `cap`.
        refused: None, or the ids (`id(rec)`) of the waiting records the step's admission filter
            (schedule(admit=callable)) refused: admission passes over them, leaving them queued.
        (These three read the step's StepLimits, which the scheduler sets once per schedule(); the view
        itself never changes.)
        lora: None, or the LoRA adapter slots (core/lora.py, max_loras): admission passes over a
            request whose adapter cannot join while `lora.may_pass` allows, else stops at it.
    """

    __slots__ = ("chunking", "kv", "waiting", "live", "partials", "max_seqs", "policy", "priority_key", "grow",
                 "can_admit", "admit", "preempt", "victim", "recomputed", "_counts", "lora")

    def __init__(
        self, counts: _Counts, *, chunking: Chunking, kv: KVManager, waiting: WaitingQueue,
        live: Mapping[Hashable, LiveRequest], partials: list[LiveRequest], max_seqs: int, policy: str,
        priority_key: Callable[[LiveRequest], tuple[float, ...]],
        grow: Callable[[LiveRequest, int, int, list[LiveRequest]], bool],
        can_admit: Callable[[LiveRequest, int, Sequence[int]], bool],
        admit: Callable[[LiveRequest, int, Sequence[int], int], None],
        preempt: Callable[[LiveRequest, int, list[LiveRequest]], None],
        victim: Callable[[LiveRequest, list[LiveRequest]], LiveRequest],
        recomputed: Callable[[int], None], lora: LoraSlots | None = None,
    ) -> None:
        self._counts = counts
        self.chunking, self.kv, self.waiting, self.live, self.partials = chunking, kv, waiting, live, partials
        self.max_seqs, self.policy, self.priority_key = max_seqs, policy, priority_key
        self.grow, self.can_admit, self.admit = grow, can_admit, admit
        self.preempt, self.victim, self.recomputed = preempt, victim, recomputed
        self.lora = lora

    @property
    def admitting(self) -> bool:
        """Whether this step may admit waiting requests."""
        return self._counts._limits.admitting

    @property
    def chunk_cap(self) -> Callable[[Hashable, int, int], int] | None:
        """The step's chunk cap, or None."""
        return self._counts._limits.chunk_cap

    @property
    def refused(self) -> frozenset[int] | None:
        """The ids of the waiting records the step's admission filter refused, or None."""
        return self._counts._limits.refused

    def cap(self, rec: LiveRequest, start: int, n: int) -> int:
        """The tokens a prompt chunk of `rec` from token `start`, sized `n` (>= 1) by the budget, may take:
        `n` without a chunk cap, else the cap's answer (an integer from 0 to n); with block-aligned chunks
        an answer below `n` is rounded down so that the chunk ends on a block boundary.

        Raises:
            SchedulerStateError: the cap returned something else (named with its arguments).
        """
        cap = self.chunk_cap
        if cap is None:
            return n
        # Read as an object: the answer is the caller's, checked here (a compiled build would convert a bool).
        answer: Callable[[Hashable, int, int], object] = cap
        m = answer(rec.rid, start, n)
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= n:
            raise SchedulerStateError(
                f"chunk_cap({rec.rid!r}, start={start}, n={n}) returned {m!r}; it must be an integer from 0 to {n}"
            )
        b = getattr(self.chunking, "block_size", None)  # BlockAlignedChunks' alignment
        if b and m < n:
            m = max(m - (start + m) % b, 0)
        return m

    @property
    def step(self) -> int:
        """The step being planned."""
        return self._counts.step

    @property
    def num_running(self) -> int:
        """Requests running (decoding or in prefill)."""
        return self._counts.num_running

    def count_recomputed(self, out: list[ScheduledChunk]) -> None:
        """Count the chunks in `out` of requests in a recompute episode (after a preemption)."""
        live = self.live
        for c in out:
            if live[c.rid].num_preemptions:
                self.recomputed(c.num_tokens)


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


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class OnePartialPrefill:
    """The contract: the partial prefill continues, then strict admission in queue order."""

    def plan(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[LiveRequest],
             decoding: bool) -> tuple[Hashable, ...]:
        """Contract step 2, then (unless it preempted) step 3."""
        self._continue(s, budget, out, victims)
        return () if victims or not s.admitting else self._admit(s, budget, out)

    def _continue(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk],
                  victims: list[LiveRequest]) -> None:
        """Contract step 2: the rest of the prompt started in an earlier step, up to the budget."""
        obj = s.partials[0] if s.partials else None
        if obj is None or budget.left <= 0:
            return
        done = obj.num_prefilled
        rest = obj.target - done
        n = s.chunking.chunk(rest, budget.left)
        if n and s.chunk_cap is not None:
            n = s.cap(obj, done, n)
        if n and not s.grow(obj, done + n, s.step, victims):
            return  # it was its own victim: nothing was admitted after it
        if n:
            if obj.num_preemptions:
                s.recomputed(n)
            out.append(ScheduledChunk(obj.rid, n, True, done, n == rest))
        # A prompt that does not finish this step keeps what is left (less than a block when chunks are
        # block-aligned): admitting behind it would let a newer prompt reach its first token first.
        if n == rest:
            budget.spend(n)
        else:
            budget.close()

    def _limit(self, s: PrefillHost, obj: LiveRequest, left: int) -> int:
        """The most tokens `obj`'s next chunk may take when `left` are left in the budget: `left` (a
        rule with a per-request limit narrows it)."""
        return left

    def _admit(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk]) -> tuple[Hashable, ...]:
        """Contract step 3: admission in queue order; the first head that does not fit stops it."""
        waiting = s.waiting
        if not len(waiting):
            return ()
        admitted: list[Hashable] = []
        kv = s.kv
        refused = s.refused
        lora = s.lora
        passed: list[LiveRequest] = []  # passed over for their adapters, until a later admission
        order = iter([o for o in waiting.in_order() if id(o) not in refused]) if refused else None
        while budget.left > 0 and len(waiting):
            obj: LiveRequest | None = waiting.head() if order is None else next(order, None)
            if obj is None or s.num_running >= s.max_seqs:
                break
            if lora is not None and not lora.can_join(obj.req.lora):
                # The contract's one exception to queue order (core/lora.py): an adapter that cannot
                # join is passed over, at most max_lora_passes steps in a request's life.
                if not lora.may_pass(obj):
                    break
                passed.append(obj)
                if order is None:
                    order = iter(waiting.in_order()[1:])  # obj was the head; walk on behind it
                continue
            # A cached prefix (none without caching) is kept; the prefill starts after it.
            start, hits = kv.lookup(obj)
            n = s.chunking.chunk(obj.target - start, self._limit(s, obj, budget.left))
            if n and s.chunk_cap is not None:
                n = s.cap(obj, start, n)
            if n == 0 or not s.can_admit(obj, n, hits):  # never a 0-token first chunk
                break
            if order is None:
                waiting.pop_head()
            else:
                waiting.remove(obj)
            s.admit(obj, n, hits, start)
            if passed:
                assert lora is not None
                lora.passed(passed)
                passed = []
            if obj.num_preemptions:
                s.recomputed(n)
            last = n == obj.target - start
            out.append(ScheduledChunk(obj.rid, n, True, start, last))
            admitted.append(obj.rid)
            if last:  # as for the partial prefill above
                budget.spend(n)
            else:
                budget.close()
        return tuple(admitted)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
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
        chunking = s.chunking
        partials = s.partials
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
            if n and s.chunk_cap is not None:
                n = s.cap(obj, done, n)
            if n and not self._grow(s, obj, done + n, partials, victims):
                n = 0
            if n:
                out.append(ScheduledChunk(obj.rid, n, True, done, n == rest))
                budget.spend(n)
            if n != rest:
                num_partial += 1
                num_long += rest > thr
        if victims:
            live = s.live
            out[:] = [c for c in out if live[c.rid].status is _PREFILLING]
            s.count_recomputed(out)
            return ()
        admitted = self._admit(s, budget, out, num_partial, num_long) if s.admitting else ()
        self._top_up(s, budget, out, thr if decoding else None)
        s.count_recomputed(out)
        return admitted

    @staticmethod
    def _grow(s: PrefillHost, obj: LiveRequest, tokens: int, partials: list[LiveRequest],
              victims: list[LiveRequest]) -> bool:
        """KV for a partial prefill's chunk, preempting only newer partial prefills (the victim rule
        among them); False (no chunk this step) when they do not suffice."""
        kv = s.kv
        while not kv.grow(obj, tokens, s.step):
            victim = s.victim(obj, [o for o in partials if o.status is _PREFILLING])
            if victim is obj:
                return False
            s.preempt(victim, s.step, victims)
        return True

    def _admit(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], num_partial: int,
               num_long: int) -> tuple[Hashable, ...]:
        """Admission in queue order: a long head takes at most T tokens and is passed by the requests
        behind it while L long prompts are partially prefilled; any other head that does not fit (slot,
        budget, KV, or a K-th partial prefill) stops admission."""
        waiting = s.waiting
        if not len(waiting) or budget.left <= 0:
            return ()
        thr = self.thr
        kv = s.kv
        admitted: list[Hashable] = []
        refused = s.refused
        lora = s.lora
        passed: list[LiveRequest] = []  # passed over for their adapters, until a later admission
        for obj in waiting.in_order():
            if refused and id(obj) in refused:
                continue  # passed over by the step's admission filter; it keeps its place
            left = budget.left
            if left <= 0 or s.num_running >= s.max_seqs:
                break
            if lora is not None and not lora.can_join(obj.req.lora):
                if not lora.may_pass(obj):
                    break
                passed.append(obj)  # bounded per request (core/lora.py)
                continue
            # As with one partial prefill: a cached prefix is kept at admission, the prefill starts
            # after it, and long or short is judged on the tokens left to compute.
            start, hits = kv.lookup(obj)
            rest = obj.target - start
            is_long = rest > thr
            if is_long and num_long >= self.lng:
                continue  # the one case where a short prompt may pass a long one
            n = s.chunking.chunk(rest, min(left, thr) if is_long else left)
            if n and s.chunk_cap is not None:
                n = s.cap(obj, start, n)
            last = n == rest
            if n == 0 or (not last and num_partial >= self.k) or not s.can_admit(obj, n, hits):
                break
            waiting.remove(obj)
            s.admit(obj, n, hits, start)
            if passed:
                assert lora is not None
                lora.passed(passed)
                passed = []
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
        live = s.live
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
            n = s.chunking.chunk(rest, budget.left)
            if n and s.chunk_cap is not None:
                # The cap is asked for the whole chunk; an answer below its current length adds nothing.
                n = max(s.cap(obj, c.start, c.num_tokens + n) - c.num_tokens, 0)
            if n == 0 or not s.kv.grow(obj, end + n, s.step):
                break
            out[i] = c._replace(num_tokens=c.num_tokens + n, is_last=n == rest)
            budget.spend(n)
            if n != rest:
                break
