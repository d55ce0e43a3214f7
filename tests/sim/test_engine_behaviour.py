"""The pricing engine's scheduling defaults (stallfree.sim.inputs.engine_behaviour): a run priced by an engine's
kernel tables schedules as that engine does by default, explicit flags win, and the header says which."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.costmodel.kernels import kernels_installed
from stallfree.sim.inputs.engine_behaviour import async_default, behaviour_line, engine_defaults
from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
from stallfree.sim.inputs.setup import Setup

needs_kernels = pytest.mark.skipif(
    not kernels_installed(), reason="the optional package aiconfigurator-core (extra 'kernels') is not installed"
)

_SMALL = ["--num-requests", "30", "--model", "llama-3.1-8b", "--tp", "1", "--dtype", "bf16", "--json"]


def _values(defaults):
    return {k: v["value"] for k, v in defaults.items()}


def test_vllm_defaults_follow_the_version():
    """vLLM >= 0.14.0 schedules ahead; before it, not; both page in 16-token blocks without a watermark
    and cache prefixes (vLLM v1's defaults)."""
    new = _values(engine_defaults({"kind": "kernels", "engine": "vllm", "version": "0.24.0"}))
    assert new == {"async_scheduling": True, "kv_policy": "paged", "block_size": 16, "watermark": 0.0,
                   "enable_prefix_caching": True}
    old = _values(engine_defaults({"kind": "kernels", "engine": "vllm", "version": "0.12.0"}))
    assert old["async_scheduling"] is False and old["kv_policy"] == "paged"
    assert async_default("0.14.0")[0] and not async_default("0.13.0")[0]


def test_other_engines_and_other_pricing():
    """SGLang: overlap scheduling and its radix cache; TensorRT-LLM: overlap, KV reserved (its
    GUARANTEED_NO_EVICT), no block reuse; anything not priced by kernels: no engine default."""
    sg = _values(engine_defaults({"kind": "kernels", "engine": "sglang", "version": "0.5"}))
    assert sg["async_scheduling"] and sg["kv_policy"] == "paged" and sg["enable_prefix_caching"]
    trt = _values(engine_defaults({"kind": "kernels", "engine": "trtllm", "version": "1.0"}))
    assert trt == {"async_scheduling": True, "kv_policy": "reserve", "enable_prefix_caching": False}
    assert engine_defaults({"kind": "floor"}) == {} and engine_defaults({}) == {}


def test_library_setup_without_kernels_keeps_the_contract():
    """Setup's own default pricing (kernels 'none'): synchronous, reserved KV, no caching; said so."""
    s = Setup(WorkloadOptions(num_requests=20), HardwareOptions())
    assert (s.async_scheduling, s.scheduler_config.kv_policy, s.prefix_caching) == (False, "reserve", False)
    assert s.engine_behaviour == {}
    assert "the contract's defaults" in s.behaviour()


def test_behaviour_line_words_what_the_engine_set():
    """All three set by the engine: its name leads the line; only some: the line says which were its."""
    resolved = {"async_scheduling": True, "kv_policy": "paged", "block_size": 16, "watermark": 0.0,
                "enable_prefix_caching": True}
    vllm = {"kind": "kernels", "engine": "vllm", "version": "0.24.0"}
    line = behaviour_line(resolved, dict.fromkeys(("async_scheduling", "kv_policy", "enable_prefix_caching"), {}),
                          vllm)
    assert line.startswith("scheduling as vllm 0.24.0 does by default: asynchronous scheduling, paged KV in "
                           "16-token blocks, watermark 0, prefix caching")
    line = behaviour_line({**resolved, "kv_policy": "reserve", "enable_prefix_caching": False},
                          {"async_scheduling": {}}, vllm)
    assert line == ("scheduling: asynchronous scheduling, KV reserved at admission, no prefix caching "
                    "(asynchronous scheduling as vllm 0.24.0 does by default; "
                    "the rest as given or as the command requires)")


@needs_kernels
def test_simulate_defaults_to_vllm_behaviour_and_says_so(capsys):
    """A bare run on kernel pricing: vLLM 0.24.0's behaviour, in --json (engine_behaviour with each
    field's value and source, scheduler_config) and on the header's second line."""
    assert main(["simulate", *_SMALL]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    eb = header["engine_behaviour"]
    assert _values(eb) == {"async_scheduling": True, "kv_policy": "paged", "block_size": 16, "watermark": 0.0,
                           "enable_prefix_caching": True}
    assert all(v["source"] for v in eb.values())
    assert header["async_scheduling"] is True
    sc = header["scheduler_config"]
    assert (sc["kv_policy"], sc["block_size"], sc["watermark"], sc["enable_prefix_caching"]) == ("paged", 16, 0.0, True)
    assert main(["simulate", *_SMALL[:-1]]) == 0
    second = capsys.readouterr().out.splitlines()[1]
    assert "scheduling as vllm 0.24.0 does by default: asynchronous scheduling" in second


@needs_kernels
def test_explicit_flags_win(capsys):
    """The contract's flags give the contract under kernel pricing; the engine then sets nothing. One flag
    alone overrides that field only."""
    assert main(["simulate", *_SMALL, "--kv-policy", "reserve", "--no-async-scheduling",
                 "--no-enable-prefix-caching"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["engine_behaviour"] == {} and header["async_scheduling"] is False
    assert header["scheduler_config"]["kv_policy"] == "reserve"
    assert main(["simulate", *_SMALL, "--no-async-scheduling"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["async_scheduling"] is False and "async_scheduling" not in header["engine_behaviour"]
    assert header["scheduler_config"]["kv_policy"] == "paged"
    assert main(["simulate", *_SMALL, "--watermark", "0.05", "--block-size", "32"]) == 0
    sc = json.loads(capsys.readouterr().out)["header"]["scheduler_config"]
    assert (sc["watermark"], sc["block_size"]) == (0.05, 32)
    # --kv-policy reserve alone: the engine's caching does not apply to reserved KV (not an error).
    assert main(["simulate", *_SMALL, "--kv-policy", "reserve"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["scheduler_config"]["enable_prefix_caching"] is False and header["async_scheduling"] is True


@needs_kernels
def test_kernels_none_keeps_the_contract_and_refuses_paged_only_flags(capsys):
    """--kernels none: today's behaviour, said in the header; paged-only flags on a reserving run are
    refused naming the flag."""
    assert main(["simulate", *_SMALL, "--kernels", "none"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["engine_behaviour"] == {} and header["async_scheduling"] is False
    assert header["scheduler_config"]["kv_policy"] == "reserve"
    assert "the contract's defaults" in header["behaviour"]
    assert main(["simulate", *_SMALL, "--kernels", "none", "--block-size", "32"]) == 2
    assert "--block-size applies to --kv-policy paged" in capsys.readouterr().err
    assert main(["simulate", *_SMALL, "--kernels", "none", "--enable-prefix-caching"]) == 2
    assert "--enable-prefix-caching needs --kv-policy paged" in capsys.readouterr().err


@needs_kernels
def test_sglang_and_trtllm_defaults(capsys):
    assert main(["simulate", *_SMALL, "--kernels", "sglang"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["async_scheduling"] is True and header["scheduler_config"]["enable_prefix_caching"] is True
    assert main(["simulate", *_SMALL, "--kernels", "trtllm"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["async_scheduling"] is True and header["scheduler_config"]["kv_policy"] == "reserve"


@needs_kernels
def test_disaggregated_run_falls_back_and_says_what_each_side_models(capsys):
    """--disaggregate 2:2 with the engine's defaults runs: each side synchronous without caching, the
    header naming what is left out and why; typed, the same options are refused."""
    assert main(["simulate", *_SMALL, "--disaggregate", "2:2"]) == 0
    header = json.loads(capsys.readouterr().out)["header"]
    assert header["behaviour"].startswith("each side: synchronous scheduling, paged KV in 16-token blocks")
    left = header["disaggregation_not_modelled"]
    assert [x.split(" (")[0] for x in left] == ["asynchronous scheduling", "prefix caching"]
    assert "vLLM 0.24.0" in left[0]
    assert main(["simulate", *_SMALL[:-1], "--disaggregate", "2:2"]) == 0
    assert "not modelled under disaggregation, left out: asynchronous scheduling" in capsys.readouterr().out
    assert main(["simulate", *_SMALL, "--disaggregate", "2:2", "--async-scheduling"]) == 2
    assert "--async-scheduling is not modelled with --disaggregate" in capsys.readouterr().err
    assert main(["simulate", *_SMALL, "--disaggregate", "2:2", "--enable-prefix-caching"]) == 2
    assert main(["simulate", *_SMALL, "--kernels", "none", "--disaggregate", "1:1"]) == 0
    assert json.loads(capsys.readouterr().out)["header"]["disaggregation_not_modelled"] == []


@needs_kernels
def test_plan_runs_with_the_defaults_and_says_what_each_kind_models(capsys):
    """A bare plan (disaggregation searched) runs under the engine's defaults: the aggregated replicas
    schedule as vLLM, the disaggregated splits without what disaggregation does not model; typed
    --async-scheduling is still refused with the splits."""
    args = ["plan", "--num-requests", "40", "--model", "llama-3.1-8b", "--tp", "1", "--dtype", "bf16",
            "--slo-ttft", "2s", "--slo-tpot", "100ms", "--executor", "serial", "--max-replicas", "3"]
    assert main([*args, "--json"]) in (0, 3)
    report = json.loads(capsys.readouterr().out)
    header = report["header"]
    assert header["async_scheduling"] is True
    assert header["disaggregated_behaviour"].startswith("each side: synchronous scheduling")
    assert main(args) in (0, 3)
    assert "aggregated replicas: scheduling as vllm 0.24.0 does by default" in capsys.readouterr().out
    assert main([*args, "--async-scheduling"]) == 2
    assert main([*args, "--async-scheduling", "--no-disaggregate"]) in (0, 3)


@needs_kernels
def test_step_time_target_falls_back_to_synchronous(capsys):
    assert main(["simulate", *_SMALL, "--step-time-target", "50ms"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["header"]["async_scheduling"] is False
    assert "not modelled with --step-time-target" in out.err
    assert main(["simulate", *_SMALL, "--step-time-target", "50ms", "--async-scheduling"]) == 2
