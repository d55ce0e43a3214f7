"""Tests of the validate comparison: latencies, percentiles and errors by hand; the vLLM result reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stallfree.core.metrics import RequestTimeline
from stallfree.validate.compare import METRICS, compare, latencies, read_vllm_result, summary
from stallfree.validate.vllm import validate_vllm

DATA = Path(__file__).parent / "data" / "vllm_result_small.json"


def _tl(rid, arrival, times):
    return RequestTimeline(rid, arrival, tuple(times))


def test_latencies_by_hand():
    """TTFT, TPOT, mean ITL and E2E of a request with tokens at 1.0, 1.5, 2.5 s after arriving at 0.5 s."""
    lat = latencies([_tl("a", 0.5, [1.0, 1.5, 2.5]), _tl("b", 0.0, [0.2])])
    a = lat["a"]
    assert (a.ttft, a.tpot, a.itl_mean, a.e2e) == pytest.approx((0.5, 0.75, 0.75, 2.0))
    assert a.itls == pytest.approx((0.5, 1.0))
    assert lat["b"].tpot is None and lat["b"].e2e == pytest.approx(0.2)


def test_compare_by_hand():
    """A simulator 10% slow on every gap and on TTFT gives 10% APE and +10% percentile errors."""
    eng = latencies([_tl(i, 0.0, [1.0, 2.0, 3.0]) for i in range(4)])
    sim = latencies([_tl(i, 0.0, [1.1, 2.2, 3.3]) for i in range(4)])
    err = compare(eng, sim, list(range(4)))
    for m in METRICS:
        assert err[f"{m}_median_ape_pct"] == pytest.approx(10.0)
        assert err[f"{m}_p90_ape_pct"] == pytest.approx(10.0)
        assert err[f"{m}_p99_err_pct"] == pytest.approx(10.0)
    s = summary(eng, list(range(4)))
    assert s["requests"] == 4 and s["p50_e2e_ms"] == pytest.approx(3000.0)
    with pytest.raises(ValueError, match="no request finished in both"):
        compare(eng, sim, [99])


def test_read_vllm_result_hand_file():
    """The hand-written `vllm bench serve --save-detailed` file reads back its six requests."""
    res = read_vllm_result(DATA)
    assert res.prompt_lens == (512, 256, 1024, 512, 384, 512)
    assert res.output_lens[2] == 12 and len(res.itls[2]) == 11
    assert res.request_rate == 4.0 and res.arrivals is None
    arrivals = res.arrival_times(seed=0)
    assert arrivals[0] == 0.0 and list(arrivals) == sorted(arrivals) and arrivals == res.arrival_times(seed=0)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"ttfts": None}, "no per-request list 'ttfts'"),
        ({"output_lens": [1, 2]}, "output_lens has 2 entries, input_lens 6"),
        ({"request_rate": 0}, "request_rate must be > 0"),
    ],
    ids=["missing", "length", "rate"],
)
def test_read_vllm_result_errors(tmp_path, change, match):
    """A bad result file is refused with the key named."""
    data = json.loads(DATA.read_text())
    data.update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        read_vllm_result(path)


def test_validate_vllm_structure():
    """--vllm-result simulates the same six requests and reports every metric, with the cost model named."""
    res = validate_vllm(DATA, "llama-3.1-8b", "h100-sxm", max_num_batched_tokens=2048, max_num_seqs=256)
    assert set(res) >= {"engine", "simulator", "error", "config", "notes"}
    assert res["engine"]["requests"] == res["simulator"]["requests"] == 6
    for key in ("e2e_median_ape_pct", "e2e_p90_ape_pct", "ttft_p99_err_pct", "tpot_p99_err_pct"):
        assert res["error"][key] is not None
    assert "lower bounds" in res["config"]["cost_model"]
    assert res["engine"]["p50_ttft_ms"] == pytest.approx(40.0)


def test_cli_json_keys(capsys):
    """`stallfree validate --vllm-result FILE --json` prints engine, simulator and error objects."""
    from stallfree.cli import main

    assert main(["validate", "--vllm-result", str(DATA), "--json"]) == 3  # outside the goals, printed first
    out = json.loads(capsys.readouterr().out)
    assert {"engine", "simulator", "error"} <= set(out)
    assert out["config"]["max_num_batched_tokens"] == 2048


def test_cli_bad_result_is_one_line(tmp_path, capsys):
    """A missing result file is one error line and exit code 2."""
    from stallfree.cli import main

    assert main(["validate", "--vllm-result", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_speed_drift_by_hand():
    """Decode-only steps at 0.2 s per token before the split and 0.1 s after: the machine sped up 50%."""
    from stallfree.costmodel.calibrate import MeasuredStep
    from stallfree.validate.run import EngineRun, _speed_drift

    steps = [(t, t + 0.4, MeasuredStep(2, 2, 20, 0.4)) for t in (0.0, 1.0)]
    steps += [(t, t + 0.2, MeasuredStep(2, 2, 20, 0.2)) for t in (5.0, 6.0)]
    steps.append((7.0, 7.5, MeasuredStep(10, 0, 0, 0.5, 10)))  # a prefill step does not count
    assert _speed_drift(EngineRun(steps=steps), split_t=3.0) == pytest.approx(-50.0)
    assert _speed_drift(EngineRun(steps=steps[:2]), split_t=3.0) is None


def test_drift_is_measured_on_steps_of_equal_shape():
    """The batches grow in the second half (1 decode at 0.1 s, then 4 decodes at 0.15 s), but the one shape
    run in both halves, 2 decodes, took 0.2 s before and 0.21 s after: drift +5%, step growth +50%. A miss
    of 32% is then not drift."""
    from stallfree.costmodel.calibrate import MeasuredStep
    from stallfree.validate.run import EngineRun, _speed_drift, _step_growth

    steps = [(t, t + 0.1, MeasuredStep(1, 1, 10, 0.1)) for t in (0.0, 0.2)]
    steps += [(0.5, 0.7, MeasuredStep(2, 2, 20, 0.2))]
    steps += [(t, t + 0.15, MeasuredStep(4, 4, 40, 0.15)) for t in (5.0, 5.5, 6.0)]
    steps += [(7.0, 7.21, MeasuredStep(2, 2, 20, 0.21))]
    run = EngineRun(steps=steps)
    assert _speed_drift(run, split_t=3.0) == pytest.approx(5.0)
    # Medians: first half (0.1, 0.1, 0.2) -> 0.1 s; second (0.15, 0.15, 0.15, 0.21) -> 0.15 s.
    assert _step_growth(run, split_t=3.0) == pytest.approx(50.0)
