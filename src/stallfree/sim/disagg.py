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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from stallfree.core.errors import RequestRejected
from stallfree.core.metrics import RequestTimeline, summarize
from stallfree.core.plan import StepPlan
from stallfree.core.request import FinishReason, Request
from stallfree.costmodel import CostModelError
from stallfree.costmodel import default_cost_model as priced_default
from stallfree.costmodel.hardware import DTYPE_BYTES
from stallfree.sim.cluster import run_cluster_experiment
from stallfree.sim.costs import StepCostModel
from stallfree.sim.defaults import DEFAULT_TOKEN_BUDGET
from stallfree.sim.experiment import study_header
from stallfree.sim.load import Arrivals, ClosedLoop
from stallfree.sim.loop import Entry, EventLoop, Router, route_to
from stallfree.sim.replica import Replica
from stallfree.sim.report import summarize_result
from stallfree.sim.result import (
    CONTEXT_LENGTH,
    KV_CAPACITY,
    ClusterError,
    RequestState,
    SchedulerLike,
    SimResult,
    verify_tokens,
)
from stallfree.sim.routers import LeastOutstandingRouter, make_router
from stallfree.sim.setup import SetupError, build_cost_model
from stallfree.sim.simulator import ReplicaConfig, context_overflows, make_scheduler, new_result, wrap_checker
from stallfree.sim.workload import Workload

__all__ = [
    "DEFAULT_AGGREGATED_BUDGETS",
    "DEFAULT_DECODE_BUDGETS",
    "DEFAULT_INTERCONNECT",
    "DEFAULT_PREFILL_BUDGETS",
    "INTERCONNECTS",
    "DisaggResult",
    "Interconnect",
    "RECORD_FIELDS",
    "disagg_records",
    "disagg_summary",
    "parse_disaggregate",
    "run_disagg_experiment",
    "search_plan",
    "simulate_disaggregated",
]


@dataclass(frozen=True, slots=True)
class Interconnect:
    """The link a request's KV crosses from a prefill replica to a decode replica.

    Args:
        name: a label for reports.
        bandwidth_bytes_per_s: bytes per second one transfer gets, > 0.
        latency_s: the fixed cost of one transfer (setup and first byte), s, >= 0.

    Raises:
        ClusterError: a session workload (not modelled here); bandwidth <= 0 or latency < 0 (or not finite).
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ClusterError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_per_s!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ClusterError(f"link latency must be >= 0 s, got {self.latency_s!r}")

    def transfer_time(self, num_bytes: float) -> float:
        """Seconds to move `num_bytes`: latency_s + num_bytes / bandwidth_bytes_per_s."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


#: Named links. Bandwidths are nominal per-direction line rates (NVLink 4 on H100: 900 GB/s both
#: directions; InfiniBand NDR: 400 Gb/s; RoCE at 200 Gb/s; PCIe 5.0 x16: ~64 GB/s). Latencies are
#: this project's assumptions for one KV transfer's fixed cost (connection, registration, first
#: byte), not measurements: 10 us within a node, 50 us over the network.
INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink": Interconnect("nvlink", 450e9, 10e-6),
    "pcie5": Interconnect("pcie5", 64e9, 10e-6),
    "ib-ndr": Interconnect("ib-ndr", 50e9, 50e-6),
    "roce-200": Interconnect("roce-200", 25e9, 50e-6),
}
#: The default: a prefill and a decode replica on different nodes, linked by InfiniBand NDR.
DEFAULT_INTERCONNECT = "ib-ndr"


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
    request from its first output token, so every chunk's start is `offset[rid]` tokens short."""

    def __init__(self, inner: StepCostModel, offset: dict[Hashable, int]) -> None:
        self.inner, self.offset = inner, offset
        self._key: tuple[Hashable, ...] | None = None
        self._sum = 0

    def step_time(self, plan: StepPlan) -> float:
        """The inner model's time for the plan with every start shifted by its request's prompt."""
        if plan.decode_rids is not self._key:
            self._key = plan.decode_rids
            self._sum = sum(self.offset[r] for r in plan.decode_rids)
        prefills = tuple(
            type(c)(c.rid, c.num_tokens, c.is_prefill, c.start + self.offset[c.rid], c.is_last) for c in plan.prefills
        )
        shifted = StepPlan(
            plan.step, plan.decode_rids, (0,) * plan.num_decodes, prefills, plan.num_tokens,
            plan.decode_context_sum + self._sum, plan.token_budget, plan.admitted, plan.preempted,
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
    arrival: tuple[float, ...] = ()
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
    if hasattr(workload, "session_ids"):  # a stallfree.sim.sessions.SessionWorkload
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


def disagg_summary(
    result: DisaggResult, num_requests: int, slo_ttft: float | None = None, slo_tpot: float | None = None
) -> dict[str, Any]:
    """The cluster-wide summary with the single-run keys (stallfree.core.metrics.summarize over the
    joined timelines, plus num_requests, rejected, rejected_by_reason, slo_attainment), transfer figures
    (mean and p99 transfer ms, link name, bandwidth, latency, KV bytes per token), and `replicas`:
    one report.summarize_result per replica with its `role` ("prefill" or "decode") and index.
    """

    out: dict[str, Any] = {"num_requests": num_requests, "rejected": len(result.rejected)}
    by: dict[str, int] = {}
    for kind in result.rejected_kind.values():
        by[kind] = by.get(kind, 0) + 1
    out["rejected_by_reason"] = by
    if result.timelines:
        out.update(summarize(result.timelines, slo_ttft, slo_tpot))
        # As a single run reports it: the share of completed requests within the SLOs.
        good, rate = out.get("request_goodput"), out.get("request_throughput")
        out["slo_attainment"] = good / rate if good is not None and rate else None
    else:
        out["completed"] = 0
    moves = sorted(e - s for s, e in zip(result.transfer_start, result.transfer_end, strict=True) if e == e)
    out.update(
        interconnect=result.link.name,
        link_bandwidth_bytes_per_s=result.link.bandwidth_bytes_per_s,
        link_latency_s=result.link.latency_s,
        kv_bytes_per_token=result.kv_bytes_per_token,
        num_transfers=len(moves),
        mean_transfer_ms=sum(moves) / len(moves) * 1e3 if moves else None,
        p99_transfer_ms=moves[min(len(moves) - 1, math.ceil(0.99 * len(moves)) - 1)] * 1e3 if moves else None,
        prefill_replicas=len(result.prefill),
        decode_replicas=len(result.decode),
        sim_wall_s=result.wall_s,
    )
    reps = []
    sides = (("prefill", result.prefill, result.prefill_of), ("decode", result.decode, result.decode_of))
    for role, results, of in sides:
        for k, res in enumerate(results):
            s = summarize_result(res)
            s.update(role=role, replica=k, num_requests=sum(1 for x in of if x == k))
            reps.append(s)
    out["replicas"] = reps
    return out


#: Columns of disagg_records, in order.
RECORD_FIELDS = (
    "rid", "arrival_s", "prompt_len", "max_new", "output_tokens", "prefill_replica", "decode_replica",
    "admitted_s", "first_token_s", "transfer_start_s", "transfer_end_s", "transfer_ms", "decode_admitted_s",
    "finish_s", "ttft_ms", "tpot_ms", "e2el_ms", "queue_ms", "finish_reason", "rejected", "rejected_reason",
)


def disagg_records(result: DisaggResult, workload: Workload) -> list[dict[str, Any]]:
    """One dict per request of `workload` (the one simulated), the keys RECORD_FIELDS: the single-run
    record's (report.request_records) plus the replica that prefilled it and the one that decoded it
    (None: none), its transfer's start and end (s) and length (ms), and when the decode side admitted
    it (s). admitted_s and queue_ms are the prefill side's; finish_reason is "length" when the request
    generated max_new tokens, else "stop". Times are None for a rejected or unfinished request and
    for a step it never took (no transfer for a single-token request); tpot_ms is None below 2 tokens.

    Raises:
        ValueError: `workload` has a different number of requests than the result.
    """
    n = len(workload)
    if len(result.prefill_of) != n:
        raise ValueError(f"the workload has {n} requests; the result {len(result.prefill_of)}")
    tl = {int(t.rid): t for t in result.timelines}
    why = dict(result.rejected)
    rows = []
    for r in range(n):
        t = tl.get(r)
        k, d = result.prefill_of[r], result.decode_of[r]
        arr = result.arrival[r] if result.arrival else workload.arrivals[r]
        adm = result.prefill[k].admit_step[r] if k >= 0 else -1
        dadm = result.decode[d].admit_step[r] if d >= 0 else -1
        t0, t1 = result.transfer_start[r], result.transfer_end[r]
        cap = result.max_new[r] if result.max_new else None
        ntok = len(t.token_times) if t is not None else 0
        first = t.token_times[0] if t is not None else None
        last = t.token_times[-1] if t is not None else None
        rows.append({
            "rid": r,
            "arrival_s": arr,
            "prompt_len": workload.prompt_lens[r],
            "max_new": cap,
            "output_tokens": ntok,
            "prefill_replica": k if k >= 0 else None,
            "decode_replica": d if d >= 0 else None,
            "admitted_s": result.prefill[k].step_start[adm] if adm >= 0 else None,
            "first_token_s": first,
            "transfer_start_s": t0 if t0 == t0 else None,
            "transfer_end_s": t1 if t1 == t1 else None,
            "transfer_ms": (t1 - t0) * 1e3 if t1 == t1 else None,
            "decode_admitted_s": result.decode[d].step_start[dadm] if dadm >= 0 else None,
            "finish_s": last,
            "ttft_ms": (first - arr + result.frontend_s) * 1e3 if first is not None else None,
            "tpot_ms": (last - first) / (ntok - 1) * 1e3 if last is not None and first is not None and ntok > 1
            else None,
            "e2el_ms": (last - arr + result.frontend_s) * 1e3 if last is not None else None,
            "queue_ms": (result.prefill[k].step_start[adm] - arr) * 1e3 if adm >= 0 else None,
            "finish_reason": None if t is None else "length" if cap is not None and ntok >= cap else "stop",
            "rejected": why.get(r),
            "rejected_reason": result.rejected_kind.get(r) if r in why else None,
        })
    return rows


def kv_bytes_per_token_of(hardware: Any) -> int:
    """KV bytes per token of the model that `hardware` (a setup.HardwareOptions) names, in its KV
    dtype: 2 x layers x kv_heads x head_dim x bytes per element (the whole model, every TP shard).

    Raises:
        SetupError: an unknown model, GPU or dtype.
    """

    try:
        cm = priced_default(hardware.model, hardware.gpu, tp=hardware.tp, dtype=hardware.dtype,
                            kv_dtype=hardware.kv_dtype).cost_model
    except (CostModelError, ValueError) as exc:
        raise SetupError(str(exc)) from None
    return int(cm.model.kv_bytes_per_token(DTYPE_BYTES[cm.kv_dtype]))


def run_disagg_experiment(
    setup: Any,
    *,
    prefill: int,
    decode: int,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    link: Interconnect | None = None,
    router: str = "least-outstanding",
    budget: int | None = None,
    check: bool = False,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    prefill_budget: int | None = None,
    decode_budget: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any], DisaggResult]:
    """`stallfree simulate --disaggregate P:D` on a Setup: each side is the setup's replica with its
    own tensor parallelism (KV capacity and step pricing rebuilt for it).

    Args:
        setup: a stallfree.sim.setup.Setup.
        prefill, decode: replicas on each side, >= 1.
        prefill_tp, decode_tp: GPUs per replica on each side (default: the setup's tp).
        link: the interconnect (default INTERCONNECTS[DEFAULT_INTERCONNECT]).
        router: the router on each side (a name of cluster.ROUTERS).
        budget: token budget per step on both sides (default 2048); check, slo_ttft, slo_tpot: as
            run_experiment.
        prefill_budget, decode_budget: one side's token budget per step (default: budget).

    Returns:
        (header, summary, result): the header (setup.header() plus the disaggregation), the
        disagg_summary (runs[0] of --json) and the DisaggResult.

    Raises:
        ClusterError, SetupError, SimulationError.
    """
    budget = budget or DEFAULT_TOKEN_BUDGET
    budgets = (prefill_budget or budget, decode_budget or budget)
    hw = setup.hardware_options
    sides = _sides(setup, (prefill_tp or hw.tp, decode_tp or hw.tp), budgets)
    link = link or INTERCONNECTS[DEFAULT_INTERCONNECT]
    kvb = kv_bytes_per_token_of(hw)
    res = simulate_disaggregated(
        setup.workload, sides[0][1], sides[1][1], sides[0][0], sides[1][0], prefill, decode, kvb, link,
        make_router(router), make_router(router), setup.workload_options.max_tokens, check, setup.context_length,
        setup.engine_closed_loop,
    )
    summary = disagg_summary(res, len(setup.workload), slo_ttft, slo_tpot)
    _describe_run(summary, setup, prefill, decode, router, budgets, sides)
    header = study_header(setup)
    header.update(
        token_budget=budget, prefill_budget=budgets[0], decode_budget=budgets[1], step_time_target_s=None,
        disaggregate=f"{prefill}:{decode}", router=router,
        prefill_hardware=sides[0][2], decode_hardware=sides[1][2], interconnect=link.name,
        link_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, link_latency_s=link.latency_s,
        kv_bytes_per_token=kvb,
    )
    header["behaviour"], header["disaggregation_not_modelled"] = sides_behaviour(setup)
    return header, summary, res


def sides_behaviour(setup: Any) -> tuple[str, list[str]]:
    """How each side of a disaggregated run schedules, in words, and what of the setup's scheduling is
    not modelled under disaggregation and so left out on both sides (asynchronous scheduling, prefix
    caching, several partial prefills, a CPU KV tier), each named with where it came from (the pricing
    engine's default or the caller's)."""
    core = setup.scheduler_config
    kv = (f"paged KV in {core.block_size}-token blocks, watermark {core.watermark:g}" if core.kv_policy == "paged"
          else "KV reserved at admission")
    engine = getattr(setup, "engine_behaviour", {}) or {}
    left = []
    for name, on, what in (("async_scheduling", setup.async_scheduling, "asynchronous scheduling"),
                           ("enable_prefix_caching", core.enable_prefix_caching, "prefix caching"),
                           ("max_num_partial_prefills", core.max_num_partial_prefills > 1, "several partial prefills"),
                           ("cpu_kv_tokens", bool(core.cpu_kv_tokens), "a CPU KV tier")):
        if on:
            left.append(f"{what} ({engine[name]['source']})" if name in engine else what)
    text = f"each side: synchronous scheduling, {kv}, no prefix caching"
    if left:
        text += "; not modelled under disaggregation, left out: " + ", ".join(left)
    return text, left


def _describe_run(
    summary: dict[str, Any], setup: Any, prefill: int, decode: int, router: str, budgets: tuple[int, int],
    sides: list[tuple[StepCostModel, ReplicaConfig, str, int, int]],
) -> None:
    """Add to a P:D run's summary its label, router, GPUs, each side's budget, tp and KV tokens, the
    goodput per GPU and, under closed-loop load, the achieved request rate (requests/s)."""
    closed = setup.closed_loop
    if closed is not None:
        # As a single closed-loop run reports it: requests sent per second over the run.
        dur = summary.get("duration_s")
        summary.update(concurrency=closed.concurrency, think_time_s=closed.think_time,
                       achieved_request_rate=len(setup.workload) / dur if dur else None)
    gpus = prefill * sides[0][3] + decode * sides[1][3]
    summary.update(
        label=f"disagg {prefill}P:{decode}D", router=router, num_gpus=gpus, prefill_budget=budgets[0],
        decode_budget=budgets[1], prefill_tp=sides[0][3],
        decode_tp=sides[1][3], prefill_kv_tokens=sides[0][4], decode_kv_tokens=sides[1][4],
        goodput_per_gpu=summary["request_goodput"] / gpus if summary.get("request_goodput") is not None else None,
    )


def _sides(
    setup: Any, tps: tuple[int, int], budgets: tuple[int, int]
) -> list[tuple[StepCostModel, ReplicaConfig, str, int, int]]:
    """Per side (prefill, decode): (step pricing, scheduler config, hardware text, tp, KV tokens) of
    the setup's replica rebuilt at that side's tensor parallelism and token budget.

    Raises:
        ClusterError: a budget that is not an integer >= 1. SetupError: as build_cost_model.
    """
    for name, b in zip(("prefill budget", "decode budget"), budgets, strict=True):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ClusterError(f"{name} must be an integer >= 1 tokens, got {b!r}")
    sides = []
    for tp, side_budget in zip(tps, budgets, strict=True):
        cost, kv, desc = build_cost_model(replace(setup.hardware_options, tp=tp))
        core = setup.scheduler_config
        cfg = ReplicaConfig(core.replace(
            kv_tokens=kv, token_budget=side_budget, enable_prefix_caching=False, cpu_kv_tokens=0,
            max_num_partial_prefills=1, max_long_partial_prefills=None, long_prefill_token_threshold=None))
        sides.append((cost, cfg, desc, tp, kv))
    return sides


#: The P:D search's default token budget grids (tokens per step), small on purpose: each point is a
#: whole simulation. Aggregated: 1,024 to 4,096 around the default 2,048 (smaller: lower TPOT, less
#: throughput). Prefill side: 2,048 and 8,192 (no decodes share its steps, so larger chunks cost no
#: TPOT). Decode side: 128 (at most 128 requests fed per step, under the default max_seqs 256) and
#: 2,048 (no limit below max_seqs). These are this project's choices, not measured optima.
DEFAULT_AGGREGATED_BUDGETS = (1024, 2048, 4096)
DEFAULT_PREFILL_BUDGETS = (2048, 8192)
DEFAULT_DECODE_BUDGETS = (128, 2048)


def _rank(s: dict[str, Any]) -> tuple[float, float]:
    """Goodput per GPU to 0.001 req/s/GPU (finer differences are the last request's finish time),
    then p99 TTFT."""
    return -round(s.get("goodput_per_gpu") or 0.0, 3), s.get("p99_ttft_ms") or math.inf


def _grid(name: str, values: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    out = tuple(default if values is None else values)
    if not out or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in out):
        raise ClusterError(f"{name} must be one or more integers >= 1 tokens, got {values!r}")
    return out


def search_plan(
    setup: Any,
    replicas: int,
    *,
    slo_ttft: float | None,
    slo_tpot: float | None,
    link: Interconnect | None = None,
    router: str = "least-outstanding",
    aggregated_budgets: Any = None,
    prefill_budgets: Any = None,
    decode_budgets: Any = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """At equal GPU count: the aggregated cluster at each token budget of a small grid, against
    every P:D split (P + D = replicas, same tp on both sides) at each (prefill budget, decode
    budget) of a small grid; all on the setup's workload, one simulation per point, in this process.

    Args:
        setup: a stallfree.sim.setup.Setup.
        replicas: N >= 2 (each replica has the setup's tp GPUs).
        slo_ttft, slo_tpot: the SLOs goodput counts, s (at least one).
        link, router: as run_disagg_experiment.
        aggregated_budgets, prefill_budgets, decode_budgets: the grids, token budgets per step
            (defaults DEFAULT_AGGREGATED_BUDGETS, DEFAULT_PREFILL_BUDGETS, DEFAULT_DECODE_BUDGETS).

    Returns:
        (aggregated summaries, disaggregated summaries), each best first: the highest goodput per
        GPU (to 0.001 req/s/GPU), then the lower p99 TTFT. Every summary has num_gpus and
        goodput_per_gpu; aggregated ones token_budget, disaggregated ones prefill_budget and
        decode_budget; labels name them. len(aggregated) + (N - 1) * len(prefill) * len(decode)
        simulations.

    Raises:
        ClusterError: replicas < 2, no SLO given, or an empty grid or a budget < 1.
    """

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise ClusterError(f"the P:D search needs `replicas` >= 2 (the GPUs to split), got {replicas!r}")
    if slo_ttft is None and slo_tpot is None:
        raise ClusterError("the P:D search ranks by goodput: give `slo_ttft` and/or `slo_tpot`")
    agg_grid = _grid("aggregated budgets", aggregated_budgets, DEFAULT_AGGREGATED_BUDGETS)
    pre_grid = _grid("prefill budgets", prefill_budgets, DEFAULT_PREFILL_BUDGETS)
    dec_grid = _grid("decode budgets", decode_budgets, DEFAULT_DECODE_BUDGETS)
    aggs = [_aggregated(setup, replicas, router, b, slo_ttft, slo_tpot) for b in agg_grid]
    rows = []
    for p in range(1, replicas):
        for bp in pre_grid:
            for bd in dec_grid:
                _, s, _ = run_disagg_experiment(setup, prefill=p, decode=replicas - p, link=link, router=router,
                                                slo_ttft=slo_ttft, slo_tpot=slo_tpot, prefill_budget=bp,
                                                decode_budget=bd)
                s["label"] = f"disagg {p}P:{replicas - p}D b{bp}/{bd}"
                s["goodput_per_gpu"] = s["goodput_per_gpu"] or 0.0
                rows.append(s)
    aggs.sort(key=_rank)
    rows.sort(key=_rank)
    return aggs, rows


def _aggregated(
    setup: Any, replicas: int, router: str, budget: int, slo_ttft: float | None, slo_tpot: float | None
) -> dict[str, Any]:
    """The summary of `replicas` aggregated replicas at `budget`, labelled, with its goodput per GPU."""
    gpus = replicas * setup.hardware_options.tp
    study = run_cluster_experiment(setup, replicas=replicas, router=router, budget=budget,
                                   slo_ttft=slo_ttft, slo_tpot=slo_tpot)
    agg = study.summaries[0]
    agg.update(label=f"aggregated x{replicas} b{budget}", num_gpus=gpus, token_budget=budget,
               goodput_per_gpu=(agg.get("request_goodput") or 0) / gpus)
    return agg

