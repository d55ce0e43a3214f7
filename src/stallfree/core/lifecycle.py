"""What every scheduler of the core shares: a request's life from add() to its report as finished.

Imports allowed: the standard library and stallfree.core only.

Both Scheduler (KV reserved at admission) and PagedScheduler (KV blocks as tokens arrive) keep live
requests by rid, hand out one plan at a time, defer an abort of a request in the plan in flight to
complete(), remember recently finished rids so that abort() of one is a no-op, and apply an executed
step in the same order: prefill progress and first tokens, early stops, finishes due at the step, then
deferred aborts. RequestLifecycle holds that order once; subclasses plan steps and supply the hooks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import RequestRejected, SchedulerStateError
from stallfree.core.live import LiveRequest, position_of
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request, RequestState, RequestStatus

__all__ = ["RequestLifecycle", "end_reason", "position_of"]

_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_DECODING = RequestStatus.DECODING
_FINISHED = RequestStatus.FINISHED
_ABORTED = RequestStatus.ABORTED

# How many finished rids are remembered so that abort() of a request that just finished is a no-op
# rather than a KeyError; bounded so that a long-running server does not grow.
RECENT_FINISHED = 4096


def end_reason(obj: Any) -> FinishReason:
    """Why a request that generated all its tokens ended: "length" at max_new, "stop" at a stop_after()."""
    return FinishReason.LENGTH if obj.limit == obj.max_new else FinishReason.STOP


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class RequestLifecycle:
    """Base of the core's schedulers: add, abort and complete, around the hooks a subclass supplies.

    A subclass calls `_init_lifecycle()` in its constructor, keeps its waiting requests in
    `self._waiting` (append/remove/len), and implements:

    - optionally `_before_apply(plan, accepted) -> due key`, for progress that is not one token per
      step (skipped or speculative decodes, or decode steps counted apart from steps);
    - `_check_fits(req) -> Any`: raise RequestRejected if `req` can never fit; return what admission
      will need (tokens or blocks), handed to `_new_live`;
    - `_new_live(req, need) -> record`: the scheduler's own record, with at least `rid`, `status`,
      `num_prefilled` and `finish_step`;
    - `_decoded_in(record, plan) -> bool`: the record ran a decode in `plan`;
    - `_first_token(record, step)`: its last prefill chunk sampled a token;
    - `_leave_running(record)`: it stops running (finish, stop or abort): free its KV and slot;
    - `_num_generated(record)`: tokens it has emitted so far (for request_state).

    Records are mutated by their scheduler only and compared by identity.
    """

    _waiting: Any

    def _init_lifecycle(self) -> None:
        self._live: dict[Hashable, Any] = {}
        self._num_running = 0
        self._due: dict[int, list[Any]] = {}
        self._step = 0
        self._inflight: StepPlan | None = None
        self._inflight_aborts: set[Hashable] = set()
        self._recent_finished: dict[Hashable, None] = {}
        self.last_finished: dict[Hashable, FinishReason] = {}

    # ------------------------------------------------------------------ public state

    @property
    def num_waiting(self) -> int:
        """Requests added and not running (never admitted, or preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests that have not finished (prefilling or decoding)."""
        return self._num_running

    @property
    def step(self) -> int:
        """The number of the next step to be scheduled (steps count from 0)."""
        return self._step

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._live)

    def has_request(self, rid: Hashable) -> bool:
        """True while `rid` is live here: added and neither finished (reported by complete()) nor aborted.
        `rid in scheduler` asks the same (Scheduler keeps only that spelling; this one is its deprecated
        alias there). O(1)."""
        return rid in self._live

    def __contains__(self, rid: object) -> bool:
        """`rid in scheduler`: True while `rid` is live here: added and neither finished (reported by
        complete()) nor aborted. O(1)."""
        try:
            return rid in self._live
        except TypeError:  # an unhashable value is never a rid
            return False

    def waiting_order(self) -> tuple[Hashable, ...]:
        """The rids of the waiting requests (never admitted, or preempted) in the order admission takes them,
        head first: add order with add(front=True) and preempted requests in front under policy="fcfs", the
        effective priority then add order under "priority" (read at the scheduler's current clock reading).
        A read-only copy: O(waiting), O(waiting log waiting) under "priority"."""
        return tuple(o.rid for o in self._waiting.in_order())

    def peek_waiting(self) -> Hashable | None:
        """The rid at the head of the waiting queue (the request admission tries first), or None when none
        waits: waiting_order()[0] without the copy; O(1) under policy="fcfs", O(waiting) under "priority"."""
        obj = self._waiting.head()
        return None if obj is None else obj.rid

    def _find(self, rid: object) -> Any:
        """The record of live request `rid`, or None: never added, finished, or not hashable (never a rid)."""
        try:
            return self._live.get(rid)
        except TypeError:
            return None

    def _finished_recently(self, rid: object) -> bool:
        """Whether `rid` finished recently enough to be remembered (abort() of it is then a no-op)."""
        try:
            return rid in self._recent_finished
        except TypeError:
            return False

    def _live_request(self, rid: Hashable) -> LiveRequest:
        """The record of live request `rid`; KeyError naming it when it is not live."""
        obj: LiveRequest | None = self._find(rid)
        if obj is None:
            raise KeyError(f"no live request with rid {rid!r}")
        return obj

    def request_state(self, rid: Hashable) -> RequestState:
        """Return a snapshot of a live (waiting or running) request.

        Raises:
            KeyError: `rid` is not live (never added, or already reported finished).
        """
        obj = self._live_request(rid)
        return RequestState(
            rid=rid,
            status=obj.status,
            num_prefilled=obj.num_prefilled,
            num_generated=self._num_generated(obj),
            admitted_step=obj.admitted_step,
            first_token_step=obj.first_token_step,
            num_preemptions=getattr(obj, "num_preemptions", 0),
            num_lora_passes=getattr(obj, "lora_passes", 0),
        )

    # ------------------------------------------------------------------ add / abort

    def add(self, req: Request, *, front: object = False) -> None:
        """Queue a request at the back of the waiting queue (front=True: at its front).

        Args:
            req: the request.
            front: True: ahead of every waiting request, as the scheduler queues the requests it
                preempts itself; for an engine that preempted a running request on its own (aborted it
                here) and queues it again with the tokens it has. Only under policy="fcfs" (a priority
                queue is ordered by its key).

        Raises:
            RequestRejected: `req` is not a Request, a field is out of range (Request.validate), its
                rid is already live, it can never fit in the KV cache (the message gives the
                numbers), front is not a bool, or front=True under another policy than "fcfs";
                nothing is queued.
        """
        if not isinstance(req, Request):
            raise RequestRejected(f"add() takes a Request, got {type(req).__name__}: {req!r}")
        if front is not False:
            self._check_front(front)
        req.validate()
        if req.rid in self._live:
            raise RequestRejected(f"rid {req.rid!r} is already live (waiting or running)")
        obj = self._new_live(req, self._check_fits(req))
        self._recent_finished.pop(req.rid, None)
        self._live[req.rid] = obj
        if front:
            self._queue_front(obj)
        else:
            self._waiting.append(obj)

    def stop_after(self, rid: Hashable, num_tokens: object) -> None:
        """End a waiting request with reason "stop" once it has generated `num_tokens` tokens.

        For a caller that knows a request's output length in advance (the simulator replaying a trace
        whose outputs are shorter than max_new): the request then ends exactly as if complete() had
        been told of its stop on that token, without the caller tracking its progress. KV is still
        counted for max_new (the reservation, or the most blocks it may hold).

        Args:
            rid: a live request that has not been admitted yet.
            num_tokens: tokens it generates, 1 to its max_new.

        Raises:
            KeyError: `rid` is not live.
            SchedulerStateError: it was admitted already, or num_tokens is not an integer from 1 to
                max_new; nothing changes.
        """
        obj = self._find(rid)
        if obj is None:
            raise KeyError(f"stop_after(): unknown rid {rid!r}")
        if obj.status is not _WAITING:
            raise SchedulerStateError(f"stop_after(): rid {rid!r} was admitted already ({obj.status.name})")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= obj.max_new:
            raise SchedulerStateError(
                f"stop_after(): num_tokens must be an integer from 1 to max_new = {obj.max_new}, got {num_tokens!r}"
            )
        obj.limit = num_tokens

    def abort(self, rid: Hashable) -> None:
        """Remove a waiting or running request and release its KV.

        A request in the plan handed out and not yet completed is removed at that complete() (the
        engine may still be writing its KV) and emits nothing more. A request that already
        finished is a no-op.

        Raises:
            KeyError: `rid` was never added (or finished too long ago to be remembered).
        """
        obj = self._find(rid)
        if obj is None:
            if self._finished_recently(rid):
                return
            raise KeyError(f"abort(): unknown rid {rid!r}")
        plan = self._inflight
        if plan is not None and self._in_plan(obj, plan):
            self._inflight_aborts.add(rid)
            return
        if obj.status is _WAITING or obj.status is _PREEMPTED:
            self._waiting.remove(obj)
            self._forget(obj, _ABORTED)
        else:
            self._finish(obj, FinishReason.ABORT, report=False)

    # ------------------------------------------------------------------ complete

    def complete(
        self,
        plan: StepPlan,
        stopped: Iterable[Hashable] = (),
        num_accepted: Mapping[Hashable, int] | None = None,
    ) -> tuple[Hashable, ...]:
        """Apply an executed step: advance prefills, emit tokens, finish and release requests.

        Args:
            plan: the plan returned by the last schedule().
            stopped: rids that sampled a token in `plan` and whose token ended them (EOS, a stop
                string); they finish now with reason "stop" and their KV is released.
            num_accepted: with speculative decode tokens, tokens each decode emitted (1 to its
                entry's tokens). A decode not named emitted 1 under num_spec_tokens; one that ran draft
                tokens (set_draft_tokens) and is not named counts all its tokens provisionally, until
                take_back() settles them.

        Returns:
            The rids that emitted a token this step, in batch order (requests aborted while the
            plan was in flight emit nothing). Which of them finished, and why, is in
            `self.last_finished` until the next complete().

        Raises:
            SchedulerStateError: `plan` is not the plan in flight (stale, foreign or completed
                twice), `stopped` is a string or not iterable, a rid in it did not sample a token in
                `plan`, or num_accepted is not a mapping or not valid for `plan`; nothing changes.
        """
        # The plan in flight is a StepPlan: anything else (None included) is not it.
        if plan is not self._inflight or plan is None:
            what = f"step {plan.step}" if isinstance(plan, StepPlan) else repr(plan)
            held = "none" if self._inflight is None else f"step {self._inflight.step}"
            why = "stale, completed already, or from another scheduler"
            if isinstance(plan, StepPlan) and self._inflight is not None and plan.step == self._inflight.step:
                why = "the same step of another scheduler, or of the one a snapshot() was copied from"
            raise SchedulerStateError(f"complete() takes the plan in flight ({held}); got another plan ({what}): {why}")
        if stopped.__class__ is not tuple:
            if isinstance(stopped, (str, bytes)):
                raise SchedulerStateError(f"stopped must be an iterable of rids, not a string: {stopped!r}")
            if not isinstance(stopped, Iterable):
                raise SchedulerStateError(f"stopped must be an iterable of rids, got {stopped!r}")
        if num_accepted is not None and not isinstance(num_accepted, Mapping):
            raise SchedulerStateError(f"num_accepted must be a mapping of rid to tokens emitted, got {num_accepted!r}")
        stopped_objs = self._validate_stopped(plan, stopped) if stopped else []
        accepted = self._validate_accepted(plan, num_accepted) if num_accepted else []
        step = plan.step
        self._inflight = None
        self._step = step + 1
        self.last_finished = {}
        if plan.timed_out:
            for rid in plan.timed_out:
                self.last_finished[rid] = FinishReason.TIMEOUT
        due_key = self._before_apply(plan, accepted)
        last_rids: list[Hashable] = []
        for chunk in plan.prefills:
            obj = self._live[chunk.rid]
            obj.num_prefilled += chunk.num_tokens
            if not chunk.is_last:
                continue
            last_rids.append(chunk.rid)
            self._first_token(obj, step)
            if stopped_objs and obj.status is _FINISHED and any(o is obj for o in stopped_objs):
                # A stop on the last allowed token is "stop", from a prefill chunk as from a decode.
                self.last_finished[obj.rid] = FinishReason.STOP
        for obj in stopped_objs:
            if obj.status is not _FINISHED:
                self._finish(obj, FinishReason.STOP)
        due = self._due.pop(due_key, None) if due_key is not None else None
        if due:
            for obj in due:
                if obj.status is _DECODING and obj.finish_step == due_key:
                    if obj.unsettled:  # its last token may be a draft still to be taken back
                        self._hold(obj)
                    else:
                        self._finish(obj, end_reason(obj))
        emitted = plan.decode_rids + tuple(last_rids) if last_rids else plan.decode_rids
        aborts = self._inflight_aborts
        if aborts:
            for rid in aborts:
                aborted = self._live.get(rid)
                if aborted is not None:
                    self._finish(aborted, FinishReason.ABORT)
                else:
                    self.last_finished[rid] = FinishReason.ABORT
            emitted = tuple(r for r in emitted if r not in aborts)
            self._inflight_aborts = set()
        return emitted

    # ------------------------------------------------------------------ shared internals

    def _validate_stopped(self, plan: StepPlan, stopped: Iterable[Hashable]) -> list[Any]:
        if not stopped:
            return []
        objs = []
        for rid in stopped:
            obj = self._find(rid)
            if obj is None or not self._sampled_in(obj, plan):
                raise SchedulerStateError(
                    f"stopped names rid {rid!r}, which did not sample a token in step {plan.step}"
                )
            objs.append(obj)
        return objs

    def _validate_accepted(self, plan: StepPlan, num_accepted: Mapping[Hashable, int]) -> list[tuple[Any, int]]:
        """Check num_accepted against `plan`; only schedulers with speculative tokens accept it."""
        raise SchedulerStateError(f"num_accepted given, but {type(self).__name__} has no speculative tokens")

    def _before_apply(self, plan: StepPlan, accepted: list[tuple[Any, int]]) -> int | None:
        """Update derived decode progress for an executed step, before its effects are applied.

        Returns:
            The key under which the decodes whose last token came out of this step were filed in
            `self._due` (and which their `finish_step` equals): the step number by default; None
            when no decode ran.
        """
        return plan.step

    def _hold(self, obj: Any) -> None:
        """A decode reached its last token through drafts not yet settled: it waits for take_back()."""
        raise SchedulerStateError(f"{type(self).__name__} has no draft tokens to settle for {obj.rid!r}")

    def _sampled_in(self, obj: Any, plan: StepPlan) -> bool:
        return self._decoded_in(obj, plan) or any(c.rid == obj.rid and c.is_last for c in plan.prefills)

    def _in_plan(self, obj: Any, plan: StepPlan) -> bool:
        return self._decoded_in(obj, plan) or any(c.rid == obj.rid for c in plan.prefills)

    def _finish(self, obj: Any, reason: FinishReason, report: bool = True) -> None:
        """Release a running request and forget it; `report` lists it in last_finished."""
        self._leave_running(obj)
        self._forget(obj, _ABORTED if reason is FinishReason.ABORT else _FINISHED)
        if report:
            self.last_finished[obj.rid] = reason

    def _forget(self, obj: Any, status: RequestStatus) -> None:
        obj.status = status
        del self._live[obj.rid]
        recent = self._recent_finished
        recent[obj.rid] = None
        if len(recent) > RECENT_FINISHED:
            del recent[next(iter(recent))]

    # ------------------------------------------------------------------ hooks

    def _check_front(self, front: object) -> None:
        """Raise RequestRejected unless add(front=front) is allowed (front is not False)."""
        raise RequestRejected(f"add(): front=True is not supported by {type(self).__name__}")

    def _queue_front(self, obj: Any) -> None:
        raise NotImplementedError

    def _check_fits(self, req: Request) -> Any:
        raise NotImplementedError

    def _new_live(self, req: Request, need: Any) -> Any:
        raise NotImplementedError

    def _decoded_in(self, obj: Any, plan: StepPlan) -> bool:
        raise NotImplementedError

    def _first_token(self, obj: Any, step: int) -> None:
        raise NotImplementedError

    def _leave_running(self, obj: Any) -> None:
        raise NotImplementedError

    def _num_generated(self, obj: Any) -> int:
        raise NotImplementedError
