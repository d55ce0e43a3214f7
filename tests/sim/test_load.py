"""Closed-loop load: N requests in flight, the next sent when one ends, checked by hand on a linear cost model.

Step time = 0.5 s + 0.125 s per token (exact in binary floating point, so times compare with ==). Every
request has a 4-token prompt and 3 output tokens; the token budget is 8, so a step holds two prompts.

N = 1 (one client), 3 requests, no think time:
    request 0 arrives at 0; its prefill step costs 0.5 + 4 x 0.125 = 1.0 s (first token at 1.0), then two
    decode steps of 0.5 + 0.125 = 0.625 s each: it ends at 2.25 s. TTFT 1.0 s, TPOT 0.625 s, E2E 2.25 s.
    Request 1 is sent at 2.25 s, request 2 at 4.5 s; the last ends at 6.75 s.
    Achieved rate = 3 requests / 6.75 s = 4/9 req/s (= 1 / 2.25 s, one request per E2E).
    With a think time of 0.25 s: arrivals 0, 2.5, 5.0; the run lasts 7.25 s; rate 3 / 7.25 = 12/29 req/s.
N = 2 (two clients), 4 requests, no think time:
    requests 0 and 1 arrive at 0 and share each step: the prefill step holds 8 tokens, 0.5 + 1.0 = 1.5 s
    (both first tokens at 1.5), then two decode steps of 2 tokens, 0.75 s each: both end at 3.0 s.
    TTFT 1.5 s, TPOT 0.75 s, E2E 3.0 s. Requests 2 and 3 are sent at 3.0 s and repeat it: the run ends at 6.0 s.
    Achieved rate = 4 / 6.0 = 2/3 req/s (= N / E2E).
N = 2, 3 requests: request 2 is sent at 3.0 s alone and runs as under N = 1: it ends at 5.25 s; rate 3 / 5.25.
"""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.core import metrics
from stallfree.sim import LinearCostModel, SimResult, Workload, simulate
from stallfree.sim.inputs.options import HardwareOptions, SetupError, WorkloadOptions
from stallfree.sim.inputs.setup import Setup
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.disagg import simulate_disaggregated
from stallfree.sim.run.disagg_link import Interconnect
from stallfree.sim.run.load import Arrivals, ClosedLoop
from stallfree.sim.run.routers import RoundRobinRouter
from stallfree.sim.studies.experiment import run_experiment

COST = LinearCostModel(base_s=0.5, per_token_s=0.125)
CFG = SchedulerConfig(kv_tokens=10_000, token_budget=8, max_seqs=16)


def fixed(n: int, prompt: int = 4, output: int = 3) -> Workload:
    """n requests of fixed lengths; the arrival times (1 s apart) are what closed-loop load ignores."""
    return Workload(tuple(float(i) for i in range(n)), (prompt,) * n, (output,) * n, "fixed")


def e2e(res: SimResult) -> list[float | None]:
    """Each request's E2E latency, s."""
    return [metrics.e2e(t) for t in res.timelines()]


def ttft(res: SimResult) -> list[float | None]:
    """Each request's TTFT, s."""
    return [metrics.ttft(t) for t in res.timelines()]


def tpot(res: SimResult) -> list[float | None]:
    """Each request's TPOT, s."""
    return [metrics.tpot(t) for t in res.timelines()]


def test_one_client_sends_each_request_when_the_last_ends() -> None:
    """N = 1: arrivals 0, 2.25, 4.5 s; every request TTFT 1.0 s, TPOT 0.625 s, E2E 2.25 s; 4/9 req/s."""
    res = simulate(fixed(3), CFG, COST, closed_loop=ClosedLoop(1))
    assert res.arrival == (0.0, 2.25, 4.5)
    assert ttft(res) == [1.0, 1.0, 1.0]
    assert tpot(res) == [0.625, 0.625, 0.625]
    assert e2e(res) == [2.25, 2.25, 2.25]
    s = summarize_result(res)
    assert s["duration_s"] == 6.75
    assert s["achieved_request_rate"] == pytest.approx(4 / 9)
    assert s["concurrency"] == 1 and s["think_time_s"] == 0.0


def test_think_time_delays_the_next_request() -> None:
    """N = 1, think 0.25 s: arrivals 0, 2.5, 5.0 s; the run lasts 7.25 s, 12/29 req/s; latencies as without it."""
    res = simulate(fixed(3), CFG, COST, closed_loop=ClosedLoop(1, think_time=0.25))
    assert res.arrival == (0.0, 2.5, 5.0)
    assert e2e(res) == [2.25, 2.25, 2.25]
    s = summarize_result(res)
    assert s["duration_s"] == 7.25
    assert s["achieved_request_rate"] == pytest.approx(12 / 29)


def test_two_clients_share_every_step() -> None:
    """N = 2: pairs at 0 and 3.0 s; TTFT 1.5 s, TPOT 0.75 s, E2E 3.0 s each; 2/3 req/s."""
    res = simulate(fixed(4), CFG, COST, closed_loop=ClosedLoop(2))
    assert res.arrival == (0.0, 0.0, 3.0, 3.0)
    assert ttft(res) == [1.5] * 4
    assert tpot(res) == [0.75] * 4
    assert e2e(res) == [3.0] * 4
    assert summarize_result(res)["achieved_request_rate"] == pytest.approx(2 / 3)


def test_two_clients_with_an_odd_count_end_alone() -> None:
    """N = 2, 3 requests: the third is sent at 3.0 s and runs alone (E2E 2.25 s); the run ends at 5.25 s."""
    res = simulate(fixed(3), CFG, COST, closed_loop=ClosedLoop(2))
    assert res.arrival == (0.0, 0.0, 3.0)
    assert e2e(res) == [3.0, 3.0, 2.25]
    assert summarize_result(res)["achieved_request_rate"] == pytest.approx(3 / 5.25)


def test_more_clients_than_requests_send_everything_at_once() -> None:
    """N = 8 on 2 requests: both arrive at 0, as under N = 2."""
    res = simulate(fixed(2), CFG, COST, closed_loop=ClosedLoop(8))
    assert res.arrival == (0.0, 0.0)
    assert e2e(res) == [3.0, 3.0]


def test_a_refused_request_sends_the_next_at_once() -> None:
    """N = 1, context length 8: request 1 (a 10-token prompt) is refused when it is added at 2.25 s and
    request 2 is sent then, ending at 4.5 s."""
    wl = Workload((0.0, 0.0, 0.0), (4, 10, 4), (3, 3, 3), "mixed")
    res = simulate(wl, CFG, COST, max_model_len=8, closed_loop=ClosedLoop(1))
    assert res.arrival == (0.0, 2.25, 2.25)
    assert res.rejected_kind == {1: "context_length"}
    assert e2e(res) == [2.25, 2.25]
    assert summarize_result(res)["achieved_request_rate"] == pytest.approx(3 / 4.5)


def test_open_loop_is_unchanged_and_records_no_concurrency() -> None:
    """Without closed_loop the workload's arrivals are used and the config has no concurrency."""
    res = simulate(fixed(2), CFG, COST)
    assert res.arrival == (0.0, 1.0)
    assert "concurrency" not in res.config
    assert "achieved_request_rate" not in summarize_result(res)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"concurrency": 0}, "concurrency"), ({"concurrency": True}, "concurrency"),
     ({"concurrency": 1, "think_time": -1.0}, "think_time"),
     ({"concurrency": 1, "think_time": float("inf")}, "think_time")],
    ids=["zero", "bool", "negative-think", "inf-think"],
)
def test_closed_loop_refuses_bad_values(kwargs: dict[str, object], field: str) -> None:
    """A concurrency below 1 or a think time that is not a finite number >= 0 is refused, naming the field."""
    with pytest.raises(ValueError, match=f"ClosedLoop.{field}"):
        ClosedLoop(**kwargs)  # type: ignore[arg-type]


def test_open_loop_arrivals_ignore_ends() -> None:
    """Open-loop Arrivals read the workload's own arrival times (no copy) and a request's end sends nothing."""
    wl = fixed(2)
    a = Arrivals(wl)
    a.ended(5.0)
    assert a.times is wl.arrivals and list(a.times) == [0.0, 1.0] and a.sent == 2


def setup(concurrency: int | None, n: int = 4, **kw: object) -> Setup:
    """A Setup of n fixed-length requests (4-token prompts, 3 tokens out) priced 0.5 s + 0.125 s per token."""
    return Setup(
        WorkloadOptions(prompt_len="fixed:4", output_len="fixed:3", num_requests=n, concurrency=concurrency, **kw),
        HardwareOptions(linear_cost="500,125000", kv_tokens=10_000),
    )


def test_setup_and_run_experiment_take_concurrency() -> None:
    """Setup(WorkloadOptions(concurrency=2)) through run_experiment: the N = 2 figures, and the header says so."""
    study = run_experiment(setup(2), budget=8)
    s = study.summaries[0]
    assert s["achieved_request_rate"] == pytest.approx(2 / 3)
    assert s["mean_ttft_ms"] == pytest.approx(1500)
    assert s["mean_tpot_ms"] == pytest.approx(750)
    assert s["load"] == pytest.approx(s["achieved_request_rate"] / s["capacity_req_s"])
    h = study.header
    assert (h["concurrency"], h["think_time_s"], h["offered_rate"], h["rate_scale"]) == (2, 0.0, None, 1.0)
    assert h["workload"].startswith("closed-loop(concurrency=2")


def test_setup_refuses_rate_scale_and_think_time_alone() -> None:
    """rate_scale with concurrency, and think_time without it, are refused naming the field."""
    with pytest.raises(SetupError, match="rate_scale"):
        setup(2, rate_scale=2.0)
    with pytest.raises(SetupError, match="think_time"):
        setup(None, think_time=1.0)
    with pytest.raises(SetupError, match="ClosedLoop.concurrency"):
        setup(0)


def test_cli_concurrency_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate --concurrency 1 --think-time 250ms` on fixed lengths prints the N = 1 figures as JSON."""
    argv = ["simulate", "--concurrency", "1", "--think-time", "250ms", "--num-requests", "3",
            "--prompt-len", "fixed:4", "--output-len", "fixed:3", "--linear-cost", "500,125000",
            "--kv-tokens", "10000", "--max-num-batched-tokens", "8", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["achieved_request_rate"] == pytest.approx(12 / 29)
    assert run["mean_e2el_ms"] == pytest.approx(2250)
    assert out["header"]["concurrency"] == 1 and out["header"]["think_time_s"] == 0.25


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--think-time", "1s"], "--think-time applies"),
     (["--concurrency", "2", "--rate-scale", "2"], "--rate-scale"),
     (["--concurrency", "0"], "--concurrency")],
    ids=["think-alone", "rate-scale", "zero"],
)
def test_cli_refuses_bad_closed_loop_flags(extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Contradicting or out-of-range closed-loop flags exit 2 naming the flag."""
    try:
        code = main(["simulate", "--num-requests", "5", *extra])
    except SystemExit as exc:  # argparse's own type errors
        code = int(exc.code or 0)
    assert code == 2
    assert needle in capsys.readouterr().err


def test_closed_loop_on_a_cluster() -> None:
    """Two clients on two round-robin replicas: each replica serves one request at a time, as N = 1 does
    (E2E 2.25 s); arrivals 0, 0, 2.25, 2.25 s; 4 requests / 4.5 s."""
    out = simulate_cluster(fixed(4), CFG, COST, 2, RoundRobinRouter(), closed_loop=ClosedLoop(2))
    assert out.merged.arrival == (0.0, 0.0, 2.25, 2.25)
    assert out.routed == [0, 1, 0, 1]
    assert e2e(out.merged) == [2.25] * 4
    assert summarize_result(out.merged)["achieved_request_rate"] == pytest.approx(4 / 4.5)


def test_closed_loop_on_a_disaggregated_pair() -> None:
    """One client on 1P:1D with an instant link (0 KV bytes, 0 latency): the prefill step ends at 1.0 s
    (first token), the decode side feeds that token (0.625 s, second token at 1.625 s) and decodes once
    more (third at 2.25 s), so request 1 is sent at 2.25 s."""
    link = Interconnect("instant", 1e9, 0.0)
    out = simulate_disaggregated(fixed(2), CFG, CFG, COST, COST, 1, 1, 0, link, closed_loop=ClosedLoop(1))
    assert out.arrival == (0.0, 2.25)
    assert [metrics.e2e(t) for t in out.timelines] == [2.25, 2.25]
    assert [metrics.ttft(t) for t in out.timelines] == [1.0, 1.0]
