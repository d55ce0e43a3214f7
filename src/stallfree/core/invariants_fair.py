"""The invariant checker's tenant rules (SchedulerConfig.fairness="vtc", max_queue_time_s): the shadow keeps
its own virtual token counters from the plans it checked, works out which tenant's head admission takes,
and which waiting requests time out.

Imports allowed: the standard library and stallfree.core only.

Counting follows stallfree.core.fairness's order: a step's decodes before its admissions, each admission's
first chunk as it is admitted, the continuing partial prefill after the plan; a tenant with nothing waiting
that gets a request is lifted to the least counter of the tenants with waiting requests.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import TYPE_CHECKING

from stallfree.core.fairness import step_cap_floor
from stallfree.core.plan import StepPlan

if TYPE_CHECKING:
    from stallfree.core.invariants_state import CheckerState

__all__ = ["FairRules"]


class FairRules:
    """The tenant options' part of the checker: counters, the admission pick, timeouts."""

    @staticmethod
    def on(chk: CheckerState) -> bool:
        """Whether the scheduler shares admission between tenants (fairness="vtc")."""
        return chk.scheduler.config.fairness == "vtc"

    @staticmethod
    def tenant(chk: CheckerState, rid: Hashable) -> str:
        return chk._reqs[rid].req.tenant_name

    @staticmethod
    def lift(chk: CheckerState, rid: Hashable) -> None:
        """Before `rid` joins the shadow queue: lift its tenant if none of its requests waits (to the least
        waiting counter less tenant_burst_tokens / its weight, never down)."""
        tenant = FairRules.tenant(chk, rid)
        waiting = {FairRules.tenant(chk, r) for r in chk._waiting}
        service = chk._service
        if tenant in waiting:
            return
        if not waiting:
            service.setdefault(tenant, 0.0)
            return
        cfg = chk.scheduler.config
        weight = (cfg.tenant_weights or {}).get(tenant, 1.0)
        low = min(service.get(t, 0.0) for t in waiting) - cfg.tenant_burst_tokens / weight
        service[tenant] = max(service.get(tenant, 0.0), low)

    @staticmethod
    def charge(chk: CheckerState, rid: Hashable, tokens: int) -> None:
        """Count `tokens` planned for `rid` against its tenant (weighted, as the scheduler's counter)."""
        tenant = FairRules.tenant(chk, rid)
        weights = chk.scheduler.config.tenant_weights or {}
        chk._service[tenant] = chk._service.get(tenant, 0.0) + tokens / weights.get(tenant, 1.0)
        chk._served[tenant] = chk._served.get(tenant, 0) + tokens

    @staticmethod
    def _rank(chk: CheckerState, tenant: str) -> tuple[float, float]:
        weights = chk.scheduler.config.tenant_weights or {}
        return (chk._service.get(tenant, 0.0), chk._served.get(tenant, 0) / weights.get(tenant, 1.0))

    @staticmethod
    def _key(chk: CheckerState, tenant: str, queue: list[Hashable]) -> tuple[float, float, int]:
        return (*FairRules._rank(chk, tenant), min(chk._reqs[r].order for r in queue))

    @staticmethod
    def _by_tenant(chk: CheckerState) -> dict[str, list[Hashable]]:
        out: dict[str, list[Hashable]] = {}
        for r in chk._waiting:
            if r not in chk._refused:
                out.setdefault(FairRules.tenant(chk, r), []).append(r)
        for q in out.values():
            q.sort(key=lambda r: chk._reqs[r].order)
        return out

    @staticmethod
    def static_order(chk: CheckerState) -> list[Hashable]:
        """The queue at the current counters: tenants by (counter, head's add order), each in add order."""
        queues = FairRules._by_tenant(chk)
        tenants = sorted(queues, key=lambda t: FairRules._key(chk, t, queues[t]))
        return [r for t in tenants for r in queues[t]]

    @staticmethod
    def picks(chk: CheckerState) -> Iterator[Hashable]:
        """Admission's candidates one at a time, each worked out when asked, after the caller charged the
        previous one's first chunk: the oldest waiting request of the tenant with the least counter. With an
        admission filter the scheduler takes the queue's order at the step's start (static_order)."""
        if chk._refused:
            yield from FairRules.static_order(chk)
            return
        while True:
            queues = FairRules._by_tenant(chk)
            if not queues:
                return
            tenant = min(queues, key=lambda t: FairRules._key(chk, t, queues[t]))
            yield queues[tenant][0]

    @staticmethod
    def limit(chk: CheckerState, rid: Hashable, left: int) -> int:
        """The most tokens `rid`'s next prompt chunk may take with `left` in the budget: while another tenant
        with requests running or waiting has been served fewer tokens per weight (lifts left out) when the
        chunk is sized, what keeps the step within tenant_chunk_tokens C (C less the step's decode tokens and
        the chunks placed before it), and never less than fairness.step_cap_floor."""
        c = chk.scheduler.config.tenant_chunk_tokens
        if c is None or not FairRules.on(chk):
            return left
        decode_tokens, prefill_budget = chk._prefill_start
        cfg = chk.scheduler.config
        c = max(c - decode_tokens - (prefill_budget - left),
                step_cap_floor(c, cfg.block_size if cfg.chunks_aligned else None))
        if left <= c:
            return left
        own = FairRules.tenant(chk, rid)
        rank = FairRules._rank(chk, own)[1]
        others = {FairRules.tenant(chk, r) for r in (*chk._running, *chk._waiting)} - {own}
        return c if any(FairRules._rank(chk, t)[1] < rank for t in others) else left

    @staticmethod
    def set_aside(chk: CheckerState, left: int) -> Hashable | None:
        """FairOnePartialPrefill's head: with a partial prefill from an earlier step, the first pick when its
        tenant has less service than the partial prefill's, a slot is free and its whole prompt fits `left`
        (without tenant_chunk_tokens: leaving a chunk for the partial prefill)."""
        s = chk.scheduler
        partial = chk._partial
        if (partial is None or not chk._admitting or chk._caps is not None or chk._refused or left <= 0
                or s.config.cpu_kv_tokens or s.config.max_num_partial_prefills != 1):
            return None
        head = next(FairRules.picks(chk), None)
        if head is None or len(chk._running) >= s.config.max_seqs:
            return None
        target = chk._reqs[head].target
        if target > left or chk._chunk(target, left) != target:
            return None
        psh = chk._reqs[partial]
        if s.config.tenant_chunk_tokens is None and not chk._chunk(psh.target - psh.prefilled, left - target):
            return None
        if FairRules._rank(chk, FairRules.tenant(chk, head)) >= FairRules._rank(chk, FairRules.tenant(chk, partial)):
            return None
        return head

    @staticmethod
    def charge_plan(chk: CheckerState, plan: StepPlan, after_admission: bool) -> None:
        """Charge the plan's decodes (before the admissions, `after_admission` False) or its continuing
        partial prefill (after them)."""
        if not after_admission:
            for c in plan.decodes:
                FairRules.charge(chk, c.rid, c.num_tokens)
            return
        for c in plan.prefills:
            if c.rid not in plan.admitted:
                FairRules.charge(chk, c.rid, c.num_tokens)

    @staticmethod
    def check_counters(chk: CheckerState) -> None:
        """The scheduler's tokens per tenant equal the shadow's."""
        got = chk.scheduler.stats().tenant_served_tokens
        if got != chk._served:
            chk._fail("tokens served per tenant", f"scheduler {got}, shadow {chk._served}")

    @staticmethod
    def timeouts(chk: CheckerState, plan: StepPlan) -> None:
        """The plan's timed_out are exactly the never-admitted waiting requests past their limit (now minus
        arrival, at the step's clock reading); they leave the shadow."""
        s = chk.scheduler
        now = s.stats().now
        limits = s.config.max_queue_time_s
        expected: list[Hashable] = []
        if limits is not None:
            for r in chk._waiting:
                sh = chk._reqs[r]
                if sh.preemptions:
                    continue
                lim = limits.get(sh.req.tenant_name) if isinstance(limits, Mapping) else limits
                if lim is not None and now - sh.req.arrival > lim:
                    expected.append(r)
        if set(plan.timed_out) != set(expected) or len(plan.timed_out) != len(expected):
            chk._fail("timed out (never admitted, waited past max_queue_time_s)",
                      f"got {plan.timed_out}, expected {tuple(expected)} at now={now}")
        for r in expected:
            chk._reqs.pop(r)
            chk._waiting.remove(r)
