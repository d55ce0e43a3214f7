"""The decode phase of a step (contract step 1) as a strategy with two implementations, like the prefill
phases (core/prefill.py):

- PlainDecodes: the contract. One token for every ready decode, oldest admitted first; when they exceed
  the budget the selection hook (core/policies.py, decode_overflow) picks who runs and the rest skip a
  step. Each decode's KV comes from the KV manager, preempting by the scheduler's victim rule when short.
- SpeculativeDecodes: the same, and then speculative tokens: every decode priced at 1 + num_spec_tokens
  (a verification pass), or the draft tokens a drafter gave a decode for the next step
  (Scheduler.set_draft_tokens), whose verdicts come back through complete(num_accepted=) or later
  through take_back(); a decode at its last token with drafts unsettled is held, unscheduled, until then.

Imports allowed: the standard library and stallfree.core only.

A strategy acts through a DecodeHost, a narrow view the scheduler makes once (its decode set, its KV
manager, its records, growth with preemption and the overflow rule); it returns the step's decode entries
as (rids, offsets, tokens per decode or None when each is 1, tokens in all). Schedule() calls `plan` once
per step, before the prefill phases; complete() calls `after_step` before the step's effects apply.

Source: iteration-level scheduling with decodes first (Orca, Yu et al., OSDI'22; Sarathi-Serve, Agrawal
et al., OSDI'24); speculative tokens counted at schedule time and taken back on rejection as vLLM v1's
scheduler counts them; the names are this project's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import SchedulerStateError
from stallfree.core.request import RequestStatus

if TYPE_CHECKING:
    from stallfree.core.kv.protocol import KVManager
    from stallfree.core.live import DecodeSet, LiveRequest
    from stallfree.core.plan import StepPlan
    from stallfree.core.policies import DecodeSelection

__all__ = ["DecodeEntries", "DecodeHost", "PlainDecodes", "SpeculativeDecodes"]

_DECODING = RequestStatus.DECODING

#: A step's decode entries: (rids, offsets, tokens per decode or None when each is 1, tokens in all).
DecodeEntries = tuple[tuple[Hashable, ...], tuple[int, ...], tuple[int, ...] | None, int]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class DecodeHost:
    """The narrow view of the scheduler a decode strategy acts through; made once, nothing in it changes
    per step (the collections are the scheduler's own, so the view stays current).

    Attributes:
        decodes: the DecodeSet of the ready decodes (core/live.py), in batch order.
        kv: the KV manager (core/kv/); a strategy asks it `promise_decode_blocks(step)` and, for draft
            tokens that never preempt, `grow(rec, tokens, step)`.
        live: rid -> record of every live request (read only).
        grow(rec, tokens, step, victims) -> bool: the KV for `tokens` tokens of a running request,
            preempting by the victim rule (victims appended) while blocks are short; False when it was
            its own victim.
        selection: the decode-overflow hook: select(costs, budget, order) -> the indices that run.
        priority_key(rec) or None: the queue key that orders an overflow under policy="priority".
        multi: several partial prefills (prompts may finish out of admission order, so a promise that
            fails is served in batch order, not admission order).
        holds_every_token: the KV manager's optional `holds_every_token` (False when it has none): its
            admission already holds the KV of every token a request computes, so `grow` always answers
            True and `trim` changes nothing, and a speculative step asks neither once per decode.
    """

    __slots__ = ("decodes", "kv", "live", "grow", "selection", "priority_key", "multi", "holds_every_token")

    def __init__(
        self, decodes: DecodeSet, kv: KVManager, live: Mapping[Hashable, LiveRequest],
        grow: Callable[[LiveRequest, int, int, list[LiveRequest]], bool], selection: DecodeSelection,
        priority_key: Callable[[LiveRequest], tuple[float, ...]] | None, multi: bool,
    ) -> None:
        self.decodes, self.kv, self.live, self.grow = decodes, kv, live, grow
        self.selection, self.priority_key, self.multi = selection, priority_key, multi
        self.holds_every_token = bool(getattr(kv, "holds_every_token", False))


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PlainDecodes:
    """Contract step 1: one token for every ready decode, oldest admitted first, up to the budget.

    Attributes:
        skipped: the ready decodes the overflow rule left out of the plan in flight (their KV does not
            grow in it); emptied when the next step is planned or this one completes.
    """

    #: Tokens every decode is priced at beyond its one (SpeculativeDecodes: num_spec_tokens).
    num_spec_tokens = 0

    def __init__(self) -> None:
        self.skipped: list[LiveRequest] = []

    def plan(self, s: DecodeHost, budget: int, step: int, victims: list[LiveRequest]) -> DecodeEntries:
        """The decode entries of step `step` within `budget` tokens, each with the KV of its tokens
        (preempted requests appended to `victims` and left out)."""
        dec = s.decodes
        if self.skipped:
            self.skipped = []
        if len(dec.recs) <= budget:
            short = s.kv.promise_decode_blocks(step)
            if short:
                # In decode order, as _with_blocks and the checker: with K > 1 prompts may finish out of
                # admission order, so the decode list is then not in admission order.
                order: Callable[[LiveRequest], int] = _by_admission
                if s.multi:
                    pos = {id(o): i for i, o in enumerate(dec.recs)}
                    order = lambda o: pos[id(o)]  # noqa: E731
                for obj in sorted(short, key=order):
                    if obj.status is _DECODING:  # not a victim of an older decode in this loop
                        s.grow(obj, obj.offset + step + 1, step, victims)
        if dec._stale or dec._dirty:
            rids, offsets = dec.tuples()
        else:
            rids, offsets = dec._rids_t, dec._offsets_t
        n = len(rids)
        if n <= budget:
            return rids, offsets, None, n
        return self._with_blocks(s, *self._overflow(s, (1,) * n, budget), step, victims)

    def _with_blocks(
        self, s: DecodeHost, rids: tuple[Hashable, ...], offsets: tuple[int, ...], costs: tuple[int, ...] | None,
        total: int, step: int, victims: list[LiveRequest],
    ) -> DecodeEntries:
        """When decodes did not all get one token: each chosen decode, oldest first, gets the KV of its
        tokens, preempting as needed; victims leave the plan."""
        if s.holds_every_token:  # every grow would answer True: no victim, nothing to ask per decode
            return rids, offsets, costs, total
        live = s.live
        tokens = costs or (1,) * len(rids)
        for rid, off, c in zip(rids, offsets, tokens, strict=True):
            obj = live[rid]
            if obj.status is _DECODING:
                s.grow(obj, off + step + c, step, victims)
        if not victims:
            return rids, offsets, costs, total
        keep = [i for i, rid in enumerate(rids) if live[rid].status is _DECODING]
        rids = tuple(rids[i] for i in keep)
        offsets = tuple(offsets[i] for i in keep)
        kept = tuple(tokens[i] for i in keep)
        return rids, offsets, kept if costs else None, sum(kept)

    def _overflow(
        self, s: DecodeHost, costs: tuple[int, ...], budget: int, recs: list[LiveRequest] | None = None,
        rids: tuple[Hashable, ...] | None = None, offsets: tuple[int, ...] | None = None,
    ) -> tuple[tuple[Hashable, ...], tuple[int, ...], tuple[int, ...] | None, int]:
        """Ready decodes exceed the budget: the selection hook picks who runs; the rest skip a step.
        `recs`, `rids`, `offsets`: the ready decodes when not all of the decode set (held ones left out)."""
        if recs is None:
            recs = s.decodes.recs
        order = None
        key = s.priority_key
        if key is not None:
            order = sorted(range(len(costs)), key=lambda i: key(recs[i]))
        chosen = s.selection.select(costs, budget, order)
        picked = set(chosen)
        self.skipped = [o for i, o in enumerate(recs) if i not in picked]
        if rids is None or offsets is None:
            rids, offsets = s.decodes.offsets_at(chosen)
        else:
            rids, offsets = tuple(rids[i] for i in chosen), tuple(offsets[i] for i in chosen)
        tokens = tuple(costs[i] for i in chosen)
        return rids, offsets, tokens if self.num_spec_tokens else None, sum(tokens)

    def validate_accepted(
        self, plan: StepPlan, num_accepted: Mapping[Hashable, object], live: Mapping[Hashable, LiveRequest]
    ) -> list[tuple[LiveRequest, int]]:
        """Check complete(num_accepted=) against `plan`: each rid decoded in it, each count an integer from
        1 to its entry's tokens; return the decodes whose progress is not one token, with their counts.

        Raises:
            SchedulerStateError: a rid that did not decode in `plan`, or a count out of range; nothing changes.
        """
        tokens = dict(zip(plan.decode_rids, plan._decode_tokens or (1,) * plan.num_decodes, strict=True))
        out = []
        for rid, n in num_accepted.items():
            cost = tokens.get(rid)
            if cost is None:
                raise SchedulerStateError(f"num_accepted names rid {rid!r}, which did not decode in step {plan.step}")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cost:
                raise SchedulerStateError(f"num_accepted[{rid!r}] = {n!r}, must be an integer from 1 to {cost}")
            if n > 1 or (cost > 1 and not self.num_spec_tokens):
                out.append((live[rid], n))  # a decode with drafts that is named has its verdict
        return out

    def after_step(self, s: DecodeHost, plan: StepPlan, accepted: list[tuple[LiveRequest, int]], step: int) -> None:
        """Before complete() applies `plan`: move the progress of skipped decodes back a step and of
        decodes that emitted `accepted` tokens forward, telling the KV manager of each (`moved`); `step`
        is the number of the next step."""
        if self.skipped or accepted:
            kv = s.kv
            shifts = [(o, -1) for o in self.skipped] + [(o, n - 1) for o, n in accepted]
            for obj, delta in shifts:
                s.decodes.shift(obj, delta)
                kv.moved(obj, step)
            self.skipped = []

    def forget(self, obj: LiveRequest) -> None:
        """`obj` stops running with drafts set or unsettled (none here: a plain phase gives no drafts)."""


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class SpeculativeDecodes(PlainDecodes):
    """Contract step 1 with speculative tokens: every decode priced at 1 + num_spec_tokens (at most its
    tokens left and the budget), or, with num_spec_tokens = 0, each decode's draft tokens of
    Scheduler.set_draft_tokens after every decode's one token (drafts never preempt).

    Args:
        num_spec_tokens: tokens of every decode's verification pass beyond its one, >= 0.

    Attributes:
        drafted: rid -> record of the decodes with draft tokens set for the next step.
        held: the decodes at their last token whose drafts are unsettled (they wait for take_back()).
    """

    def __init__(self, num_spec_tokens: int = 0) -> None:
        super().__init__()
        self.num_spec_tokens = num_spec_tokens
        self.drafted: dict[Hashable, LiveRequest] = {}
        self.held: list[LiveRequest] = []

    def plan(self, s: DecodeHost, budget: int, step: int, victims: list[LiveRequest]) -> DecodeEntries:
        """The decode entries of step `step`: with drafts or held decodes, every decode's one token then
        the drafts; else every decode priced at 1 + num_spec_tokens (the overflow rule when over budget)."""
        if self.drafted or self.held:
            if self.skipped:
                self.skipped = []
            out = self._draft_entries(s, budget, step, victims)
            for obj in self.drafted.values():  # draft tokens are for one step
                obj.drafts = 0
            self.drafted = {}
            return out
        k = self.num_spec_tokens
        if not k:
            return super().plan(s, budget, step, victims)
        if self.skipped:
            self.skipped = []
        dec = s.decodes
        rids, offsets = dec.tuples() if dec._stale or dec._dirty else (dec._rids_t, dec._offsets_t)
        # The verification pass never goes past max_new, and a decode never costs more than the budget.
        costs, total = dec.spec_costs(min(k, budget - 1), step)
        if total > budget:
            return self._with_blocks(s, *self._overflow(s, costs, budget), step, victims)
        return self._with_blocks(s, rids, offsets, costs, total, step, victims)

    def _draft_entries(self, s: DecodeHost, budget: int, step: int, victims: list[LiveRequest]) -> DecodeEntries:
        """Contract step 1 with draft tokens (set_draft_tokens) or held decodes: one token for every
        ready decode that is not held (the overflow rule when they exceed the budget), each with its KV
        (preempting as without drafts); then, in batch order, each decode's drafts from what is left:
        min(its drafts, the budget left, limit - generated - 1) of them, fewer when the KV manager
        cannot hold them without a preemption (drafts never preempt)."""
        dec = s.decodes
        rids, offsets = dec.tuples()
        recs = dec.recs
        if self.held:
            held = {id(o) for o in self.held}
            keep = [i for i, o in enumerate(recs) if id(o) not in held]
            rids = tuple(rids[i] for i in keep)
            offsets = tuple(offsets[i] for i in keep)
            recs = [recs[i] for i in keep]
        n = len(rids)
        if n <= budget:
            out = self._with_blocks(s, rids, offsets, None, n, step, victims)
        else:
            out = self._with_blocks(s, *self._overflow(s, (1,) * n, budget, recs, rids, offsets), step, victims)
        if self.held:
            self.skipped = self.skipped + [o for o in self.held if o.status is _DECODING]
        rids, offsets, costs, used = out
        drafted = self.drafted
        left = budget - used
        if not drafted or left <= 0:
            return out
        kv = s.kv
        tokens = list(costs or (1,) * len(rids))
        granted = False
        for i, rid in enumerate(rids):
            obj = drafted.get(rid)
            if obj is None:
                continue
            d = min(obj.drafts, left, obj.limit - obj.num_output_tokens - 1)
            start = offsets[i] + step + tokens[i]
            while d > 0 and not kv.grow(obj, start + d, step):
                d -= 1
            if d > 0:
                tokens[i] += d
                left -= d
                granted = True
                if not left:
                    break
        if not granted:
            return out
        return rids, offsets, tuple(tokens), budget - left

    def set_drafts(self, obj: LiveRequest, num_drafts: int) -> None:
        """Give decode `obj` `num_drafts` draft tokens for the next step (0 clears them)."""
        obj.drafts = num_drafts
        if num_drafts:
            self.drafted[obj.rid] = obj
        else:
            self.drafted.pop(obj.rid, None)

    def after_step(self, s: DecodeHost, plan: StepPlan, accepted: list[tuple[LiveRequest, int]], step: int) -> None:
        """PlainDecodes.after_step; first, draft tokens without a verdict count as accepted, provisionally,
        until take_back(); last, the KV of rejected speculative tokens goes back (`trim`)."""
        costs = plan._decode_tokens
        live = s.live
        if costs and not self.num_spec_tokens:
            named = {id(o) for o, _ in accepted}
            for rid, c in zip(plan.decode_rids, costs, strict=True):
                if c > 1:
                    obj = live[rid]
                    if id(obj) not in named:
                        accepted.append((obj, c))
                        obj.unsettled = (*obj.unsettled, c - 1)
        super().after_step(s, plan, accepted, step)
        if costs and not s.holds_every_token:
            kv = s.kv
            for rid, c in zip(plan.decode_rids, costs, strict=True):
                if c > 1:
                    obj = live[rid]
                    kv.trim(obj, obj.offset + step)

    def hold(self, obj: LiveRequest) -> None:
        """`obj` reached its last token with drafts unsettled: it stays, unscheduled, until take_back()."""
        if all(o is not obj for o in self.held):
            self.held.append(obj)

    def is_held(self, obj: LiveRequest) -> bool:
        """Whether `obj` waits, unscheduled, for the verdicts of its drafts."""
        return any(o is obj for o in self.held)

    def release(self, obj: LiveRequest) -> None:
        """`obj` is no longer held."""
        if self.held:
            self.held = [o for o in self.held if o is not obj]

    def forget(self, obj: LiveRequest) -> None:
        """`obj` stops running (finish, abort, preemption): its drafts, set or unsettled, are dropped."""
        obj.drafts = 0
        obj.unsettled = ()
        self.drafted.pop(obj.rid, None)
        self.release(obj)


def _by_admission(obj: LiveRequest) -> int:
    return obj.admit_seq
