"""Fair share between tenants: the virtual token counter (VTC) waiting queue, and queue time limits.

Imports allowed: the standard library and stallfree.core only.

Under SchedulerConfig(fairness="vtc") the waiting queue is a VTCQueue: each tenant (Request.tenant,
None being "default") keeps its own first come, first served queue, and the head of the whole queue is
the oldest waiting request of the tenant with the least service received so far. Service is counted in
tokens the scheduler plans for the tenant's requests (prefill chunk tokens and decode tokens, recomputed
tokens after a preemption included), divided by the tenant's weight (tenant_weights; 1.0 when not named).
Everything else in the contract is unchanged: decodes go first, the budget holds, a head that does not
fit stops admission (nothing skips it), so "admission order equals arrival order" holds within a tenant.

A partial prefill does not make a less-served tenant wait (FairOnePartialPrefill): when the prompt
started in an earlier step belongs to a tenant ranked after the head's (counter, then service before
lifts), the head's whole prompt is set aside from the budget left after the decodes before the partial
prefill takes the rest, if it fits whole and leaves the partial prefill a chunk, a slot is free and the
KV manager admits it after the partial prefill's chunk. The head is admitted (its chunk placed before
that one, so that an unfinished prompt's chunk is still the plan's last) and finishes its prefill in
this step, so at most one prompt is still partially prefilled. One such head per step; then admission
goes on as usual. Without it a short request of a light tenant waits for a flood's long prompt to finish
its prefill (many steps). The head's cached prefix (prefix caching) is looked up after the partial
prefill's chunk took its blocks. Under "paged", a partial prefill that cannot get a block is its own
victim (preempted by recompute) even when requests were admitted beside it: they may already be decodes
of the plan. Not with a CPU KV tier, a chunk cap or an admission filter: there the contract's order
applies.

Isolation between tenants (tenant_chunk_tokens=C, off by default). A long prompt makes every step that carries
a chunk of it long, and every other tenant's decodes and first tokens wait for those steps. With C: (1) a
prompt chunk (the continuing partial prefill's, or an admission's first chunk) of a tenant that *leads*, that
is, some other tenant with requests running or waiting has been served fewer tokens per weight (lifts left
out, at the moment the chunk is sized), keeps the step within C tokens: it takes at most C less the tokens the
step already holds (its decodes, drafts included, and the chunks placed before it), and never fewer than
step_cap_floor (C // 4 in whole blocks), so the leading tenant always moves on; the least-served tenant is
never capped. The step, not the chunk, is bounded because the step's time is what the others wait for, and
measured GEMMs are priced in row tiles (256 rows in vLLM's tables): a step of C tokens costs what the tile
holding it costs, whatever part of it is decodes. Lifts are left out because a light tenant's lift puts its
counter level with a flood's, and its next prompts then put it ahead: ranked by counters the flood would stop
leading and its full-budget chunks (the longest steps) would come back exactly while the light tenant is
active. (2) A step that sets a less-served tenant's head aside gives the partial prefill no chunk: the step
holds the decodes and the head's whole prompt, so that head's first token comes after a step as short as it
would be without the other tenant's prompt (if the KV manager does not admit the head, the step is planned as
without the set-aside). The partial prefill goes on in the next step; a set-aside charges the head's tenant,
so set-asides stop once it no longer ranks first and the partial prefill always finishes.

Burst (tenant_burst_tokens=B, 0 by default). The lift leaves a tenant B / weight below the least counter of
the tenants with waiting requests (never above its own): a tenant that was idle may be served B tokens before
the others are served again, instead of finding its second short request behind the others' counters.

Counting, in the order the scheduler does it (and the invariant checker replays): a step's decodes
once decode selection is done, before admission (a flood's running decodes count against it at once),
each admitted request's first chunk when it is admitted (so the next pick in the same step sees it),
and the continuing partial prefill once the plan is built. A tenant whose queue was empty and
gets a new request is lifted to the least counter of the tenants with waiting requests (if above its
own), so a tenant that was idle does not bank service it never asked for (VTC's counter lift). Ties go
to the tenant with less service before lifts (its tokens / weight), then to the one whose head was added
first: a light tenant lifted to a flood's counter goes before the flood, not behind it.

Fairness bound (checked in tests/core/test_fairness.py): let U be the most tokens the running requests
of one tenant can still be charged: each running request at most prompt_len + max_new (its prefill,
recomputed or not, then max_new - 1 decodes), so U <= kv_tokens under kv_policy="reserve" (their
reservations fit the cache) and U <= max_seqs x max(prompt_len + max_new) under "paged". While tenants
a and b both have waiting requests at every step since their counters were equal, a's counter exceeds
b's by at most U / w_a: after the last admission of a (when a's counter was the least, so at most b's)
a is charged only by the requests it had running then. The service two backlogged tenants receive over
an interval therefore differs by at most 2 U / min(w) weighted tokens, the form of Sheng et al.'s bound.
(An admission filter, schedule(admit=f), takes the queue's order at the step's start and so is outside it.)
The chunk cap and the set-aside alone change the sizes and timing of chunks, never the order in which
tenants are admitted, so the bound holds with them. A burst B
lifts a tenant B / w_b below the others: from the lift until its counter reaches theirs it is the one
served, and the interval bound gains B / w_b.

Source: Sheng et al., "Fairness in Serving Large Language Models", OSDI'24 (the virtual token counter,
its lift on arrival, and the bound in memory-capacity tokens).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Mapping
from functools import partial
from typing import Any

from stallfree.core._mypyc import mypyc_attr
from stallfree.core.errors import InvalidConfig
from stallfree.core.plan import ScheduledChunk
from stallfree.core.prefill import OnePartialPrefill, PrefillHost, StepBudget
from stallfree.core.request import RequestStatus

__all__ = ["FAIRNESS", "FairOnePartialPrefill", "VTCQueue", "check_fairness", "check_isolation", "queue_limit_of",
           "step_cap_floor"]

#: The fairness rules between tenants: "fcfs" (tenants ignored, one queue: the contract) and "vtc".
FAIRNESS = ("fcfs", "vtc")

_WAITING = RequestStatus.WAITING


def _seq(obj: Any) -> int:
    return int(obj.seq)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class VTCQueue:
    """The waiting queue under fairness="vtc": one FCFS queue per tenant, the head the oldest waiting
    request of the tenant with the least weighted service.

    Owns the per-tenant queues and the counters; the scheduler charges it (`charge`) for every token it
    plans. Records are the scheduler's LiveRequest (read: `req.tenant`, `seq`, `status`).

    Args:
        weights: tenant -> weight (> 0); a tenant not named weighs 1.0.
        burst_tokens: B, tokens: the lift leaves a tenant B / weight below the least waiting counter.

    Attributes:
        service: tenant -> weighted service (tokens / weight, lifts included), for every tenant seen.
        served_tokens: tenant -> tokens planned for its requests (unweighted, no lifts).
    """

    def __init__(self, weights: Mapping[str, float] | None = None, burst_tokens: int = 0) -> None:
        self.weights = dict(weights or {})
        self.burst_tokens = burst_tokens
        self._queues: dict[str, list[Any]] = {}
        self._n = 0
        self._running: dict[str, int] = {}  # tenant -> its running requests, for the tenants with any
        self.service: dict[str, float] = {}
        self.served_tokens: dict[str, int] = {}

    def weight(self, tenant: str) -> float:
        """The tenant's weight (1.0 when not named)."""
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, tokens: int) -> None:
        """Count `tokens` planned for `tenant`'s requests: its counter grows by tokens / weight."""
        self.service[tenant] = self.service.get(tenant, 0.0) + tokens / self.weights.get(tenant, 1.0)
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0) + tokens

    def append(self, obj: Any) -> None:
        """Queue `obj` in its tenant's queue by add order (a preempted request goes back ahead of the
        tenant's never-admitted ones); a new request of a tenant with none waiting lifts its counter."""
        tenant = obj.req.tenant_name
        q = self._queues.get(tenant)
        if q is None:
            if obj.status is _WAITING:
                self._lift(tenant)
            self._queues[tenant] = [obj]
        else:
            bisect.insort(q, obj, key=_seq)
        self._n += 1

    def _lift(self, tenant: str) -> None:
        """VTC's lift: the least counter among the tenants with waiting requests (less the burst B / weight),
        if above the tenant's."""
        own = self.service.setdefault(tenant, 0.0)
        if self._queues:
            low = min(self.service.get(t, 0.0) for t in self._queues) - self.burst_tokens / self.weight(tenant)
            if low > own:
                self.service[tenant] = low

    def started(self, tenant: str) -> None:
        """One of `tenant`'s requests started running (admission)."""
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def stopped(self, tenant: str) -> None:
        """One of `tenant`'s requests stopped running (finished, aborted or preempted)."""
        left = self._running[tenant] - 1
        if left:
            self._running[tenant] = left
        else:
            del self._running[tenant]

    def leads(self, tenant: str) -> bool:
        """Whether another tenant with requests running or waiting has been served fewer tokens per weight
        than `tenant` (served_tokens / weight: lifts left out, so that a flood whose counter a light tenant's
        lift has just caught up with still leads). O(tenants)."""
        w = self.weights
        own = self.served_tokens.get(tenant, 0) / w.get(tenant, 1.0)
        return any(t != tenant and self.served_tokens.get(t, 0) / w.get(t, 1.0) < own
                   for t in (*self._running, *self._queues))

    def rank(self, tenant: str) -> tuple[float, float]:
        """A tenant's standing, lower first: (counter, tokens / weight before lifts)."""
        return (self.service.get(tenant, 0.0), self.served_tokens.get(tenant, 0) / self.weights.get(tenant, 1.0))

    def _key(self, tenant: str) -> tuple[float, float, int]:
        """A waiting tenant's order: its rank, then its head's add order."""
        return (*self.rank(tenant), self._queues[tenant][0].seq)

    def _head_tenant(self) -> str | None:
        return min(self._queues, key=self._key) if self._queues else None

    def head(self) -> Any | None:
        """The oldest waiting request of the tenant with the least counter; None when none waits. O(tenants)."""
        tenant = self._head_tenant()
        return None if tenant is None else self._queues[tenant][0]

    def pop_head(self) -> Any:
        """Take the head out of the queue."""
        obj = self.head()
        self.remove(obj)
        return obj

    def remove(self, obj: Any) -> None:
        """Take `obj` out of the queue (admission, abort, timeout)."""
        tenant = obj.req.tenant_name
        q = self._queues[tenant]
        q.remove(obj)
        if not q:
            del self._queues[tenant]
        self._n -= 1

    def in_order(self) -> list[Any]:
        """The waiting requests in the order admission would take them if admitting cost nothing: the
        tenants by their order (counter, then service before lifts, then head's add order), each tenant's
        queue in add order. O(queue)."""
        tenants = sorted(self._queues, key=self._key)
        return [obj for t in tenants for obj in self._queues[t]]

    def tenants_waiting(self) -> dict[str, int]:
        """tenant -> waiting requests, for the tenants with any."""
        return {t: len(q) for t, q in self._queues.items()}

    def __len__(self) -> int:
        return self._n


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class FairOnePartialPrefill(OnePartialPrefill):
    """Contract steps 2 and 3 under fairness="vtc" with one partial prefill: a less-served tenant's head
    whose whole prompt fits goes in the same step as the partial prefill (module docstring), then the
    contract's admission; with `chunk_tokens` (SchedulerConfig.tenant_chunk_tokens), a leading tenant's
    chunks keep the step within that many tokens and a set-aside head's step gives the partial prefill none.

    Args:
        chunk_tokens: C, tokens, or None (no cap, and a set-aside head shares its step).
    """

    def __init__(self, chunk_tokens: int | None = None) -> None:
        self.chunk_tokens = chunk_tokens
        self._prefill_budget = 0  # this step's budget for prompt chunks (after the decodes), tokens
        self._placed = 0  # this step's decode tokens

    def plan(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[Any],
             decoding: bool) -> tuple[Hashable, ...]:
        """The partial prefill's chunk, spending the budget left after a set-aside head; the head; then
        (unless it preempted) admission in queue order."""
        self._prefill_budget = budget.left
        self._placed = budget.placed
        head = self._set_aside(s, budget) if not victims else None
        if head is None:
            return super().plan(s, budget, out, victims, decoding)
        if self.chunk_tokens is not None:
            return self._head_alone(s, budget, out, victims, decoding, head)
        budget.spend(head.target)
        self._continue(s, budget, out, victims)
        partial_done = bool(out) and out[-1].is_last
        if victims:
            return ()  # a step that preempted admits nothing
        # Looked up after the partial prefill's blocks are taken, which may evict cached blocks.
        start, hits = s.kv.lookup(head)
        n = head.target - start
        if not s.can_admit(head, n, hits):
            if partial_done:
                budget.left += head.target  # the head's share goes back; admission stops at it as usual
                return self._admit(s, budget, out)
            return ()
        s.waiting.remove(head)
        s.admit(head, n, hits, start)
        if head.num_preemptions:
            s.recomputed(n)
        # Ahead of the partial prefill's chunk, which stays the plan's last when it does not finish.
        out.insert(0, ScheduledChunk(head.rid, n, True, start, True))
        if not partial_done:
            return (head.rid,)  # the partial prefill keeps what is left: nothing behind it this step
        budget.left += head.target - n  # a cached prefix leaves its tokens to the next admissions
        return (head.rid, *self._admit(s, budget, out))

    def _head_alone(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[Any],
                    decoding: bool, head: Any) -> tuple[Hashable, ...]:
        """With chunk_tokens: the set-aside head's whole prompt is the step's only chunk (the partial prefill
        waits one step, so nothing is admitted behind it); if the KV manager does not admit the head, the
        step as without the set-aside."""
        start, hits = s.kv.lookup(head)
        n = head.target - start
        if not s.can_admit(head, n, hits):
            return super().plan(s, budget, out, victims, decoding)
        s.waiting.remove(head)
        s.admit(head, n, hits, start)
        if head.num_preemptions:
            s.recomputed(n)
        out.append(ScheduledChunk(head.rid, n, True, start, True))
        return (head.rid,)

    def _limit(self, s: PrefillHost, obj: Any, left: int) -> int:
        """`left`, or for a tenant that leads (VTCQueue.leads) at most what keeps the step within chunk_tokens
        (C less the step's decode tokens and the chunks placed before it, never below step_cap_floor)."""
        c = self.chunk_tokens
        if c is None:
            return left
        c = max(c - self._placed - (self._prefill_budget - left), step_cap_floor(c, s.chunking.block_size))
        if left <= c:
            return left
        queue = s.waiting
        return c if isinstance(queue, VTCQueue) and queue.leads(obj.req.tenant_name) else left

    def _continue(self, s: PrefillHost, budget: StepBudget, out: list[ScheduledChunk], victims: list[Any]) -> None:
        """Contract step 2, except that a partial prefill short of KV blocks is its own victim even when
        requests were admitted beside it (after it): they may be decodes of this very plan already; its
        chunk is at most chunk_tokens while its tenant leads."""
        obj = s.partials[0] if s.partials else None
        if obj is None or budget.left <= 0:
            return
        done = obj.num_prefilled
        rest = obj.target - done
        n = s.chunking.chunk(rest, self._limit(s, obj, budget.left))
        if n and s.chunk_cap is not None:
            n = s.cap(obj, done, n)
        if n and not s.kv.grow(obj, done + n, s.step):
            s.preempt(obj, s.step, victims)
            return
        if n:
            if obj.num_preemptions:
                s.recomputed(n)
            out.append(ScheduledChunk(obj.rid, n, True, done, n == rest))
        if n == rest:
            budget.spend(n)
        else:
            budget.close()

    def _set_aside(self, s: PrefillHost, budget: StepBudget) -> Any | None:
        """The head to serve beside the partial prefill, or None: a partial prefill continues, the head's
        tenant has less service than its tenant, its whole prompt fits the budget left (without
        chunk_tokens: with room for a chunk of the partial prefill), and a slot is free."""
        if not s.partials or not s.admitting or s.chunk_cap is not None or s.refused or budget.left <= 0:
            return None
        queue = s.waiting
        if not isinstance(queue, VTCQueue):
            return None
        head = queue.head()
        partial = s.partials[0]
        if head is None or s.num_running >= s.max_seqs or head.target > budget.left:
            return None
        if queue.rank(head.req.tenant_name) >= queue.rank(partial.req.tenant_name):
            return None
        if s.chunking.chunk(head.target, budget.left) != head.target:
            return None
        if self.chunk_tokens is None and not s.chunking.chunk(
                partial.target - partial.num_prefilled, budget.left - head.target):
            return None  # the partial prefill (maybe the oldest running request) still progresses
        return head


def step_cap_floor(chunk_tokens: int, block_size: int | None) -> int:
    """The fewest tokens a leading tenant's chunk is cut to under tenant_chunk_tokens C, however full the step:
    C // 4 (at least 1), rounded up to whole blocks when chunks are block-aligned, never above C; so a
    leading tenant's prompt always moves on (a step's decodes alone may pass C)."""
    floor = max(chunk_tokens // 4, 1)
    if block_size:
        floor = -(-floor // block_size) * block_size
    return min(floor, chunk_tokens)


def _check_seconds_or_weight(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidConfig(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_tenant_map(name: str, value: object) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise InvalidConfig(f"{name} must be a mapping of tenant name to a number > 0, got {value!r}")
    out = {}
    for tenant, v in value.items():
        if not isinstance(tenant, str) or not tenant:
            raise InvalidConfig(f"{name}: a tenant name must be a non-empty str, got {tenant!r}")
        out[tenant] = _check_seconds_or_weight(f"{name}[{tenant!r}]", v)
    return out


def check_fairness(
    fairness: object, tenant_weights: object, max_queue_time_s: object, *, policy: object,
    max_num_partial_prefills: object, clock: Callable[[], float] | None,
) -> None:
    """Validate the tenant options of SchedulerConfig and how they combine with the others.

    Args:
        fairness: "fcfs" or "vtc".
        tenant_weights: None or tenant -> weight (finite, > 0); "vtc" only.
        max_queue_time_s: None, seconds (finite, > 0) for every request, or tenant -> seconds (tenants
            not named have no limit); needs `clock`, the scheduler's reading of time.
        policy, max_num_partial_prefills, clock: the config's.

    Raises:
        InvalidConfig: an unknown fairness; a weight or limit <= 0, non-finite or not a number; weights
            without "vtc"; "vtc" with policy="priority" (two orders for one queue) or with
            max_num_partial_prefills > 1 (its admission passes long prompts over, which a per-tenant
            FCFS order does not allow); max_queue_time_s without a clock.
    """
    if fairness not in FAIRNESS:
        raise InvalidConfig(f"fairness must be one of {', '.join(map(repr, FAIRNESS))}, got {fairness!r}")
    if tenant_weights is not None:
        _check_tenant_map("tenant_weights", tenant_weights)
        if fairness != "vtc":
            raise InvalidConfig(f"tenant_weights apply to fairness='vtc', got fairness={fairness!r}")
    if fairness == "vtc" and policy != "fcfs":
        raise InvalidConfig(f"fairness='vtc' orders admission by tenant service; it needs policy='fcfs', "
                            f"got policy={policy!r}")
    if fairness == "vtc" and max_num_partial_prefills != 1:
        raise InvalidConfig(f"fairness='vtc' needs max_num_partial_prefills=1, got {max_num_partial_prefills!r}")
    if max_queue_time_s is not None:
        if isinstance(max_queue_time_s, Mapping):
            _check_tenant_map("max_queue_time_s", max_queue_time_s)
        else:
            _check_seconds_or_weight("max_queue_time_s", max_queue_time_s)
        if clock is None:
            raise InvalidConfig("max_queue_time_s needs the scheduler's clock (clock=, seconds) to know how long "
                                "a request has waited; got clock=None")


def check_isolation(fairness: object, chunk_tokens: object, burst_tokens: object, alignment: int | None,
                    cpu_kv_tokens: object) -> None:
    """Validate SchedulerConfig.tenant_chunk_tokens and tenant_burst_tokens.

    Args:
        fairness: the config's fairness.
        chunk_tokens: None or C, an integer >= 1 (>= `alignment` when chunks are aligned); "vtc" only.
        burst_tokens: B, an integer >= 0; > 0 with "vtc" only.
        alignment: block_size when chunks are block-aligned, else None.
        cpu_kv_tokens: the config's CPU KV tier (tokens); the chunk cap needs the set-aside rule, which a
            CPU tier turns off.

    Raises:
        InvalidConfig: a value out of range or not an integer, either option without "vtc", or
            tenant_chunk_tokens with a CPU KV tier (the message names the field and the value).
    """
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise InvalidConfig(f"tenant_chunk_tokens must be an integer >= 1 (tokens), got {chunk_tokens!r}")
        if fairness != "vtc":
            raise InvalidConfig(f"tenant_chunk_tokens applies to fairness='vtc', got fairness={fairness!r}")
        if alignment is not None and chunk_tokens < alignment:
            raise InvalidConfig(f"tenant_chunk_tokens ({chunk_tokens}) must be >= block_size ({alignment}) when "
                                "chunks are aligned to blocks")
        if cpu_kv_tokens:
            raise InvalidConfig(f"tenant_chunk_tokens={chunk_tokens} does not go with cpu_kv_tokens={cpu_kv_tokens} "
                                "(a CPU KV tier turns off the set-aside the cap is part of)")
    if isinstance(burst_tokens, bool) or not isinstance(burst_tokens, int) or burst_tokens < 0:
        raise InvalidConfig(f"tenant_burst_tokens must be an integer >= 0 (tokens), got {burst_tokens!r}")
    if burst_tokens and fairness != "vtc":
        raise InvalidConfig(f"tenant_burst_tokens applies to fairness='vtc', got fairness={fairness!r}")


def queue_limit_of(max_queue_time_s: float | Mapping[str, float] | None) -> Callable[[Hashable], float | None]:
    """tenant name -> its queue time limit in seconds (None: no limit), from SchedulerConfig.max_queue_time_s."""
    # Module functions, a dict's bound get and a partial rather than lambdas: a scheduler keeps the answer,
    # and Scheduler.snapshot deep-copies it, which a compiled lambda (setup.py's compiled build) refuses.
    if max_queue_time_s is None:
        return _no_queue_limit
    if isinstance(max_queue_time_s, Mapping):
        return dict(max_queue_time_s).get  # type: ignore[return-value]
    return partial(_one_queue_limit, float(max_queue_time_s))


def _no_queue_limit(tenant: Hashable) -> float | None:
    return None


def _one_queue_limit(limit: float, tenant: Hashable) -> float | None:
    return limit
