"""Tenants: VTC admission (fairness="vtc"), its bound, queue time limits, and the refusals."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import drive_randomly, make_scheduler, run_to_end
from stallfree import Request, Scheduler
from stallfree.core.errors import InvalidConfig, RequestRejected
from stallfree.core.fairness import step_cap_floor
from stallfree.core.invariants import InvariantChecker
from stallfree.core.prefix_cache import hash_blocks
from stallfree.core.request import FinishReason


def _admissions(sched: Scheduler, steps: int) -> list[object]:
    out: list[object] = []
    for _ in range(steps):
        plan = sched.schedule()
        out.extend(plan.admitted)
        sched.complete(plan)
    return out


def test_light_tenant_is_admitted_before_the_flood():
    """Budget 8: tenant a's first 8-token prompt runs in step 0 (a: 8 tokens); b's request, added behind a's
    three others, is admitted in step 1 since b has 0 tokens of service against a's 8."""
    s = make_scheduler(8, 4, 200, fairness="vtc")
    for i in range(4):
        s.add(Request(("a", i), 8, 3, tenant="a"))
    s.add(Request(("b", 0), 8, 3, tenant="b"))
    assert _admissions(s, 2) == [("a", 0), ("b", 0)]
    assert s.stats().tenant_served_tokens == {"a": 9, "b": 7}
    assert s.stats().tenant_counters == {"a": 9.0, "b": 7.0}


def test_fcfs_admits_the_flood_first():
    """The same queue under the default fairness="fcfs": strictly in add order, b last."""
    s = make_scheduler(8, 4, 200)
    for i in range(4):
        s.add(Request(("a", i), 8, 3, tenant="a"))
    s.add(Request(("b", 0), 8, 3, tenant="b"))
    plans, first, _ = run_to_end(s)
    assert first[("b", 0)] > max(first[("a", i)] for i in range(4))
    assert s.stats().tenant_served_tokens == {}


def test_weights_share_admissions_two_to_one():
    """Budget 4, 4-token prompts with max_new 1 (one admission a step, no decodes): a weighs 2, so each of its
    requests adds 2 to its counter and each of b's adds 4; ties go to a (its head was added first). Worked
    out: a b a a b a a b a a b."""
    s = make_scheduler(4, 4, 200, fairness="vtc", tenant_weights={"a": 2.0})
    for i in range(10):
        s.add(Request(("a", i), 4, 1, tenant="a"))
    for i in range(10):
        s.add(Request(("b", i), 4, 1, tenant="b"))
    got = [rid[0] for rid in _admissions(s, 11)]  # type: ignore[index]
    assert "".join(got) == "abaabaabaab"
    assert s.stats().tenant_served_tokens == {"a": 28, "b": 16}


def test_idle_tenant_is_lifted_to_the_least_waiting_counter():
    """A tenant that had nothing waiting is lifted to the least counter among the tenants with waiting
    requests (a's 16 here), not left at 0 to take the next 16 tokens alone; with nobody waiting it keeps
    its own counter."""
    s = make_scheduler(8, 1, 200, fairness="vtc")
    for i in range(3):
        s.add(Request(("a", i), 8, 1, tenant="a"))
    _admissions(s, 2)
    assert s.stats().tenant_counters == {"a": 16.0}
    s.add(Request(("b", 0), 8, 1, tenant="b"))
    assert s.stats().tenant_counters["b"] == 16.0
    _admissions(s, 3)  # b's (a tie at 16: b has less service before lifts), then a's third
    s.add(Request(("c", 0), 4, 1, tenant="c"))  # nobody waits: c starts from 0
    assert s.stats().tenant_counters["c"] == 0.0


def test_tenants_are_ignored_under_fcfs():
    """With fairness="fcfs" a request's tenant changes nothing: the same plans with and without tenants."""
    rng = random.Random(3)
    reqs = [(i, rng.randint(1, 40), rng.randint(1, 9), rng.randint(0, 20)) for i in range(30)]

    def run(with_tenant: bool):
        arrivals: dict[int, list[Request]] = {}
        for rid, p, m, t in reqs:
            tenant = f"t{rid % 3}" if with_tenant else None
            arrivals.setdefault(t, []).append(Request(rid, p, m, tenant=tenant))
        return run_to_end(make_scheduler(16, 3, 300), arrivals)

    assert run(True) == run(False)


_TENANT_TOKEN = {"t0": 1, "t1": 2, "t2": 3, None: 4}


def _vtc_run(seed: int, kv_policy: str, n: int = 40, isolation: bool = False) -> InvariantChecker:
    rng = random.Random(seed)
    budget = rng.choice([4, 16, 64])
    opts: dict[str, object] = {"fairness": "vtc", "tenant_weights": {"t0": rng.choice([0.5, 1.0, 3.0])}}
    if isolation:
        opts.update(tenant_chunk_tokens=rng.choice([1, 4, 9, 32]), tenant_burst_tokens=rng.choice([0, 6, 50]))
    caching = kv_policy == "paged+cache"
    if kv_policy != "reserve":
        opts.update(kv_policy="paged", block_size=4, enable_prefix_caching=caching)
        if isolation and rng.random() < 0.5:
            # A capped chunk is rounded down to a block boundary; C is at least a block.
            opts.update(align_chunks=True, tenant_chunk_tokens=max(4, int(str(opts["tenant_chunk_tokens"]))))
    reqs = []
    for i in range(n):
        tenant = rng.choice(["t0", "t1", "t2", None])
        p = rng.randint(1, 120)
        # Prompts of one tenant share a prefix of its name's tokens, so that cached blocks are hit.
        hashes = hash_blocks([_TENANT_TOKEN[tenant]] * (p // 2) + [i] * (p - p // 2), 4)[: p // 4] if caching else None
        reqs.append(Request(i, p, rng.randint(1, 30), tenant=tenant, block_hashes=hashes))
    kv = max(r.prompt_len + r.max_new for r in reqs) + 3
    kv = kv + rng.choice([0, kv, 10 * kv])
    sched = make_scheduler(budget, rng.randint(1, 6), kv, **opts)
    chk = InvariantChecker(sched)
    arrive = sorted(rng.randint(0, 80) for _ in reqs)
    drive_randomly(chk, sched, reqs, arrive, rng, p_abort=rng.choice([0.0, 0.05]), p_stop=0.05,
                   abort_in_flight=True)
    return chk


@pytest.mark.parametrize(
    ("kv_policy", "runs"),
    [("reserve", 6), ("paged", 6), ("paged+cache", 6),
     pytest.param("reserve", 30, marks=pytest.mark.slow), pytest.param("paged", 30, marks=pytest.mark.slow),
     pytest.param("paged+cache", 30, marks=pytest.mark.slow)],
    ids=["reserve-6", "paged-6", "cache-6", "reserve-30", "paged-30", "cache-30"],
)
def test_vtc_random_runs_keep_every_invariant(kv_policy, runs):
    """Seeded runs with three tenants and the default one, random weights, arrivals, aborts and early
    stops: the checker's own counters pick the same heads (FCFS within a tenant), count the same tokens per
    tenant, and every other invariant holds; paged runs preempt by the usual victim rule."""
    preempted = 0
    for seed in range(runs):
        chk = _vtc_run(seed, kv_policy)
        preempted += chk.num_preemptions
    if kv_policy != "reserve":
        assert preempted > 0  # the victim rule was exercised


@pytest.mark.parametrize(
    ("kv_policy", "runs"),
    [("reserve", 6), ("paged", 12), ("paged+cache", 12),
     pytest.param("reserve", 30, marks=pytest.mark.slow), pytest.param("paged", 30, marks=pytest.mark.slow),
     pytest.param("paged+cache", 30, marks=pytest.mark.slow)],
    ids=["reserve-6", "paged-12", "cache-12", "reserve-30", "paged-30", "cache-30"],
)
def test_vtc_isolation_random_runs_keep_every_invariant(kv_policy, runs):
    """The same seeded runs with tenant_chunk_tokens and tenant_burst_tokens drawn at random: the checker
    works out every capped chunk, every set-aside head alone in its step and every lift with its credit."""
    preempted = 0
    for seed in range(runs):
        preempted += _vtc_run(seed, kv_policy, isolation=True).num_preemptions
    if kv_policy != "reserve":
        assert preempted > 0  # the victim rule was exercised


def _bound_run(seed: int, kv_policy: str, isolation: bool = False) -> tuple[float, float]:
    """Two tenants backlogged from step 0; returns (largest counter difference seen, in weighted tokens,
    while both still had waiting requests after the step; the bound U / w of the one ahead)."""
    rng = random.Random(seed)
    w = {"a": rng.choice([1.0, 2.0, 0.5]), "b": 1.0}
    opts: dict[str, object] = {"fairness": "vtc", "tenant_weights": w}
    if isolation:  # the cap changes chunk sizes only; no lift happens while both are backlogged
        opts.update(tenant_chunk_tokens=rng.choice([4, 16]), tenant_burst_tokens=rng.choice([0, 64]))
    if kv_policy == "paged":
        opts.update(kv_policy="paged", block_size=4)
    reqs = [Request(i, rng.randint(1, 200), rng.randint(1, 40), tenant=rng.choice("ab")) for i in range(60)]
    largest = max(r.prompt_len + r.max_new for r in reqs) + 3
    kv = largest + rng.choice([0, largest, 5 * largest])
    max_seqs = rng.randint(1, 8)
    sched = make_scheduler(rng.choice([8, 32, 128]), max_seqs, kv, **opts)
    for r in reqs:
        sched.add(r)
    tenant_of = {r.rid: r.tenant for r in reqs}
    u = max_seqs * largest if kv_policy == "paged" else min(kv, max_seqs * largest)
    worst = ratio = 0.0
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.complete(plan, [])
        if {tenant_of[r] for r in sched.waiting_order()} != {"a", "b"}:
            break
        c = sched.stats().tenant_counters
        d = c["a"] - c["b"]
        ahead = "a" if d > 0 else "b"
        assert abs(d) <= u / w[ahead] + 1e-9, (seed, d, u, w)
        worst = max(worst, abs(d))
        ratio = max(ratio, abs(d) * w[ahead] / u)
    return worst, ratio


@pytest.mark.parametrize(
    ("kv_policy", "runs"),
    [("reserve", 10), ("paged", 10),
     pytest.param("reserve", 40, marks=pytest.mark.slow), pytest.param("paged", 40, marks=pytest.mark.slow)],
    ids=["reserve-10", "paged-10", "reserve-40", "paged-40"],
)
def test_fairness_bound_holds_in_seeded_runs(kv_policy, runs, capsys):
    """While two tenants are both backlogged, their counters differ by at most U / w (U: the most tokens
    one tenant's running requests can still be charged; stallfree.core.fairness) in seeded runs, with and
    without the isolation options."""
    for isolation in (False, True):
        ratios = [_bound_run(seed, kv_policy, isolation)[1] for seed in range(runs)]
        with capsys.disabled():
            print(f"\n[vtc bound, {kv_policy}{', isolation' if isolation else ''}] largest |difference| x w / U "
                  f"over {runs} runs: {max(ratios):.3f}")
        assert 0 < max(ratios) <= 1.0


@settings(max_examples=25)
@given(seed=st.integers(0, 10_000), paged=st.booleans(), isolation=st.booleans())
def test_fairness_bound_hypothesis(seed, paged, isolation):
    """The bound of test_fairness_bound_holds_in_seeded_runs for arbitrary seeds (Hypothesis)."""
    _bound_run(seed, "paged" if paged else "reserve", isolation)


# ---------------------------------------------------------------- queue time limits


class _StepClock:
    """A clock reading 1 second per schedule() call, starting at 0."""

    def __init__(self) -> None:
        self._c = itertools.count()

    def __call__(self) -> float:
        return float(next(self._c))


def test_queue_timeout_hand_trace():
    """One slot, limit 2 s, a clock reading the step number: request 1 runs 5 steps; request 2 (arrived at
    0 s) has waited 3 s > 2 s at step 3 and is finished there with reason "timeout", holding no KV; an abort
    of it afterwards is a no-op."""
    s = make_scheduler(8, 1, 100, max_queue_time_s=2.0, clock=_StepClock())
    s.add(Request(1, 8, 5))
    s.add(Request(2, 4, 2))
    seen = []
    for _ in range(4):
        plan = s.schedule()
        seen.append(plan.timed_out)
        s.complete(plan)
    assert seen == [(), (), (), (2,)]
    assert s.last_finished == {2: FinishReason.TIMEOUT}
    assert s.num_waiting == 0 and 2 not in s
    assert s.kv_free == 100 - 13
    s.abort(2)
    assert FinishReason.TIMEOUT == "timeout"


def test_queue_timeout_per_tenant_and_preempted_never_shed():
    """Limits per tenant: only tenant "x" is limited (0.5 s); the default tenant's request waits on."""
    s = make_scheduler(8, 1, 100, max_queue_time_s={"x": 0.5}, clock=_StepClock())
    s.add(Request(1, 8, 4))
    s.add(Request(2, 4, 2, tenant="x"))
    s.add(Request(3, 4, 2))
    plan = s.schedule()
    s.complete(plan)
    plan = s.schedule()
    assert plan.timed_out == (2,)
    s.complete(plan)
    assert s.waiting_order() == (3,)


@pytest.mark.parametrize("fairness", ["fcfs", "vtc"])
def test_queue_timeouts_random_runs_keep_every_invariant(fairness):
    """20 seeded runs with a step clock and tight limits: timed-out requests are exactly the never-admitted
    ones past their limit, they hold no KV, and every other invariant holds."""
    shed = 0
    for seed in range(20):
        rng = random.Random(seed)
        arrive = sorted(rng.randint(0, 60) for _ in range(30))
        reqs = [Request(i, rng.randint(1, 60), rng.randint(1, 20), arrival=float(arrive[i]),
                        tenant=rng.choice(["a", "b"])) for i in range(30)]
        limit: object = rng.choice([3.0, 8.0, {"a": 2.0}])
        opts: dict[str, object] = {"max_queue_time_s": limit, "clock": _StepClock(), "fairness": fairness}
        if seed % 2:
            opts.update(kv_policy="paged", block_size=4)
        sched = make_scheduler(rng.choice([8, 32]), rng.randint(1, 3), 200, **opts)
        chk = _Counting(InvariantChecker(sched))
        drive_randomly(chk, sched, reqs, arrive, rng, p_abort=0.03, p_stop=0.05)
        shed += chk.shed
    assert shed > 0  # the rule was exercised


class _Counting:
    """Forwards to a checker and counts the requests the plans timed out."""

    def __init__(self, chk: InvariantChecker) -> None:
        self.chk, self.shed = chk, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.chk, name)

    def schedule(self):
        plan = self.chk.schedule()
        self.shed += len(plan.timed_out)
        return plan


def test_queue_timeouts_are_shed_in_random_runs():
    """Under a flood (one slot, 20 requests at once, limit 3 s) most requests are shed, none running."""
    s = make_scheduler(16, 1, 500, max_queue_time_s=3.0, clock=_StepClock())
    for i in range(20):
        s.add(Request(i, 10, 4))
    timed_out: list[object] = []
    while s.has_unfinished():
        plan = s.schedule()
        timed_out.extend(plan.timed_out)
        s.complete(plan)
    # Step 0 admits 0 (4 steps: prefill + 3 decodes); at step 4 (waited 4 s > 3 s) the other 19 are shed.
    assert sorted(timed_out) == list(range(1, 20))  # type: ignore[type-var]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"fairness": "wfq"}, "fairness must be one of 'fcfs', 'vtc', got 'wfq'"),
        ({"fairness": "vtc", "tenant_weights": {"a": 0}}, "tenant_weights['a'] must be a finite number > 0, got 0"),
        ({"fairness": "vtc", "tenant_weights": {"a": -1.0}}, "got -1.0"),
        ({"fairness": "vtc", "tenant_weights": {"a": math.inf}}, "got inf"),
        ({"fairness": "vtc", "tenant_weights": {"a": math.nan}}, "got nan"),
        ({"fairness": "vtc", "tenant_weights": {"a": True}}, "got True"),
        ({"fairness": "vtc", "tenant_weights": {"": 1.0}}, "a tenant name must be a non-empty str"),
        ({"fairness": "vtc", "tenant_weights": [1.0]}, "tenant_weights must be a mapping"),
        ({"tenant_weights": {"a": 1.0}}, "tenant_weights apply to fairness='vtc'"),
        ({"fairness": "vtc", "policy": "priority"}, "needs policy='fcfs', got policy='priority'"),
        ({"fairness": "vtc", "max_num_partial_prefills": 2, "long_prefill_token_threshold": 8},
         "fairness='vtc' needs max_num_partial_prefills=1, got 2"),
        ({"max_queue_time_s": 1.0}, "max_queue_time_s needs the scheduler's clock"),
        ({"max_queue_time_s": 0.0, "clock": lambda: 0.0}, "max_queue_time_s must be a finite number > 0, got 0.0"),
        ({"max_queue_time_s": {"a": math.inf}, "clock": lambda: 0.0}, "max_queue_time_s['a']"),
        ({"fairness": "vtc", "max_loras": 2}, "max_loras=2 (the LoRA adapter limit) does not go with fairness='vtc'"),
        ({"fairness": "vtc", "tenant_chunk_tokens": 0}, "tenant_chunk_tokens must be an integer >= 1 (tokens), got 0"),
        ({"fairness": "vtc", "tenant_chunk_tokens": 8.0}, "got 8.0"),
        ({"tenant_chunk_tokens": 8}, "tenant_chunk_tokens applies to fairness='vtc', got fairness='fcfs'"),
        ({"fairness": "vtc", "tenant_chunk_tokens": 8, "block_size": 16},
         "tenant_chunk_tokens (8) must be >= block_size (16) when chunks are aligned"),
        ({"fairness": "vtc", "tenant_chunk_tokens": 16, "kv_policy": "paged", "block_size": 16,
          "enable_prefix_caching": True, "cpu_kv_tokens": 64}, "does not go with cpu_kv_tokens=64"),
        ({"fairness": "vtc", "tenant_burst_tokens": -1},
         "tenant_burst_tokens must be an integer >= 0 (tokens), got -1"),
        ({"tenant_burst_tokens": 5}, "tenant_burst_tokens applies to fairness='vtc', got fairness='fcfs'"),
    ],
    ids=["unknown", "weight-0", "weight-neg", "weight-inf", "weight-nan", "weight-bool", "empty-name",
         "not-mapping", "weights-fcfs", "priority", "partials", "no-clock", "limit-0", "limit-inf", "lora",
         "chunk-0", "chunk-float", "chunk-fcfs", "chunk-unaligned", "chunk-cpu-tier", "burst-neg", "burst-fcfs"],
)
def test_bad_tenant_options_are_refused(options, words):
    """Each bad tenant option is one InvalidConfig naming the field and the value."""
    with pytest.raises(InvalidConfig) as e:
        make_scheduler(**options)
    assert words in str(e.value)


@pytest.mark.parametrize("tenant", ["", 3, "x" * 129], ids=["empty", "int", "too-long"])
def test_bad_tenant_is_rejected(tenant):
    """A tenant that is not None nor a 1-128 character str is refused, naming the field."""
    with pytest.raises(RequestRejected, match="tenant must be None or a non-empty str"):
        Request(1, 4, 2, tenant=tenant)


def test_front_add_is_refused_under_vtc_and_nothing_is_queued():
    """add(front=True) needs one queue: refused under "vtc", the request not queued."""
    s = make_scheduler(8, 1, 100, fairness="vtc")
    with pytest.raises(RequestRejected, match="fairness='fcfs'"):
        s.add(Request(1, 4, 2), front=True)
    assert s.num_waiting == 0 and 1 not in s


def test_caller_dict_cannot_change_a_checked_config():
    """The weights are copied when the config is made: a later change of the caller's dict changes nothing."""
    weights = {"a": 2.0}
    s = make_scheduler(8, 1, 100, fairness="vtc", tenant_weights=weights)
    weights["a"] = -1.0
    assert s.config.tenant_weights == {"a": 2.0}


def _plans(sched: Scheduler, late: Request, steps: int) -> list[list[tuple[object, int, int]]]:
    out = []
    for step in range(steps):
        if step == 1:
            sched.add(late)
        plan = sched.schedule()
        out.append([(c.rid, c.num_tokens, c.start) for c in plan])
        sched.complete(plan)
    return out


def test_a_less_served_head_goes_beside_the_partial_prefill():
    """Budget 8, reserve: tenant a's 30-token prompt starts in step 0 (a: 8 tokens). b's 3-token prompt
    arrives at step 1 with 0 service: its whole prompt is set aside from the budget (its chunk first), the
    partial prefill takes the other 5, and b's first token comes out of step 1. Under FCFS b waits for a's
    prefill (8, 8, 8, 6) and starts in step 3 with the 2 tokens left."""
    late = Request("b", 3, 1, tenant="b")
    s = make_scheduler(8, 4, 100, fairness="vtc")
    s.add(Request("a", 30, 2, tenant="a"))
    vtc = _plans(s, late, 3)
    assert vtc == [[("a", 8, 0)], [("b", 3, 0), ("a", 5, 8)], [("a", 8, 13)]]
    f = make_scheduler(8, 4, 100)
    f.add(Request("a", 30, 2, tenant="a"))
    fcfs = _plans(f, late, 5)
    assert fcfs == [[("a", 8, 0)], [("a", 8, 8)], [("a", 8, 16)], [("a", 6, 24), ("b", 2, 0)],
                    [("a", 1, 30), ("b", 1, 2)]]


def test_set_aside_under_paged_kv():
    """Under kv_policy="paged" the same step: b's 3-token prompt beside a's partial prefill."""
    s = make_scheduler(8, 4, 128, fairness="vtc", kv_policy="paged", block_size=4)
    s.add(Request("a", 30, 2, tenant="a"))
    plans = _plans(s, Request("b", 3, 1, tenant="b"), 3)
    assert plans[1] == [("b", 3, 0), ("a", 5, 8)]


def test_no_set_aside_when_it_would_stop_the_partial_prefill():
    """b's 8-token prompt would take the whole budget of 8: the partial prefill goes on, b waits for it."""
    s = make_scheduler(8, 4, 100, fairness="vtc")
    s.add(Request("a", 30, 2, tenant="a"))
    plans = _plans(s, Request("b", 8, 1, tenant="b"), 4)
    assert plans[1] == [("a", 8, 8)] and plans[3] == [("a", 6, 24), ("b", 2, 0)]


def test_isolation_caps_the_leading_tenant_and_gives_the_head_its_step_alone():
    """Budget 8, reserve, tenant_chunk_tokens=4. Step 0: a's 30-token prompt, no other tenant: 8 tokens (a: 8).
    Step 1: b's 3-token prompt (max_new 3) arrives with 0 service: set aside, and the partial prefill takes no
    chunk, so the step is b's prompt alone (b: 3). Steps 2 and 3: b decodes (b: 4, then 5) and is running
    with less service than a, so a leads and its chunk keeps the step within 4 tokens: 4 - b's decode = 3
    (a: 11, 14). b finishes in step 3; alone again, a takes 8 and then its last 8."""
    s = make_scheduler(8, 4, 100, fairness="vtc", tenant_chunk_tokens=4)
    s.add(Request("a", 30, 2, tenant="a"))
    plans = _plans(s, Request("b", 3, 3, tenant="b"), 6)
    assert plans == [[("a", 8, 0)], [("b", 3, 0)], [("b", 1, 3), ("a", 3, 8)], [("b", 1, 4), ("a", 3, 11)],
                     [("a", 8, 14)], [("a", 8, 22)]]
    assert s.stats().tenant_counters == {"a": 30.0, "b": 5.0}


def test_the_least_served_tenant_is_never_capped():
    """Budget 16, tenant_chunk_tokens=4. Step 0: a0's 12-token prompt (a: 12). Step 1: a0 decodes (a: 13); b,
    with 0 service, is admitted with its whole 10-token prompt (b: 10); then a's next prompt leads (b served
    10 tokens to a's 13): the step already holds 11 tokens, past C, so a1 gets the floor, max(4 // 4, 1) = 1."""
    s = make_scheduler(16, 4, 200, fairness="vtc", tenant_chunk_tokens=4)
    s.add(Request("a0", 12, 5, tenant="a"))
    plan = s.schedule()
    s.complete(plan)
    s.add(Request("b0", 10, 2, tenant="b"))
    s.add(Request("a1", 20, 2, tenant="a"))
    plan = s.schedule()
    assert [(c.rid, c.num_tokens) for c in plan] == [("a0", 1), ("b0", 10), ("a1", 1)]
    assert s.stats().tenant_counters == {"a": 14.0, "b": 10.0}


def test_the_step_cap_counts_decodes_and_earlier_chunks_down_to_its_floor():
    """tenant_chunk_tokens=C bounds the step, not the chunk: C 64, budget 256. a0 (300-token prompt) runs
    alone: 256 (a: 256). b0 (4 tokens, 3 out) arrives: set aside alone (b: 4). Next step: b0's decode (1) and
    a0's last 44 tokens, within 64 - 1 = 63. The floor: C // 4 (at least 1), rounded up to whole blocks when
    chunks are block-aligned, at most C."""
    s = make_scheduler(256, 4, 1000, fairness="vtc", tenant_chunk_tokens=64)
    s.add(Request("a0", 300, 2, tenant="a"))
    plans = _plans(s, Request("b0", 4, 3, tenant="b"), 3)
    assert plans == [[("a0", 256, 0)], [("b0", 4, 0)], [("b0", 1, 4), ("a0", 44, 256)]]
    s = make_scheduler(256, 4, 1000, fairness="vtc", tenant_chunk_tokens=64)
    s.add(Request("a0", 600, 2, tenant="a"))
    plans = _plans(s, Request("b0", 4, 3, tenant="b"), 3)
    assert plans[2] == [("b0", 1, 4), ("a0", 63, 256)]
    assert [step_cap_floor(64, None), step_cap_floor(64, 16), step_cap_floor(20, 16), step_cap_floor(3, None),
            step_cap_floor(16, 16), step_cap_floor(200, 16)] == [16, 16, 16, 1, 16, 64]


def test_a_lifted_tenant_ahead_on_counters_still_caps_the_flood():
    """Budget 8, tenant_chunk_tokens=4. Step 0: a0's 30-token prompt takes 8 (a: 8); a1 waits. Step 1: b
    arrives and is lifted to a's counter, 8, and its 3-token prompt is set aside alone (b: 11, served 3).
    Step 2: b decodes (b: 12, served 4). On counters b (12) ranks after a (8), but a was served 8 tokens to
    b's 4, so a still leads and a0's chunk keeps the step within 4: 3 beside b's decode (ranked by counters
    it would take the 7 left)."""
    s = make_scheduler(8, 4, 200, fairness="vtc", tenant_chunk_tokens=4)
    s.add(Request("a0", 30, 2, tenant="a"))
    s.add(Request("a1", 8, 2, tenant="a"))
    plans = _plans(s, Request("b", 3, 3, tenant="b"), 4)
    assert plans == [[("a0", 8, 0)], [("b", 3, 0)], [("b", 1, 3), ("a0", 3, 8)], [("b", 1, 4), ("a0", 3, 11)]]
    assert s.stats().tenant_counters == {"a": 14.0, "b": 13.0}
    assert s.stats().tenant_served_tokens == {"a": 14, "b": 5}


def test_burst_leaves_an_idle_tenant_credit_below_the_least_waiting_counter():
    """tenant_burst_tokens=4: b, idle, is lifted to a's 16 less 4 / weight: 12 at weight 1, 14 at weight 2;
    so it is admitted next."""
    for weight, lifted in ((1.0, 12.0), (2.0, 14.0)):
        s = make_scheduler(8, 1, 200, fairness="vtc", tenant_burst_tokens=4, tenant_weights={"b": weight})
        for i in range(3):
            s.add(Request(("a", i), 8, 1, tenant="a"))
        _admissions(s, 2)
        s.add(Request(("b", 0), 8, 1, tenant="b"))
        assert s.stats().tenant_counters == {"a": 16.0, "b": lifted}
        assert _admissions(s, 1) == [("b", 0)]


def test_lora_and_tenant_are_both_kept_by_keyword_and_position():
    """lora comes before tenant among Request's fields: a tenant passed by keyword is not taken for an adapter."""
    r = Request(1, 4, 2, 0, 0.0, None, "a1", "t1")
    assert (r.lora, r.tenant, r.tenant_name) == ("a1", "t1", "t1")
    assert Request(2, 4, 2, tenant="t2").lora is None
