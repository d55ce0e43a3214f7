"""Shared by the event loop's tests: four replicas behind a router through the loop, on the runs-apart
path or the heap path."""

from __future__ import annotations

from stallfree.sim import LinearCostModel, SimResult, Workload
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.config import make_scheduler
from stallfree.sim.run.load import Arrivals
from stallfree.sim.run.loop import Entry, EventLoop
from stallfree.sim.run.replica import Replica
from stallfree.sim.run.routers import make_router
from stallfree.sim.run.simulator import new_result, plan_run, request_maker

COST = LinearCostModel(base_s=0.5, per_token_s=0.125)


def run_cluster(wl: Workload, cfg: SchedulerConfig, router: str, apart: bool, async_every: int = 0,
                max_model_len: int | None = None, cost: LinearCostModel = COST) -> tuple[list[SimResult], Entry]:
    """Four replicas behind `router` through the loop: replicas apart between arrivals (apart) or the heap,
    step by step; every async_every-th replica (from the first) schedules asynchronously (0: none)."""
    max_new, too_long, target, config, _ = plan_run(wl, cfg, cost, None, max_model_len, False, None)
    reps = []
    for k in range(4):
        inner = make_scheduler(cfg)
        res = new_result("x", wl, config, target, max_new, inner)
        reps.append(Replica(k, inner, inner, res, cost, async_scheduling=bool(async_every) and k % async_every == 0))
    arrivals = Arrivals(wl)
    entry = Entry(reps, make_router(router), request_maker(wl, max_new, reps[0].inner, arrivals.times), too_long,
                  arrivals, track_imbalance=True)
    loop = EventLoop(reps, arrivals, entry)
    assert loop._apart()
    loop.apart = apart
    loop.run()
    return [r.res for r in reps], entry


ROWS = ("step_start", "step_end", "step_tokens", "step_decodes", "step_kv_used", "step_waiting", "step_ticks")


def assert_same_runs(a: list[SimResult], b: list[SimResult]) -> None:
    """Two runs of the same replicas wrote the same step rows and per-request records."""
    for x, y in zip(a, b, strict=True):
        for name in ROWS:
            assert list(getattr(x, name)) == list(getattr(y, name)), name
        assert (x.admit_step, x.first_step, x.finish_step) == (y.admit_step, y.first_step, y.finish_step)
        assert (x.skips, x.segments, x.rejected) == (y.skips, y.segments, y.rejected)
