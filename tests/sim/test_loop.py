"""The one event loop (stallfree.sim.run.loop): its single-replica path against the general one, the order
of events at one instant, the finish hook and the admission gate, and its errors."""

from __future__ import annotations

import random

import pytest

from cluster_runs import COST, assert_same_runs, run_cluster
from stallfree.core.request import Request
from stallfree.sim import SimResult, Workload
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.config import make_scheduler
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.loop import Entry, EventLoop, PassGate
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.result import ClusterError, SimulationError
from stallfree.sim.run.simulator import new_result, plan_run, request_maker


def run(wl: Workload, cfg: SchedulerConfig, solo: bool, closed: ClosedLoop | None = None,
        max_model_len: int | None = None) -> tuple[SimResult, list[float]]:
    """One replica through the loop, on its single-replica path as simulate runs it (solo) or the general one."""
    max_new, too_long, target, config, _ = plan_run(wl, cfg, COST, None, max_model_len, False, None, closed)
    inner = make_scheduler(cfg)
    res = new_result("x", wl, config, target, max_new, inner)
    rep = Replica(0, inner, inner, res, COST)
    arrivals = Arrivals(wl, closed)
    entry = Entry([rep], None, request_maker(wl, max_new, inner, arrivals.times), too_long, arrivals)
    loop = EventLoop([rep], arrivals, entry, arrivals.on_finish if closed else None,
                     PassGate(arrivals.ended if closed else None))
    loop.solo = solo
    loop.arrivals_at_step_ends = solo  # as simulate sets it: the trivial router, and ignored under closed loop
    loop.run()
    return res, arrivals.times


def random_workload(seed: int) -> Workload:
    """Seeded: 60 requests over 10 s, prompts 1-60 tokens, outputs 1-15."""
    rng = random.Random(seed)
    rows = sorted((round(rng.uniform(0, 10), 3), rng.randint(1, 60), rng.randint(1, 15)) for _ in range(60))
    return Workload(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), "random")


@pytest.mark.parametrize(
    ("seed", "kv", "closed"),
    [(0, "reserve", None), (1, "paged", None), (2, "paged", ClosedLoop(5, 0.125)), (3, "reserve", ClosedLoop(3))],
    ids=["reserve", "paged-preempting", "paged-closed-think", "reserve-closed"],
)
def test_single_replica_path_equals_the_general_loop(seed: int, kv: str, closed: ClosedLoop | None) -> None:
    """Seeded workloads (a small paged KV that preempts; closed loop with a think time and requests
    too long for the context): the single-replica path writes the same rows and times as the general loop."""
    cfg = SchedulerConfig(kv_tokens=160, token_budget=24, max_seqs=8, kv=kv, block_size=4)
    wl = random_workload(seed)
    a, ta = run(wl, cfg, True, closed, max_model_len=64)
    b, tb = run(wl, cfg, False, closed, max_model_len=64)
    assert ta == tb
    assert a.num_steps == b.num_steps > 0
    for name in ("step_start", "step_end", "step_tokens", "step_decodes", "step_kv_used", "step_ticks"):
        assert list(getattr(a, name)) == list(getattr(b, name)), name
    assert (a.admit_step, a.first_step, a.finish_step) == (b.admit_step, b.first_step, b.finish_step)
    assert (a.skips, a.segments, a.rejected) == (b.skips, b.segments, b.rejected)
    if kv == "paged" and closed is None:
        assert a.segments  # the case exercises preemption


@pytest.mark.parametrize(
    ("seed", "kv", "router", "async_every"),
    [(0, "reserve", "least-outstanding", 0), (1, "paged", "least-kv", 0), (2, "paged", "round-robin", 2),
     (3, "reserve", "vllm-dp", 1), (4, "paged", "random", 0)],
)
def test_replicas_apart_between_arrivals_equal_the_heap(seed: int, kv: str, router: str, async_every: int) -> None:
    """Seeded workloads on four replicas (a small paged KV that preempts, asynchronous scheduling, requests
    too long for the context, routers that read the replicas' load and KV): running each replica on its own
    between arrivals (EventLoop._run_apart) routes every request as the heap does and writes the same rows."""
    cfg = SchedulerConfig(kv_tokens=160, token_budget=24, max_seqs=8, kv=kv, block_size=4)
    wl = random_workload(seed)
    # Arrivals on the 0.125 s grid of the step times, so that steps often end at an arrival; queues form.
    wl = Workload(tuple(round(t * 2) / 8 for t in wl.arrivals), wl.prompt_lens, wl.output_lens, "busy")
    a, ea = run_cluster(wl, cfg, router, True, async_every, max_model_len=64)
    b, eb = run_cluster(wl, cfg, router, False, async_every, max_model_len=64)
    assert (ea.routed, ea.refused, ea.ratios) == (eb.routed, eb.refused, eb.ratios)
    assert sum(r.num_steps for r in a) > 0
    assert_same_runs(a, b)


def callback_order(solo: bool) -> list[tuple[float, int]]:
    """(time, steps recorded) seen by callbacks at 1.0 s (when the one 4-token prefill step ends) and 0.25 s."""
    wl = Workload((0.0,), (4,), (1,), "one")
    cfg = SchedulerConfig(kv_tokens=100, token_budget=8, max_seqs=4)
    max_new, too_long, target, config, _ = plan_run(wl, cfg, COST, None, None, False, None)
    inner = make_scheduler(cfg)
    rep = Replica(0, inner, inner, new_result("x", wl, config, target, max_new, inner), COST)
    arrivals = Arrivals(wl)
    loop = EventLoop([rep], arrivals, Entry([rep], None, request_maker(wl, max_new, inner, arrivals.times),
                                            too_long, arrivals))
    seen: list[tuple[float, int]] = []
    loop.at(1.0, lambda t: seen.append((t, rep.step)))
    loop.at(0.25, lambda t: seen.append((t, rep.step)))
    loop.solo = solo
    loop.run()
    return seen


@pytest.mark.parametrize("solo", [True, False], ids=["single-replica-path", "general"])
def test_a_step_end_runs_before_a_callback_due_then(solo: bool) -> None:
    """A callback due the instant a step ends runs after the step is recorded (kind order); one due
    earlier runs first."""
    assert callback_order(solo) == [(0.25, 0), (1.0, 1)]


@pytest.mark.parametrize("answer", [7, True])
def test_router_returning_a_bad_index_is_refused(answer: object) -> None:
    """A router answering an index out of range, or a bool (not 1 in either build), raises ClusterError
    naming it."""

    class Bad:
        def route(self, request: Request, replicas: object) -> object:
            return answer

    wl = Workload((0.0,), (4,), (1,), "one")
    cfg = SchedulerConfig(kv_tokens=100, token_budget=8, max_seqs=4)
    max_new, too_long, target, config, _ = plan_run(wl, cfg, COST, None, None, False, None)
    reps = []
    for k in range(2):
        inner = make_scheduler(cfg)
        reps.append(Replica(k, inner, inner, new_result("x", wl, config, target, max_new, inner), COST))
    arrivals = Arrivals(wl)
    entry = Entry(reps, Bad(), request_maker(wl, max_new, reps[0].inner, arrivals.times), too_long, arrivals)
    with pytest.raises(ClusterError, match=f"returned replica {answer!r}; expected 0..1"):
        EventLoop(reps, arrivals, entry).run()


def test_finish_step_without_a_step_is_an_error() -> None:
    """Replica.finish_step with nothing in flight raises SimulationError."""
    wl = Workload((0.0,), (4,), (1,), "one")
    cfg = SchedulerConfig(kv_tokens=100, token_budget=8, max_seqs=4)
    inner = make_scheduler(cfg)
    rep = Replica(0, inner, inner, new_result("x", wl, {}, [1], [1], inner), COST)
    with pytest.raises(SimulationError, match="without a step in flight"):
        rep.finish_step(1.0)
