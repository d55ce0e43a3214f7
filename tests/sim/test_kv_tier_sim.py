"""A CPU KV tier in the simulator and the cost model: host link figures, the copies' price, vLLM's
--kv-offloading-size in tokens, a hand-worked run, and the simulate and sweep flags."""

from __future__ import annotations

import json

import pytest

from stallfree.costmodel import CostModelError
from stallfree.costmodel.hardware import get_gpu
from stallfree.costmodel.host_link import HostLink, KVTransferCost, host_link, kv_offloading_tokens
from stallfree.sim.inputs.traces import load_trace
from stallfree.sim.outputs.records import request_records
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.simulator import simulate

COST = LinearCostModel(base_s=0.5, per_token_s=1e-4)


def test_host_links_of_the_presets():
    """PCIe Gen5 x16 (64 GB/s per direction) on Hopper and B200, Gen4 (32) on A100 and L40S, and
    NVLink-C2C shared by a GB200 superchip's two GPUs (225)."""
    assert host_link(get_gpu("h100-sxm")).bandwidth_bytes_per_s == 64e9
    assert host_link(get_gpu("h200")).bandwidth_bytes_per_s == 64e9
    assert host_link(get_gpu("b200")).bandwidth_bytes_per_s == 64e9
    assert host_link(get_gpu("a100")).bandwidth_bytes_per_s == 32e9
    assert host_link(get_gpu("l40s")).bandwidth_bytes_per_s == 32e9
    assert host_link(get_gpu("gb200")).bandwidth_bytes_per_s == 225e9
    assert host_link(get_gpu("h100-sxm")).latency_s == pytest.approx(10e-6)


def test_loads_add_to_the_step_and_offloads_overlap_it():
    """1 MB blocks at 10 GB/s, 20 us: 3 loads are 20e-6 + 3e6 / 10e9 = 0.00032 s; a step of 0.5 +
    1e-4 x 10 = 0.501 s with them takes 0.50132 s. 5 offloads (0.00052 s) hide under it; 10,000 of
    them (1.00002 s) do not: the step takes that long."""
    from stallfree.core.plan import StepPlan

    cost = KVTransferCost(COST, HostLink(10e9, 20e-6), 1e6)
    assert cost.copy_time(3) == pytest.approx(20e-6 + 3e6 / 10e9) and cost.copy_time(0) == 0.0

    def plan(loads: int, offloads: int) -> StepPlan:
        return StepPlan(0, ("a",), (9,), (), 10, 9, 16, kv_offloads=((0, 0),) * offloads, kv_loads=((0, 0),) * loads)

    assert cost.step_time(plan(3, 5)) == pytest.approx(0.501 + 20e-6 + 3e6 / 10e9)
    assert cost.step_time(plan(0, 10_000)) == pytest.approx(20e-6 + 10_000 * 1e6 / 10e9)
    with pytest.raises(CostModelError, match="bandwidth"):
        HostLink(0, 1e-6)


def test_kv_offloading_size_is_summed_over_ranks():
    """1 GiB over tp 2 at 1,024 B per token per GPU: 2^30 / (2 x 1024) = 524,288 tokens."""
    assert kv_offloading_tokens(1, 1024, 2) == 524_288
    with pytest.raises(CostModelError, match="kv-offloading-size"):
        kv_offloading_tokens(-1, 1024, 2)


def trace(tmp_path):
    """A (ids 1 2), B (ids 3 4), C (ids 1 2 again), 1,100 tokens each, 10 s apart."""
    rows = [{"timestamp": t * 10_000, "input_length": 1100, "output_length": 1, "hash_ids": ids}
            for t, ids in enumerate([[1, 2, 10], [3, 4, 11], [1, 2, 12]])]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_trace(p)


def test_a_hand_worked_run_hits_in_the_cpu_tier(tmp_path):
    """3 GPU blocks of 512. A caches blocks (1,0), (2,0); B takes 3 blocks, evicting both to the CPU
    tier (2 offloads); C finds both there: 1,024 tokens, 2 loads; its 3 blocks evict B's 2, which the
    tier drops (its 2 blocks are read by C's loads in that step). GPU-only, C hits nothing. Priced,
    C's TTFT pays latency + 2 x block bytes / bandwidth."""
    wl = trace(tmp_path)
    base = dict(kv_tokens=1536, kv="paged", block_size=512, prefix_caching=True)
    gpu_only = simulate(wl, SchedulerConfig(**base), COST, check=True)
    tiered = simulate(wl, SchedulerConfig(**base, cpu_kv_tokens=1024), COST, check=True)
    assert gpu_only.prefix_cache_hit_rate_first_admission == 0.0
    assert tiered.prefix_cache_hit_rate_first_admission == pytest.approx(1024 / 3300)
    assert tiered.kv_tier is not None and gpu_only.kv_tier is None
    assert tiered.kv_tier["first_admission_hit_rate_cpu"] == pytest.approx(1024 / 3300)
    assert tiered.kv_tier["kv_loads"] == 2 and tiered.kv_tier["kv_offloads"] == 2
    assert tiered.kv_tier["cpu_drops"] == 2
    priced = simulate(wl, SchedulerConfig(**base, cpu_kv_tokens=1024),
                      KVTransferCost(COST, HostLink(1e9, 1e-5), 512_000), check=True)
    ttft = [r["ttft_ms"] for r in request_records(tiered)]
    ttft_priced = [r["ttft_ms"] for r in request_records(priced)]
    assert ttft[2] == pytest.approx((0.5 + 76e-4) * 1e3)
    assert ttft_priced[2] - ttft[2] == pytest.approx((1e-5 + 2 * 512_000 / 1e9) * 1e3)
    assert ttft_priced[1] == ttft[1]  # B's offloads hide under its step


def test_scheduler_config_tier_needs_caching_and_a_block():
    with pytest.raises(ValueError, match="prefix_caching"):
        SchedulerConfig(1536, kv="paged", block_size=512, cpu_kv_tokens=1024)
    with pytest.raises(ValueError, match="no block"):
        SchedulerConfig(1536, kv="paged", block_size=512, prefix_caching=True, cpu_kv_tokens=100)
    cfg = SchedulerConfig(1536, kv="paged", block_size=512, prefix_caching=True, cpu_kv_tokens=1100)
    assert cfg.scheduler.cpu_blocks == 2


@pytest.mark.parametrize("argv, message", [
    (["--cpu-kv-tokens", "1000", "--kernels", "none"], "add --enable-prefix-caching"),
    (["--cpu-kv-tokens", "1000", "--no-enable-prefix-caching"], "add --enable-prefix-caching"),
    (["--kv-policy", "paged", "--enable-prefix-caching", "--cpu-kv-tokens", "1000", "--kv-offloading-size", "1"],
     "give one"),
])
def test_simulate_tier_flags_are_checked_before_running(capsys, argv, message):
    from stallfree.cli import main

    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_simulate_tier_size_must_be_positive(capsys):
    from stallfree.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--kv-policy", "paged", "--enable-prefix-caching", "--kv-offloading-size", "-2"])
    assert exc.value.code == 2
    assert "--kv-offloading-size: expected a number > 0, got '-2'" in capsys.readouterr().err


def test_sweep_cpu_tier_needs_prefix_caching(capsys):
    from stallfree.cli import main

    assert main(["sweep", "--cpu-kv-tokens", "0,1000"]) == 2
    assert "add --enable-prefix-caching" in capsys.readouterr().err
