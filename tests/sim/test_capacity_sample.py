"""The requests saturated_throughput times: runs spread over the whole workload, not its head."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stallfree.core.config import SchedulerConfig as CoreConfig
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run import simulator
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.simulator import (
    SATURATION_SAMPLE,
    SATURATION_STEPS,
    burst_steps_per_request,
    saturated_throughput,
    saturation_sample,
)
from stallfree.sim.run.time_budget import TimeBudgetConfig

ONE_SECOND = LinearCostModel(base_s=1.0, per_token_s=0.0)


def test_saturation_sample_by_hand():
    """Up to `sample` requests: cycled. More: `windows` runs of consecutive requests, sizes differing by at
    most one, the n - sample left out spread evenly between them, the first run at request 0 and the last
    ending at the last request."""
    assert saturation_sample(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    assert saturation_sample(5, 5) == [0, 1, 2, 3, 4]
    # 10 of 20 in 3 runs of 3, 3, 4; 10 left out, 5 before each later run.
    assert saturation_sample(20, 10, 3) == [0, 1, 2, 8, 9, 10, 16, 17, 18, 19]
    assert saturation_sample(10, 4, 2) == [0, 1, 8, 9]
    assert saturation_sample(10, 4, 1) == [0, 1, 2, 3]  # one run: the head
    assert saturation_sample(10, 2, 5) == [0, 9]  # at most `sample` runs, of one request each
    # One left out, before the last run: runs 0-8 are requests 0-4,499, run 9 is 4,501-5,000.
    assert saturation_sample(5001, 5000) == [*range(4500), *range(4501, 5001)]
    idx = saturation_sample(19_366, SATURATION_SAMPLE)
    assert len(set(idx)) == SATURATION_SAMPLE and idx == sorted(idx) and (idx[0], idx[-1]) == (0, 19_365)
    for bad in ((0, 5), (5, 0), (5, 5, 0)):
        with pytest.raises(ValueError, match="saturation_sample needs"):
            saturation_sample(*bad)


def test_take_keeps_every_per_request_field():
    wl = Workload((0.0, 1.0, 2.0), (10, 20, 30), (1, 2, 3), name="w", prefix_ids=((1,), (2,), (3,)),
                  loras=(None, "a", "b"), tenants=("t", None, "u"))
    got = wl.take([2, 0, 2])
    assert (got.arrivals, got.prompt_lens, got.output_lens) == ((2.0, 0.0, 2.0), (30, 10, 30), (3, 1, 3))
    assert (got.prefix_ids, got.loras, got.tenants, got.name) == (((3,), (1,), (3,)), ("b", None, "b"),
                                                                  ("u", "t", "u"), "w")


def test_take_of_sessions_is_a_plain_workload():
    """Turns become single requests with their whole prompts: no session is left to follow them."""
    s = SessionWorkload((0.0, 0.0, 5.0), (10, 25, 7), (5, 5, 5), session=(0, 0, 1), turn=(0, 1, 0),
                        delay_s=(0.0, 1.0, 0.0), input_lens=(10, 10, 7), session_ids=("a", "b"),
                        system_ids=(-1, -1), system_lens=(0, 0))
    got = s.take([1, 2])
    assert type(got) is Workload and got.prompt_lens == (25, 7)


def _long_then_short(n: int = 10_000) -> Workload:
    """n requests, 1-token prompts; the first half generates 9 tokens each, the second half 1."""
    half = n // 2
    return Workload((0.0,) * n, (1,) * n, (9,) * half + (1,) * half, name="long-then-short")


def test_capacity_reads_the_whole_workload_not_its_head():
    """Steps of 1 s holding 4 requests (--max-num-seqs 4): a request of k output tokens holds its slot k
    steps (prefill and first token, then k - 1 decodes), so 4 / k req/s for equal requests.

    The whole workload released at once: 5,000 long requests in 5,000 / 4 x 9 = 11,250 steps, then 5,000
    short ones in 1,250: 10,000 / 12,500 = 0.8 req/s. Its first 5,000 requests alone are all long:
    5,000 / 11,250 = 0.444 req/s, what the head gave. The runs of saturation_sample: of the 10 runs of 500
    over 10,000 requests, run k starts at 500 k + floor(5,000 k / 9), so runs 0-4 (the last ends at 4,722)
    are long and runs 5-9 short: 2,500 x 9 / 4 + 2,500 / 4 = 6,250 steps, 5,000 / 6,250 = 0.8 req/s."""
    wl = _long_then_short()
    idx = saturation_sample(len(wl), SATURATION_SAMPLE)
    assert sum(wl.output_lens[i] == 9 for i in idx) == 2500
    cfg = SchedulerConfig(kv_tokens=100_000, token_budget=64, max_seqs=4)
    assert saturated_throughput(wl, cfg, ONE_SECOND) == pytest.approx(0.8)
    assert saturated_throughput(wl.head(5000), cfg, ONE_SECOND) == pytest.approx(5000 / 11_250)
    assert saturated_throughput(wl, cfg, ONE_SECOND, sample=len(wl)) == pytest.approx(0.8)  # the whole, at once


def test_capacity_keeps_prefix_ids_unless_cycled():
    """Steps of 1 s, a 16-token budget, 32-token prompts that all share their two prefix blocks, 1 output
    token each. Cold, a prompt takes 2 steps of 16 tokens; with prefix caching a repeat hits its first
    block (the last token is always computed) and takes 1.

    4 of 6 requests (runs of one: 0, 1, 3, 5) keep their prefix ids: the first takes steps 1-2, the three
    others one step each, 4 requests in 5 s = 0.8 req/s. A workload of 6 cycled up to 12 has none (copies
    would hit their own earlier copies): every request cold, 12 in 24 s = 0.5 req/s."""
    n = 6
    wl = Workload((0.0,) * n, (32,) * n, (1,) * n, prefix_ids=(((7, 8),) * n), prefix_block=16)
    cfg = SchedulerConfig(kv_tokens=10_000, token_budget=16, max_seqs=2, kv="paged", block_size=16,
                          prefix_caching=True)
    assert saturation_sample(n, 4) == [0, 1, 3, 5]
    assert saturated_throughput(wl, cfg, ONE_SECOND, sample=4) == pytest.approx(0.8)
    assert saturated_throughput(wl, cfg, ONE_SECOND, sample=12) == pytest.approx(0.5)


def test_split_bound_prices_the_decodes_at_the_sampled_requests_prompts(tmp_path, monkeypatch):
    """The decode side's burst is priced at each request's true context: rid i's offset must be the prompt of
    the request saturated_throughput times as rid i. On a trace whose first half has 1,000-token prompts and
    second half 10-token ones, half the sampled requests are from each half (not 5,000 of the head's)."""
    from stallfree.sim.inputs.options import HardwareOptions, WorkloadOptions
    from stallfree.sim.inputs.setup import Setup
    from stallfree.sim.studies import split_bound as sb

    n = 10_000
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n"
                     + "".join(f"{k * 0.01:.2f},{1000 if k < n // 2 else 10},3\n" for k in range(n)))
    setup = Setup(WorkloadOptions(trace=str(trace)), HardwareOptions(linear_cost="10,1000"))
    calls: list[tuple[Workload, object]] = []

    def record(workload, scheduler, cost, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((workload, cost))
        return 1.0

    monkeypatch.setattr(sb, "saturated_throughput", record)
    sb.split_bound(setup, 2048)
    (prefill, _), (decode, cost) = calls
    whole = setup.workload
    idx = saturation_sample(len(whole), SATURATION_SAMPLE)
    timed = saturation_sample(len(decode), SATURATION_SAMPLE)  # the rids saturated_throughput will build
    assert timed == list(range(SATURATION_SAMPLE))
    assert prefill.prompt_lens == tuple(whole.prompt_lens[i] for i in idx)
    assert [cost.offset[r] for r in timed] == [whole.prompt_lens[i] for i in idx]  # type: ignore[attr-defined]
    assert sorted(set(prefill.prompt_lens)) == [10, 1000]
    assert sum(p == 1000 for p in prefill.prompt_lens) == 2500


def _burst_sizes(monkeypatch: pytest.MonkeyPatch, most: int) -> list[int]:
    """Record the size of every burst saturated_throughput simulates; refuse (fail at once) one over `most`."""
    sizes: list[int] = []
    real = simulator.simulate

    def recording(burst, *args, **kwargs):
        sizes.append(len(burst))
        assert len(burst) <= most, f"a burst of {len(burst):,} requests"
        return real(burst, *args, **kwargs)

    monkeypatch.setattr(simulator, "simulate", recording)
    return sizes


def test_a_cycled_burst_is_cut_to_its_step_bound(monkeypatch):
    """5 prompts of 2,000 tokens and 10 outputs at a budget of 1 token: 2,000 + 10 steps a request, so the
    5,000 copies would take 10 M steps. The burst is cut to the bound (SATURATION_STEPS, 500,000: here
    50,000) / 2,010 = 24 requests (4 copies and 4 more), about the bound's steps, and gives the capacity
    of that burst."""
    wl = Workload((0.0,) * 5, (2000,) * 5, (10,) * 5)
    cfg = SchedulerConfig(kv_tokens=100_000, token_budget=1, max_seqs=4)
    assert burst_steps_per_request(wl, cfg) == 2010
    assert SATURATION_STEPS == 500_000
    monkeypatch.setattr(simulator, "SATURATION_STEPS", 50_000)
    sizes = _burst_sizes(monkeypatch, 24)
    got = saturated_throughput(wl, cfg, ONE_SECOND)
    assert sizes == [24]
    burst = wl.take(saturation_sample(5, 24))
    res = simulator.simulate(replace(burst, arrivals=(0.0,) * 24), cfg, ONE_SECOND)
    assert got == 24 / res.step_end[-1]


def test_the_cut_never_goes_below_the_workloads_own_requests(monkeypatch):
    """3 prompts of 4,000 tokens at a budget of 1 under a bound of 1,000 steps: each request alone is past
    it; the burst is the workload itself, once."""
    wl = Workload((0.0,) * 3, (4000,) * 3, (1,) * 3)
    cfg = SchedulerConfig(kv_tokens=100_000, token_budget=1, max_seqs=4)
    sizes = _burst_sizes(monkeypatch, 3)
    monkeypatch.setattr(simulator, "SATURATION_STEPS", 1000)
    assert saturated_throughput(wl, cfg, ONE_SECOND, sample=10) > 0
    assert sizes == [3]


def test_a_burst_within_the_bound_is_the_whole_sample(monkeypatch):
    """The default budget and sequences on 30 requests of a few hundred tokens: far within the bound, the
    burst stays SATURATION_SAMPLE requests (a normal run's capacity is unchanged)."""
    wl = Workload((0.0,) * 30, (600,) * 30, (200,) * 30)
    cfg = SchedulerConfig(kv_tokens=10_000_000)
    assert burst_steps_per_request(wl, cfg) == pytest.approx(600 / 2048 + 200 / 256)
    sizes = _burst_sizes(monkeypatch, SATURATION_SAMPLE)
    saturated_throughput(wl, cfg, LinearCostModel(base_s=0.01, per_token_s=1e-5))
    assert sizes == [SATURATION_SAMPLE]


def test_a_step_time_target_counts_the_tokens_its_steps_hold():
    """Steps of 4 ms + 0.1 ms a token under a 5 ms target hold 10 tokens: a lone prefill chunk of 10, or 10
    decodes; 100-token prompts and 20 outputs take 100 / 10 + 20 / 10 = 12 steps a request."""
    wl = Workload((0.0,) * 4, (100,) * 4, (20,) * 4)
    model = LinearCostModel(base_s=0.004, per_token_s=1e-4)
    cfg = TimeBudgetConfig(CoreConfig(65536, 256, 1_000_000), 0.005, model)
    assert burst_steps_per_request(wl, cfg) == pytest.approx(12)
    assert burst_steps_per_request(wl, lambda: None) is None  # a factory of another kind: not bounded
