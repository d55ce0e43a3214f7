"""Disaggregated prefill and decode: P prefill replicas and D decode replicas in one event loop.

Imports allowed: the standard library, stallfree.core and stallfree.sim (its stdlib modules only).

A request's life (times on the one simulated clock):
  1. It arrives and is routed to a prefill replica. There it is a request of prompt_len tokens and
     one output token: its prefill (in chunks, batched with other prefills) emits the first token.
     TTFT = that step's end - arrival (the prefill queue and compute).
  2. Its prompt's KV (prompt_len x kv_bytes_per_token bytes) crosses the link to a decode replica:
     transfer time = link.latency_s + bytes / link.bandwidth_bytes_per_s. The prefill replica keeps
     the KV until the transfer ends: its admission counts those tokens as taken.
  3. At the transfer's end it is routed to a decode replica, where it generates its remaining
     target - 1 tokens. The decode scheduler sees it as a 1-token "prompt" (feeding the first
     token, which costs a decode's work) plus target - 1 tokens to generate; the cluster's
     admission there counts prompt_len + target tokens of KV, and the decode side's cost model is
     shown each decode's true context (prompt_len more than the scheduler's count). TPOT and ITL
     come from the decode side (the gap between the first token and the second includes the
     transfer and the decode queue).
A request with a single output token finishes at step 1 and transfers nothing.

Admission gate. Each replica admits requests from its queue in arrival order while the KV they
need (prefill: prompt_len + 1; decode: prompt_len + target), plus the KV held for transfers, fits
its kv_total; a request that can never fit is rejected ("kv_capacity"). Each replica's recorded KV
per step (SimResult.step_kv_used, its steps CSV, its timeline line and KV utilization) is this
gate's count at the step's end: the decode side's scheduler alone would count a request from its
first token, and the prefill side's would drop a prompt's KV before its transfer ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from stallfree.core.errors import RequestRejected
from stallfree.core.metrics import RequestTimeline
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig, make_scheduler, wrap_checker
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.disagg_link import DEFAULT_INTERCONNECT, INTERCONNECTS, Interconnect
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, Router, route_to
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    ClusterError,
    RequestState,
    SchedulerLike,
    SimResult,
    verify_tokens,
)
from stallfree.sim.run.routers import LeastOutstandingRouter
from stallfree.sim.run.simulator import context_overflows, new_result

__all__ = [
    "DisaggResult",
    "parse_disaggregate",
    "simulate_disaggregated",
]


def parse_disaggregate(text: str) -> tuple[int, int]:
    """Parse "P:D" (prefill replicas, decode replicas), each an integer >= 1.

    Raises:
        ClusterError: not two integers >= 1 separated by ':'; the message names the value.
    """
    parts = text.split(":")
    try:
        p, d = (int(x) for x in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        p, d = 0, 0
    if p < 1 or d < 1:
        raise ClusterError(f"`disaggregate` wants P:D with P, D >= 1 replicas, got {text!r}")
    return p, d


class _ShiftedCost:
    """Prices a decode replica's plans with each request's true context: its scheduler counts a
    request from its first output token, so every decode's and chunk's start is `offset[rid]` tokens
    (the request's prompt length) short.

    A cost model may read the decodes' contexts one by one (the kernel tables' decode attention reads
    `decode_offsets` + step, the roofline only `decode_context_sum`), so both are shifted: each
    decode's offset gains its request's prompt length. The shifted offsets are rebuilt only when the
    scheduler's tuple changes (by identity, as StepPlan.decode_offsets promises), so a cost model's
    per-tuple caches keep working.
    """

    def __init__(self, inner: StepCostModel, offset: dict[Hashable, int]) -> None:
        self.inner, self.offset = inner, offset
        self._key: tuple[int, ...] | None = None
        self._offs: tuple[int, ...] = ()
        self._sorted: tuple[int, ...] = ()
        self._sum = 0

    def step_time(self, plan: StepPlan) -> float:
        """The inner model's time for the plan with every start shifted by its request's prompt, s."""
        if plan.decode_offsets is not self._key:
            self._key = plan.decode_offsets
            self._offs = tuple(o + self.offset[r] for r, o in zip(plan.decode_rids, self._key, strict=True))
            self._sorted = tuple(sorted(self._offs))
            self._sum = sum(self.offset[r] for r in plan.decode_rids)
        prefills = tuple(
            type(c)(c.rid, c.num_tokens, c.is_prefill, c.start + self.offset[c.rid], c.is_last) for c in plan.prefills
        )
        shifted = StepPlan(
            plan.step, plan.decode_rids, self._offs, prefills, plan.num_tokens,
            plan.decode_context_sum + self._sum, plan.token_budget, plan.admitted, plan.preempted,
            decode_tokens=plan.decode_tokens, decode_offsets_sorted=self._sorted,
        )
        return self.inner.step_time(shifted)


@dataclass(slots=True)
class DisaggResult:
    """One disaggregated simulation.

    Attributes:
        prefill: one SimResult per prefill replica (rid = workload position; each request has one
            output token there).
        decode: one SimResult per decode replica (prompt_len 1: the first token; target - 1 tokens).
        prefill_of / decode_of: per request, its replica on each side (-1: none).
        transfer_start / transfer_end: per request, s (nan: no transfer).
        timelines: one stallfree.core.metrics.RequestTimeline per finished request, across both sides.
        rejected: (rid, reason) of the requests refused; rejected_kind: rid -> kind.
        link: the interconnect; kv_bytes_per_token: bytes moved per prompt token.
        wall_s: wall time of the loop, s.
        max_new / target: per request, its token cap and the tokens it generates (min of its
            output length and max_new); empty when built by hand without them.
        arrival: per request, when it arrived, s (under closed-loop load, when it was sent); empty
            when built by hand (the workload's arrivals are used).
        frontend_s: the engine profile's front end (the prefill side's cost model's `frontend_s`, s),
            added to each request's TTFT and E2E in `timelines` and the records, as a single run's
            report adds it: the client's view (its timelines' arrival is the client's send time,
            `frontend_s` before the engine sees the request).
    """

    prefill: list[SimResult]
    decode: list[SimResult]
    prefill_of: list[int]
    decode_of: list[int]
    transfer_start: list[float]
    transfer_end: list[float]
    timelines: list[Any]
    rejected: list[tuple[int, str]]
    rejected_kind: dict[int, str]
    link: Interconnect
    kv_bytes_per_token: int
    wall_s: float
    max_new: list[int] = field(default_factory=list)
    target: list[int] = field(default_factory=list)
    arrival: Sequence[float] = ()
    frontend_s: float = 0.0


def simulate_disaggregated(
    workload: Workload, prefill_scheduler: ReplicaConfig | Callable[[], SchedulerLike],
    decode_scheduler: ReplicaConfig | Callable[[], SchedulerLike], prefill_cost: StepCostModel,
    decode_cost: StepCostModel, num_prefill: int, num_decode: int, kv_bytes_per_token: int,
    link: Interconnect | None = None, prefill_router: Router | None = None, decode_router: Router | None = None,
    max_tokens: int | None = None, check: bool = False, max_model_len: int | None = None,
    closed_loop: ClosedLoop | None = None,
) -> DisaggResult:
    """Replay `workload` on `num_prefill` prefill and `num_decode` decode replicas (module docstring).

    Args:
        workload: the requests.
        prefill_scheduler, decode_scheduler: each side's scheduler (config or factory), with its KV
            capacity (kv_total, tokens) for the admission gate.
        prefill_cost, decode_cost: each side's step pricing, s.
        num_prefill, num_decode: replicas on each side, >= 1.
        kv_bytes_per_token: KV bytes per prompt token moved by a transfer, >= 0.
        link: the interconnect (default INTERCONNECTS[DEFAULT_INTERCONNECT]).
        prefill_router, decode_router: default LeastOutstandingRouter() each.
        max_tokens, check, max_model_len: as simulate.
        closed_loop: as simulate: `concurrency` requests in flight, a request ending at its last
            token (on the decode side, or the prefill side for a one-token output) or its refusal.

    Returns:
        A DisaggResult.

    Raises:
        ClusterError: a replica count < 1 or kv_bytes_per_token < 0, or a ReplicaConfig with
            async_scheduling (not modelled under disaggregation: its gate hands requests over itself),
            or a session workload (not modelled either).
        SimulationError, InvariantViolation: as simulate.
    """
    _check_counts(num_prefill, num_decode, kv_bytes_per_token)
    if hasattr(workload, "session_ids"):  # a stallfree.sim.inputs.sessions.SessionWorkload
        raise ClusterError("disaggregated prefill and decode do not model sessions in this version: replay "
                           "them on aggregated replicas")
    for side, sc in (("prefill", prefill_scheduler), ("decode", decode_scheduler)):
        if isinstance(sc, ReplicaConfig) and sc.async_scheduling:
            raise ClusterError(f"{side}_scheduler: async_scheduling=True is not modelled under disaggregated "
                               "prefill and decode; give async_scheduling=False")
    link = link or INTERCONNECTS[DEFAULT_INTERCONNECT]
    n = len(workload)
    plens = workload.prompt_lens
    max_new = list(workload.output_lens) if max_tokens is None else [max_tokens] * n
    too_long = context_overflows(workload, max_new, max_model_len, False)
    target = [min(o, m) for o, m in zip(workload.output_lens, max_new, strict=True)]
    arrivals = Arrivals(workload, closed_loop)
    offset: dict[Hashable, int] = {}
    groups = (
        _group("prefill", _side_workload(workload, plens, (1,) * n), prefill_scheduler, prefill_cost, num_prefill,
               max_tokens, check),
        _group("decode", _side_workload(workload, (1,) * n, tuple(max(t - 1, 1) for t in target)), decode_scheduler,
               _ShiftedCost(decode_cost, offset), num_decode, max_tokens, check),
    )
    gate = _Gate(groups, ([p + 1 for p in plens], [p + t for p, t in zip(plens, target, strict=True)]), arrivals)
    hook = _Transfers(groups[1], decode_router or LeastOutstandingRouter(), gate, link, kv_bytes_per_token,
                      target, plens, offset, arrivals)
    entry = Entry(groups[0], prefill_router or LeastOutstandingRouter(),
                  lambda i: Request(i, plens[i], 1, 0, arrivals.times[i]), too_long, arrivals)
    loop = EventLoop([*groups[0], *groups[1]], arrivals, entry, hook, gate)
    hook.loop = loop
    t0 = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - t0
    for rep in loop.replicas:
        _close_side(rep, tuple(arrivals.times) if closed_loop is not None else None, check)
    return _result(workload, groups, entry, gate, hook, wall, max_new, target)


def _side_workload(workload: Workload, prompts: tuple[int, ...], outputs: tuple[int, ...]) -> Workload:
    """The workload one side's schedulers see: the same arrivals, its own prompt and output lengths."""
    return Workload(workload.arrivals, prompts, outputs, workload.name)


def _close_side(rep: Replica, sent: tuple[float, ...] | None, check: bool) -> None:
    """After the loop: a replica's end-of-run checks, and the times requests were sent (closed loop)."""
    if check:
        rep.sched.check_final()  # type: ignore[attr-defined]
    verify_tokens(rep.res)
    if sent is not None:
        rep.res.arrival = sent


def _check_counts(num_prefill: int, num_decode: int, kv_bytes_per_token: int) -> None:
    """Raise ClusterError unless both replica counts are integers >= 1 and kv_bytes_per_token one >= 0."""
    for name, v in (("prefill replicas", num_prefill), ("decode replicas", num_decode)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ClusterError(f"{name} must be an integer >= 1, got {v!r}")
    if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token < 0:
        raise ClusterError(f"kv_bytes_per_token must be an integer >= 0, got {kv_bytes_per_token!r}")


def _result(
    workload: Workload, groups: tuple[list[Replica], list[Replica]], entry: Entry, gate: _Gate,
    hook: _Transfers, wall: float, max_new: list[int], target: list[int],
) -> DisaggResult:
    """The DisaggResult of a finished run: both sides' results, the joined timelines, the rejections."""
    sent = Workload(tuple(entry.arrivals.times), workload.prompt_lens, workload.output_lens, workload.name)
    pre, dec = [r.res for r in groups[0]], [r.res for r in groups[1]]
    prefill_of = list(entry.routed)
    frontend = float(getattr(groups[0][0].cost, "frontend_s", 0.0)) if groups[0] else 0.0
    timelines = _timelines(sent, target, pre, dec, prefill_of, hook.decode_of, frontend)
    rejected = sorted(gate.rejected + entry.refused)
    kinds = dict(gate.kinds) | {rid: CONTEXT_LENGTH for rid, _ in entry.refused}
    return DisaggResult(pre, dec, prefill_of, hook.decode_of, hook.t_start, hook.t_end, timelines, rejected, kinds,
                        hook.link, hook.kvb, wall, max_new, target, sent.arrivals, frontend)


def _group(
    role: str, wl: Workload, scheduler: ReplicaConfig | Callable[[], SchedulerLike], cost: StepCostModel,
    count: int, max_tokens: int | None, check: bool,
) -> list[Replica]:
    """One side's replicas, each with a SchedulerResult of the side's view of the requests."""
    out = []
    for k in range(count):
        inner = make_scheduler(scheduler)
        sched = wrap_checker(inner) if check else inner
        config: dict[str, Any] = {"max_tokens": max_tokens, "role": role}
        if isinstance(scheduler, ReplicaConfig):  # as a single run's: its budget utilization reads it
            config.update(token_budget=scheduler.token_budget, max_seqs=scheduler.max_seqs,
                          kv_tokens=scheduler.kv_tokens)
        res = new_result(f"{role}#{k}", wl, config, list(wl.output_lens), list(wl.output_lens), inner)
        out.append(Replica(k, sched, inner, res, cost))
    return out


class _Gate:
    """The admission gate of both sides (module docstring): a replica admits its queue in arrival
    order while the KV needed (need[role][rid] tokens) plus what it holds fits its kv_total; its
    recorded KV per step is that count."""

    def __init__(self, groups: tuple[list[Replica], list[Replica]], need: tuple[list[int], list[int]],
                 arrivals: Arrivals) -> None:
        self.role = {id(r): role for role, group in enumerate(groups) for r in group}
        self.need = need
        self.committed = {id(r): 0 for group in groups for r in group}  # KV tokens added, plus transfers held
        self.arrivals = arrivals
        self.rejected: list[tuple[int, str]] = []
        self.kinds: dict[int, str] = {}

    def release(self, rep: Replica, rid: int) -> None:
        """Return request `rid`'s KV on `rep` to the gate."""
        self.committed[id(rep)] -= self.need[self.role[id(rep)]][rid]

    def admit(self, rep: Replica, now: float) -> None:
        """Hand queued requests to the scheduler in arrival order while their KV fits."""
        total, need, key = rep.kv_total, self.need[self.role[id(rep)]], id(rep)
        keep = 0
        for req in rep.pending:
            r = int(req.rid)  # type: ignore[call-overload]
            if need[r] > total:
                self._refuse(rep, r, f"request {r} needs {need[r]} KV tokens; the replica has {total}", now)
                keep += 1
                continue
            if self.committed[key] + need[r] > total:
                break
            try:
                rep.sched.add(req)
            except RequestRejected as exc:
                self._refuse(rep, r, str(exc), now)
            else:
                self.committed[key] += need[r]
            keep += 1
        del rep.pending[:keep]

    def _refuse(self, rep: Replica, r: int, why: str, now: float) -> None:
        # Recorded for the whole run, not in the replica's own SimResult.
        self.rejected.append((r, why))
        self.kinds[r] = KV_CAPACITY
        rep.state[r] = int(RequestState.DONE)
        rep.num_outstanding -= 1
        self.arrivals.ended(now)

    def recorded(self, rep: Replica) -> None:
        """The replica's recorded KV for the step is the gate's count."""
        rep.res.step_kv_used[-1] = self.committed[id(rep)]


class _Transfers:
    """The finish hook: a request whose prefill finished moves its KV to a decode replica (an event
    at the transfer's end, when the prefill side releases it and the decode router places it); a
    request finishing on the decode side (or at its first token) ends."""

    def __init__(self, decode: list[Replica], router: Router, gate: _Gate, link: Interconnect, kvb: int,
                 target: list[int], plens: tuple[int, ...], offset: dict[Hashable, int], arrivals: Arrivals) -> None:
        self.decode, self.router, self.gate, self.link, self.kvb = decode, router, gate, link, kvb
        self.target, self.plens, self.offset, self.arrivals = target, plens, offset, arrivals
        n = len(target)
        self.decode_of = [-1] * n
        self.t_start, self.t_end = [math.nan] * n, [math.nan] * n
        self.loop: EventLoop | None = None

    def __call__(self, rep: Replica, finished: dict[Hashable, FinishReason], end: float) -> None:
        """Requests finished on `rep` in a step ending at `end`, s."""
        prefill = self.gate.role[id(rep)] == 0
        for rid in list(finished):
            r = int(rid)  # type: ignore[call-overload]
            if not prefill or self.target[r] <= 1:
                self.gate.release(rep, r)  # done: a decode side's finish, or nothing to move
                self.arrivals.ended(end)
                continue
            # KV stays on the prefill side until the transfer ends.
            self.t_start[r] = end
            self.t_end[r] = end + self.link.transfer_time(self.plens[r] * self.kvb)
            assert self.loop is not None
            self.loop.at(self.t_end[r], partial(self._arrived, rep, r))

    def _arrived(self, source: Replica, r: int, now: float) -> None:
        """Request r's KV reached the decode side at `now`, s."""
        self.gate.release(source, r)
        self.offset[r] = self.plens[r]
        req = Request(r, 1, self.target[r] - 1, 0, now)
        self.decode_of[r] = route_to(self.router, req, self.decode).index


def _timelines(
    wl: Workload, target: list[int], pre: list[SimResult], dec: list[SimResult], p_of: list[int], d_of: list[int],
    frontend: float = 0.0,
) -> list[Any]:
    """Join each request's first token (prefill side) with its later tokens (decode side); each timeline's
    arrival is the client's, `frontend` s before the engine's (so its TTFT and E2E carry the front end)."""

    out = []
    for r in range(len(wl)):
        k = p_of[r]
        if k < 0:
            continue
        p = pre[k]
        if p.finish_step[r] < 0:
            continue
        first = p.step_end[p.first_step[r]]
        times = [first]
        if target[r] > 1:
            d = dec[d_of[r]] if d_of[r] >= 0 else None
            if d is None or d.finish_step[r] < 0:
                continue
            times += d.token_times(r)
        adm = p.admit_step[r]
        out.append(
            RequestTimeline(r, wl.arrivals[r] - frontend, tuple(times), wl.prompt_lens[r],
                            p.step_start[adm] if adm >= 0 else None, times[-1])
        )
    return out


