"""Tests of the engine profile on a simulation's setup: the step terms wrap the cost model, by hand."""

from __future__ import annotations

import pytest

from stallfree import Request, Scheduler
from stallfree.sim.engine_profile import ProfiledCostModel, load_profile
from stallfree.sim.setup import HardwareOptions, SetupError, build_cost_model


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
