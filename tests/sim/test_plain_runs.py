"""Runs of plain decode steps in the simulator: the cost models' plain_decode_times against step_time of
each plan, bit for bit; a cluster whose replicas park in such runs (Replica.advance(park=True)) against
the heap path, step by step, row for row; and the replicas that must not take them."""

from __future__ import annotations

import random

import pytest

from cluster_runs import COST, assert_same_runs, run_cluster
from stallfree import Request, Scheduler
from stallfree.core.plain_steps import plain_decode_run
from stallfree.costmodel import CostModel, get_gpu, get_model
from stallfree.costmodel.kernels import kernels_installed
from stallfree.sim import LinearCostModel, Workload
from stallfree.sim.inputs.engine_profile import EngineProfile, ProfiledCostModel
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.replica import Replica
from stallfree.sim.studies.ranges import ScaledCost


def plain_plans(seed: int, kv: str = "reserve") -> list:
    """A scheduler driven with seeded requests; the plans of the plain decode steps it runs, run by run (up
    to 40 steps each), as PlainDecodeRun.plan gives them."""
    rng = random.Random(seed)
    opts = {"kv_policy": "paged", "block_size": 16} if kv == "paged" else {}
    s = Scheduler(256, 64, 200_000, **opts)
    plans = []
    for rid in range(40):
        s.add(Request(rid, rng.randint(1, 3000), rng.randint(1, 400)))
        for _ in range(rng.randint(1, 30)):
            run = plain_decode_run(s, 40)
            if run is not None:
                plans.append([run.plan(i) for i in range(run.num_steps)])
                run.take(run.num_steps)
            elif s.has_unfinished():
                s.complete(s.schedule())
    assert sum(map(len, plans)) > 200
    return plans


def pricers() -> list:
    gpu = get_gpu("h100-sxm")
    out = [
        CostModel(get_model("llama-3.1-8b"), gpu),
        CostModel(get_model("gpt-oss-20b"), gpu, tp=8, dtype="fp8"),  # sliding windows and experts
        CostModel(get_model("mixtral-8x7b"), gpu, tp=8, dtype="fp8"),  # experts
        LinearCostModel(0.01, 1e-4, 3e-7),
        ProfiledCostModel(CostModel(get_model("qwen3-8b"), gpu), EngineProfile("none", step_s=0.0013,
                                                                                per_sampled_s=2e-6)),
    ]
    # The range study's scaled replays: a wrapper that hands other attributes to the model it wraps must
    # scale the run's prices itself.
    out.append(ScaledCost(out[0], 1.1))
    out.append(ScaledCost(out[4], 0.9))
    # A step's fixed terms after its roofline: the all-reduce alone (tensor parallel), and with overheads.
    out.append(CostModel(get_model("llama-3.1-8b"), gpu, tp=2))
    out.append(CostModel(get_model("qwen3-8b"), gpu, tp=4, overhead_s=0.003, per_token_s=2e-7, per_seq_s=1e-5))
    if kernels_installed():
        from stallfree.costmodel.kernels import KernelCostModel

        out.append(KernelCostModel(get_model("llama-3.1-8b"), gpu, 1, "bf16", engine="vllm"))
    return out


@pytest.mark.parametrize("vector_steps", [48, 2], ids=["loop-below-48", "numpy-from-2"])
@pytest.mark.parametrize("which", range(10))
def test_plain_decode_times_equal_step_time_bit_for_bit(which: int, vector_steps: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """plain_decode_times: step_time of each plan; plain_decode_ends (where a model has it): those prices
    added up from a start, in order (itertools.accumulate), bit for bit, priced in Python or with numpy."""
    from array import array
    from itertools import accumulate

    import stallfree.costmodel.roofline as roofline

    monkeypatch.setattr(roofline, "_VECTOR_STEPS", vector_steps)
    monkeypatch.setattr(roofline, "_VECTOR_ENDS", vector_steps)
    models = pricers()
    if which >= len(models):
        pytest.skip("the optional package aiconfigurator-core (extra 'kernels') is not installed")
    cost = models[which]
    assert cost.pure_step_time
    ends_of = getattr(cost, "plain_decode_ends", None)
    assert (ends_of is not None) == (type(cost) is CostModel)
    for seed, kv in ((1, "reserve"), (2, "paged")):
        for run in plain_plans(seed, kv):
            first = run[0]
            nd = first.num_decodes
            times = cost.plain_decode_times(first.decode_offsets, first.decode_context_sum - nd * first.step,
                                            first.step, len(run))
            want = [cost.step_time(p) for p in run]
            assert times == want
            if ends_of is not None:
                start = 1234.5678 + first.step * 1e-3
                ends = ends_of(nd, first.decode_context_sum - nd * first.step, first.step, len(run), start)
                assert ends == array("d", list(accumulate(want, initial=start))[1:])


@pytest.mark.parametrize("mfu", [1.0, 0.005, 0.0005], ids=["memory-bound", "crossing", "compute-bound"])
def test_plain_decode_ends_on_either_side_of_the_roofline(mfu: float) -> None:
    """plain_decode_ends skips the side of the roofline that trails at both ends of a run: the same floats as
    the prices of plain_decode_times added up in order, for runs wholly memory-bound (mfu 1.0: a decode of
    an 8B model on an H100), wholly compute-bound (mfu 0.0005) and across the crossing (mfu 0.005, one
    decode: compute overtakes memory at some tens of thousands of pairs, found by bisection)."""
    from array import array
    from itertools import accumulate

    cost = CostModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), mfu=mfu)

    def sides(nd: int, x: float) -> tuple[float, float]:
        base, c_pair, inv_mfu, w_dec, m_fixed, m_kv, m_head, inv_mbu, *_ = cost._plain_terms(nd)
        return (base + c_pair * (x * w_dec)) * inv_mfu, (m_fixed + m_kv * x + m_head) * inv_mbu

    runs = [(nd, offset_sum, step, count) for nd in (1, 7, 64) for offset_sum in (0, 12_345, 3_000_000)
            for step in (0, 999) for count in (1, 5, 79)]
    if mfu == 0.005:
        lo, hi = 1, 10**7  # compute trails memory at lo and leads at hi: the pairs where it overtakes
        assert sides(1, lo)[0] < sides(1, lo)[1] and sides(1, hi)[0] > sides(1, hi)[1]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if sides(1, mid)[0] < sides(1, mid)[1] else (lo, mid)
        runs = [(1, hi - 1 - back, 0, 79) for back in (1, 20, 40, 78)]  # step 0's pairs: offset_sum + 1
    seen = set()
    for nd, offset_sum, step, count in runs:
        first = sides(nd, offset_sum + nd * step + nd)
        last = sides(nd, offset_sum + nd * (step + count))
        seen.add(("compute" if first[0] > first[1] else "memory", "compute" if last[0] > last[1] else "memory"))
        times = cost.plain_decode_times((0,) * nd, offset_sum, step, count)
        want = array("d", list(accumulate(times, initial=0.25))[1:])
        assert cost.plain_decode_ends(nd, offset_sum, step, count, 0.25) == want
    assert seen == {{1.0: ("memory", "memory"), 0.0005: ("compute", "compute")}.get(mfu, ("memory", "compute"))}


def light_workload(seed: int) -> Workload:
    """Seeded: 80 requests over 40 s on the 0.125 s grid, prompts 1-60 tokens, outputs 1-90: long runs of
    decodes between arrivals."""
    rng = random.Random(seed)
    rows = sorted((round(rng.uniform(0, 40) * 8) / 8, rng.randint(1, 60), rng.randint(1, 90)) for _ in range(80))
    return Workload(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), "light")


@pytest.mark.pure_python
@pytest.mark.parametrize(
    ("seed", "kv", "router", "async_every"),
    [(0, "reserve", "least-outstanding", 0), (1, "paged", "least-outstanding", 2), (2, "paged", "round-robin", 0),
     (3, "reserve", "random", 1), (4, "paged", "least-kv", 0), (5, "reserve", "vllm-dp", 0),
     (1, "paged-16", "least-outstanding", 0)],
)
def test_parked_replicas_equal_the_heap(seed: int, kv: str, router: str, async_every: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightly loaded replicas (long runs of decodes, paged KV that preempts, asynchronous scheduling): the
    runs taken at once, and left unvisited between arrivals under routers that read only num_outstanding,
    route every request as the heap does, step by step, and write the same rows."""
    taken = []
    original = Replica._take_plain

    def counting(self: Replica, until: float) -> float:
        before = self.step
        end = original(self, until)
        taken.append(self.step - before)
        return end

    monkeypatch.setattr(Replica, "_take_plain", counting)
    # 16-token blocks: a run's block promises and its last step's finish can leave its first and last
    # free KV equal with other values between.
    block, kv_tokens = (16, 640) if kv == "paged-16" else (4, 400)
    cfg = SchedulerConfig(kv_tokens=kv_tokens, token_budget=24, max_seqs=8, kv=kv[:5] if kv != "reserve" else kv,
                          block_size=block)
    wl = light_workload(seed)
    # Even seeds: step times on the arrivals' grid (steps often end at an arrival); odd: times that grow
    # with the context, so that every step of a run has its own price.
    cost = COST if seed % 2 == 0 else LinearCostModel(0.5, 0.125, 1e-3)
    a, ea = run_cluster(wl, cfg, router, True, async_every, max_model_len=128, cost=cost)
    assert max(taken) >= 10  # runs of plain decode steps were taken at once
    taken.clear()
    b, eb = run_cluster(wl, cfg, router, False, async_every, max_model_len=128, cost=cost)
    assert not taken  # the heap path steps one by one
    assert (ea.routed, ea.refused, ea.ratios) == (eb.routed, eb.refused, eb.ratios)
    assert_same_runs(a, b)


def test_no_runs_under_the_invariant_checker_or_an_impure_pricer() -> None:
    """A replica whose scheduler is wrapped (the checker sees every step) or whose pricer may keep state
    (no pure_step_time) takes every step through schedule() and complete()."""
    from stallfree.core.invariants import InvariantChecker
    from stallfree.sim.run.simulator import new_result, plan_run

    class Priced:
        def step_time(self, plan):  # type: ignore[no-untyped-def]
            return 0.01

    wl = light_workload(0)
    cfg = SchedulerConfig(kv_tokens=400, token_budget=24, max_seqs=8)
    cost = LinearCostModel(0.01, 1e-3)
    max_new, _, target, config, _ = plan_run(wl, cfg, cost, None, None, False, None)
    inner = Scheduler(24, 8, 400)
    res = new_result("x", wl, config, target, max_new, inner)
    assert not Replica(0, InvariantChecker(inner), inner, res, cost)._plain_ok
    assert not Replica(0, inner, inner, res, Priced())._plain_ok
    assert Replica(0, inner, inner, res, cost)._plain_ok


def test_a_cluster_checks_each_request_s_tokens_once_in_its_own_replica() -> None:
    """verify_cluster_tokens passes on a real run (requests on all four replicas, runs taken at once) and
    names the request whose count is wrong when one is made wrong."""
    from stallfree.sim.run.cluster import simulate_cluster
    from stallfree.sim.run.result import SimulationError, verify_cluster_tokens
    from stallfree.sim.run.routers import LeastOutstandingRouter

    wl = light_workload(3)
    cfg = SchedulerConfig(kv_tokens=400, token_budget=24, max_seqs=8)
    c = simulate_cluster(wl, cfg, LinearCostModel(0.5, 0.125, 1e-3), 4, LeastOutstandingRouter(), max_model_len=128)
    owner = c.replicas[0].owner
    assert owner is not None and set(owner) >= {0, 1, 2, 3}
    verify_cluster_tokens(c.replicas, owner)
    r = next(r for r in range(len(owner)) if wl.output_lens[r] > 3 and c.replicas[0].finish_step[r] >= 0)
    c.replicas[0].finish_step[r] -= 1  # one token short (the arrays are shared by the replicas)
    with pytest.raises(SimulationError, match=f"request {r} emitted {wl.output_lens[r] - 1} tokens, expected"):
        verify_cluster_tokens(c.replicas, owner)
