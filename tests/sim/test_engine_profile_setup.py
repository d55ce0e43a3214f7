"""Tests of the engine profile on a simulation's setup: the step terms wrap the cost model, by hand."""

from __future__ import annotations

import pytest

from stallfree import Request, Scheduler
from stallfree.sim.inputs.engine_profile import ProfiledCostModel, load_profile
from stallfree.sim.inputs.options import HardwareOptions, SetupError
from stallfree.sim.inputs.pricing import build_cost_model


def test_named_profile_wraps_the_cost_model():
    """--engine-profile vllm adds its per-sampled-token term to every step; the header names it."""
    plain, kv0, _ = build_cost_model(HardwareOptions(model="llama-3.1-8b", gpu="h100-sxm", tp=1, dtype="bf16"))
    cost, kv, hw = build_cost_model(HardwareOptions(model="llama-3.1-8b", gpu="h100-sxm", tp=1, dtype="bf16",
                                                    engine_profile="vllm"))
    assert isinstance(cost, ProfiledCostModel) and kv == kv0 and "engine profile vllm" in hw
    s = Scheduler(token_budget=64, max_seqs=4, kv_tokens=1000)
    s.add(Request(rid=1, prompt_len=8, max_new=2))
    plan = s.schedule()  # one last prefill chunk: one sampled token
    prof = load_profile("vllm")
    assert cost.step_time(plan) == pytest.approx(plain.step_time(plan) + prof.step_s + prof.per_sampled_s)


def test_profile_defaults_and_errors():
    """No profile by default (library: none); an unknown name is a usage error naming the known ones."""
    cost, _, hw = build_cost_model(HardwareOptions(model="llama-3.1-8b", gpu="h100-sxm", tp=1, dtype="bf16"))
    assert not isinstance(cost, ProfiledCostModel) and "engine profile" not in hw
    with pytest.raises(SetupError, match="no such profile; known: none"):
        build_cost_model(HardwareOptions(engine_profile="nope"))


def _one_request_run(profile):
    """One request of an 8-token prompt and 3 output tokens, every step 10 ms (hand-priced)."""
    from stallfree.sim.inputs.workload import Workload
    from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
    from stallfree.sim.run.costs import LinearCostModel
    from stallfree.sim.run.simulator import simulate

    wl = Workload((0.0,), (8,), (3,), name="one")
    cost = ProfiledCostModel(LinearCostModel(0.010, 0.0), profile)
    return simulate(wl, SchedulerConfig(1000, 64, 4), cost)


def test_front_end_is_added_to_ttft_and_e2e_by_hand():
    """Steps of 10 ms + 1 ms per step + 0.5 ms per sampled token (one per step) = 11.5 ms each: the first
    token at 11.5 ms, the last at 34.5 ms; the front end (50 ms) is added to TTFT and E2E, not to TPOT."""
    from stallfree.sim.inputs.engine_profile import EngineProfile
    from stallfree.sim.outputs.records import request_records
    from stallfree.sim.outputs.report import summarize_result

    res = _one_request_run(EngineProfile("t", step_s=1e-3, per_sampled_s=0.5e-3, frontend_s=0.050))
    assert res.config["frontend_s"] == pytest.approx(0.050)
    s = summarize_result(res)
    assert s["mean_ttft_ms"] == pytest.approx(61.5)
    assert s["mean_e2el_ms"] == pytest.approx(84.5)
    assert s["mean_tpot_ms"] == pytest.approx(11.5)
    assert s["mean_queue_ms"] == pytest.approx(0.0)
    row = request_records(res)[0]
    assert row["ttft_ms"] == pytest.approx(61.5) and row["e2el_ms"] == pytest.approx(84.5)
    assert row["first_token_s"] == pytest.approx(0.0115)  # the engine's own clock
    plain = _one_request_run(EngineProfile("none"))
    assert "frontend_s" not in plain.config and summarize_result(plain)["mean_ttft_ms"] == pytest.approx(10.0)


def test_closed_loop_engine_sees_the_front_end_as_think_time():
    """A closed loop's next request reaches the engine think time + front end after one ends."""
    from stallfree.sim.inputs.options import WorkloadOptions
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.run.load import ClosedLoop

    opts = WorkloadOptions(synthetic="poisson", num_requests=4, prompt_len="fixed:16", output_len="fixed:4",
                           concurrency=2, think_time=0.25)
    setup = Setup(opts, HardwareOptions(model="llama-3.1-8b", gpu="h100-sxm", engine_profile="vllm"))
    fe = load_profile("vllm").frontend_s
    assert fe > 0 and setup.engine_closed_loop == ClosedLoop(2, 0.25 + fe)
    plain = Setup(opts, HardwareOptions(model="llama-3.1-8b", gpu="h100-sxm"))
    assert plain.engine_closed_loop == ClosedLoop(2, 0.25)


def test_default_kernel_pricing_takes_the_matching_profile():
    """When the commands' default picks vLLM's kernel tables, the profile fitted on them applies too;
    --engine-profile none turns it off; today's pricing takes none. The record says which and why."""
    from stallfree.costmodel.kernels import kernels_installed
    from stallfree.sim.inputs.pricing import build_priced

    if not kernels_installed():
        pytest.skip("the optional package aiconfigurator-core (extra 'kernels') is not installed")
    hw = dict(model="llama-3.1-8b", gpu="h100-sxm", tp=1, dtype="bf16")
    cost, _, line, pricing = build_priced(HardwareOptions(**hw, kernels=None, engine_profile=None))
    assert isinstance(cost, ProfiledCostModel) and cost.profile == load_profile("vllm")
    assert pricing["engine_profile"]["name"] == "vllm" and pricing["engine_profile"]["chosen_by"] == "default"
    assert "engine profile vllm" in line and "front end added to TTFT and E2E" in line
    off, _, line, pricing = build_priced(HardwareOptions(**hw, kernels=None, engine_profile="none"))
    assert not isinstance(off, ProfiledCostModel) and pricing["engine_profile"]["name"] == "none"
    today, _, _, pricing = build_priced(HardwareOptions(**hw, kernels="none", engine_profile=None))
    assert not isinstance(today, ProfiledCostModel) and pricing["engine_profile"]["name"] == "none"


def test_cluster_runs_add_the_front_end_by_hand():
    """Two replicas, one request each (round robin), steps of 10 ms: each request's first token at 10 ms and
    last (3 tokens) at 30 ms; with a 50 ms front end the cluster's and each replica's TTFT is 60 ms, E2E 80 ms."""
    from stallfree.sim.inputs.engine_profile import EngineProfile
    from stallfree.sim.inputs.workload import Workload
    from stallfree.sim.run.cluster import simulate_cluster
    from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
    from stallfree.sim.run.costs import LinearCostModel
    from stallfree.sim.run.routers import RoundRobinRouter
    from stallfree.sim.studies.cluster_study import cluster_summary

    cost = ProfiledCostModel(LinearCostModel(0.010, 0.0), EngineProfile("t", frontend_s=0.050))
    wl = Workload((0.0, 0.0), (8, 8), (3, 3), name="two")
    s = cluster_summary(simulate_cluster(wl, SchedulerConfig(1000, 64, 4), cost, 2, RoundRobinRouter()))
    assert s["mean_ttft_ms"] == pytest.approx(60.0) and s["mean_e2el_ms"] == pytest.approx(80.0)
    assert [r["mean_ttft_ms"] for r in s["replicas"]] == pytest.approx([60.0, 60.0])
