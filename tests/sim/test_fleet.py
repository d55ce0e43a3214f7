"""stallfree plan's buying question: prices, GPU types and tensor parallelism, bounds, bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.cli import main
from stallfree.sim.inputs.prices import PriceError, load_prices, parse_gpu_prices, parse_max_gpus
from stallfree.sim.studies.fleet import busiest_window, row_cost


def _trace(tmp_path):
    """Twelve one-token requests 0.25 s apart (test_capacity's hand-worked trace: 4 replicas at 1 s a step)."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{0.25 * k},10,1\n" for k in range(12)))
    return trace


def _argv(trace, *more):
    return ["plan", "--trace", str(trace), "--linear-cost", "1000,0", "--max-num-seqs", "1", "--slo-ttft", "1s",
            "--executor", "serial", "--no-disaggregate", *more]


def test_cheapest_shape_is_found_and_the_others_are_bounded_out(tmp_path, capsys):
    """Under --linear-cost every shape's replica serves 1 req/s, so each needs 4 replicas (test_capacity):
    h200 x2 costs 4 x 2 x $2 = $16/h, h100-sxm x2 $24, h200 x4 $32, h100-sxm x4 $48. The cheapest bound is
    searched first and found at $16; every other shape's bound is at least $16, so none is simulated.
    At 4 req/s of 10-token prompts and 1-token outputs: 40 input and 4 output tokens/s, so $16/h is
    16 / (40 x 3600 / 1e6) = $111.11 per million input tokens and $1,111.11 per million output."""
    code = main(_argv(_trace(tmp_path), "--gpu", "h100-sxm,h200", "--tp", "2,4", "--gpu-price", "h100-sxm=3,h200=2",
                      "--json"))
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    a = report["answer"]
    assert (a["gpu"], a["tp"], a["replicas"], a["num_gpus"], a["kind"]) == ("h200", 2, 4, 8, "aggregated")
    assert a["usd_per_hour"] == pytest.approx(16.0)
    assert a["usd_per_mtok_input"] == pytest.approx(16 / 0.144)
    assert a["usd_per_mtok_output"] == pytest.approx(16 / 0.0144)
    assert a["prefill"] is None and a["decode"] is None and a["attainment"] == 1.0
    shapes = {(s["gpu"], s["tp"]): s for s in report["shapes"]}
    assert shapes[("h200", 2)]["skipped"] is None
    assert shapes[("h100-sxm", 2)]["bound_cost"] == pytest.approx(24.0)
    assert "not below the answer's 16.00 $/h" in shapes[("h100-sxm", 2)]["skipped"]
    assert {r["gpu"] for r in report["rows"]} == {"h200"} and {r["tp"] for r in report["rows"]} == {2}
    assert report["bound_simulations"] == 4  # one saturated run per shape
    assert report["simulations"] == len(report["rows"])


def test_max_gpus_caps_a_type_and_prices_from_files(tmp_path, capsys):
    """--max-gpus h200=4 allows only 2 replicas of h200 x2 (4 are needed), so the answer moves to h100-sxm x2
    at $24/h; the same prices read from a CSV with source and date, and from JSON, give the same answer."""
    trace = _trace(tmp_path)
    csv_file = tmp_path / "prices.csv"
    csv_file.write_text("gpu,usd_per_hour,source,date\nh100_sxm,3,a quote,2026-11-01\nh200,2,a quote,2026-11-01\n")
    json_file = tmp_path / "prices.json"
    json_file.write_text('{"h100-sxm": 3, "h200": {"usd_per_hour": 2, "source": "a quote", "date": "2026-11"}}')
    for prices in (["--prices", str(csv_file)], ["--prices", str(json_file)]):
        assert main(_argv(trace, "--gpu", "h100-sxm,h200", "--tp", "2", *prices, "--max-gpus", "h200=4",
                          "--json")) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["answer"]["gpu"], report["answer"]["usd_per_hour"]) == ("h100-sxm", pytest.approx(24.0))
        assert "--max-gpus h200=4" in {(s["gpu"]): s for s in report["shapes"]}["h200"]["skipped"]
    assert report["prices"]["h200"] == {"usd_per_hour": 2.0, "source": "a quote", "date": "2026-11"}


def test_weights_that_do_not_fit_are_skipped_with_the_reason(tmp_path, capsys):
    """Llama 3.3 70B in fp8 needs ~73 GB of weights per GPU at tp 1: more than an L40S's 48 GB, so l40s x1
    is skipped with that reason and the answer is l40s x2 (4 replicas, 8 GPUs, no prices: the fewest GPUs)."""
    assert main(_argv(_trace(tmp_path), "--gpu", "l40s", "--tp", "1,2")) == 0
    out = capsys.readouterr().out
    assert "answer: 4 replicas of l40s x2 (8 GPUs)" in out
    assert "the fewest GPUs (no prices given" in out
    assert "l40s x1: skipped: llama-3.3-70b weights in fp8 need 72.7 GB per GPU at --tp 1" in out


@pytest.mark.parametrize(("flags", "message"), [
    (["--gpu", "h100-sxm,h999"], "--gpu h999: unknown GPU 'h999'"),
    (["--tp", "3"], "--tp 3 does not divide the 64 attention heads of llama-3.3-70b"),
    (["--tp", "2,6"], "--tp 6 does not divide the 64 attention heads"),
    (["--gpu-price", "h999=2"], "unknown GPU 'h999'"),
    (["--gpu-price", "h100-sxm=-1"], "--gpu-price h100-sxm: the price '-1' must be a finite number >= 0"),
    (["--gpu-price", "h100-sxm=nan"], "the price 'nan' must be a finite number >= 0"),
    (["--gpu-price", "h100-sxm"], "each item is NAME=VALUE"),
    (["--gpu", "h100-sxm,h200", "--gpu-price", "h100-sxm=3"], "no price for h200"),
    (["--max-gpus", "h100-sxm=0"], "--max-gpus h100-sxm=0: the cap must be an integer >= 1"),
], ids=["unknown-gpu", "tp-heads", "tp-list", "price-gpu", "negative", "nan", "no-value", "unpriced", "cap"])
def test_bad_input_is_one_line_exit_2_and_nothing_simulated(tmp_path, capsys, flags, message):
    """Each bad value is named in one line, exit 2, before any simulation (no progress line on stderr)."""
    assert main(_argv(_trace(tmp_path), *flags)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "plan: simulation" not in err and len(err.strip().splitlines()) == 1


def test_price_file_without_a_column_is_refused(tmp_path, capsys):
    """A CSV without usd_per_hour names the column and the header; nothing runs (exit 2)."""
    bad = tmp_path / "p.csv"
    bad.write_text("gpu,price\nh100-sxm,3\n")
    assert main(_argv(_trace(tmp_path), "--prices", str(bad))) == 2
    err = capsys.readouterr().err
    assert "has no 'usd_per_hour' column (header: gpu,price)" in err and "plan: simulation" not in err
    with pytest.raises(PriceError, match="line 2: the price 'x'"):
        bad.write_text("gpu,usd_per_hour\nh100-sxm,x\n")
        load_prices(bad)


def test_price_parsers_and_row_cost_by_hand():
    """Names as presets ('_' and '-' alike); a row of 12 GPUs at $2.50 is $30/h; at 1,000 output tokens/s
    that is 30 / 3.6 = $8.33 per million; without prices the cost is the GPU count."""
    assert parse_gpu_prices("h100_sxm=2.5")["h100-sxm"].usd_per_hour == 2.5
    assert parse_max_gpus("H200=16") == {"h200": 16}
    with pytest.raises(PriceError, match="priced twice"):
        parse_gpu_prices("h100-sxm=1,h100_sxm=2")
    cost = row_cost({"num_gpus": 12}, 2.5, True, 2000.0, 1000.0)
    assert cost["usd_per_hour"] == 30.0 and cost["cost"] == 30.0
    assert cost["usd_per_mtok_output"] == pytest.approx(30 / 3.6)
    assert cost["usd_per_mtok_input"] == pytest.approx(30 / 7.2)
    assert row_cost({"num_gpus": 12}, 1.0, False, 2000.0, 1000.0) == {
        "cost": 12.0, "usd_per_hour": None, "usd_per_mtok_input": None, "usd_per_mtok_output": None}


def test_busiest_window_by_hand():
    """Arrivals at 0, 1, 2 and 60.5, 61 s: the busiest 60 s from 1 s hold 1, 2, 60.5 (3 requests: 0.05
    req/s); from 0 s, 0, 1, 2 (60.5 is past 60): 3 as well; from 2 s: 2, 60.5, 61: 3."""
    assert busiest_window([0, 1, 2, 60.5, 61], 60) == pytest.approx(3 / 60)
    assert busiest_window([0, 0.5, 1.0, 1.5], 1.0) == 2.0
    assert busiest_window([], 60) == 0.0
    with pytest.raises(ValueError):
        busiest_window([0.0], 0)


def test_out_writes_the_table_plot_and_serve_lines(tmp_path, capsys):
    """plan --out DIR writes plan.json, plan.csv (a row per cluster simulated, with its cost) and plan.png,
    and prints the serve line of the answer."""
    out = tmp_path / "out"
    assert main(_argv(_trace(tmp_path), "--gpu-price", "h100-sxm=3", "--out", str(out))) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["plan.csv", "plan.json", "plan.png"]
    lines = (out / "plan.csv").read_text().splitlines()
    assert lines[0].startswith("label,gpu,tp,kind,replicas,prefill,decode,router,num_gpus,attainment,usd_per_hour")
    assert any(line.startswith("x4 least-outstanding,h100-sxm,4,aggregated,4,,,least-outstanding,16,1.0,48.0")
               for line in lines)
    assert json.loads((out / "plan.json").read_text())["answer"]["usd_per_hour"] == 48.0
    assert "vllm serve MODEL --tensor-parallel-size 4" in captured.out
    assert f"wrote {out}/plan.json, plan.csv, plan.png" in captured.err


@settings(max_examples=200)
@given(st.lists(st.floats(0, 500, allow_nan=False), max_size=60), st.floats(0.5, 120))
def test_busiest_window_equals_a_brute_force_count(times, window):
    """The two-pointer rate equals counting, for every arrival, the arrivals in [t, t + window)."""
    times = sorted(times)
    brute = max((sum(1 for u in times if t <= u < t + window) for t in times), default=0)
    assert busiest_window(times, window) == pytest.approx(brute / window)


@settings(max_examples=200)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 6), st.integers(1, 40))
def test_count_search_finds_the_smallest_passing_count(threshold, start, width, most):
    """With a monotone verdict (counts >= threshold pass), the gallop-and-bisect search returns the
    threshold when it is within [1, most], else None; a count is never simulated twice."""
    from stallfree.sim.studies.capacity import _Search
    from stallfree.sim.studies.executors import SerialExecutor

    search = _Search(None, (1.0, None), 0.99, 2048, None, SerialExecutor(), None)
    seen: list[int] = []

    def verdicts(counts):
        seen.extend(counts)
        return [n >= threshold for n in counts]

    found = search._search(verdicts, min(start, most), width, most)
    assert found == (threshold if threshold <= most else None)
    assert len(seen) == len(set(seen))


@settings(max_examples=200)
@given(st.integers(2, 30), st.floats(0.05, 50), st.floats(0.05, 50), st.floats(0.05, 20))
def test_split_order_is_every_allowed_split_nearest_the_balance_first(n, mu_p, mu_d, rate):
    """split_order holds each P with P >= ceil(rate / mu_p) and n - P >= ceil(rate / mu_d) once, in
    order of distance to the balanced P* = n (1/mu_p) / (1/mu_p + 1/mu_d)."""
    import math

    from stallfree.sim.studies.capacity import SplitBound, split_order

    b = SplitBound(mu_p, mu_d, rate)
    order = split_order(n, b)
    p_min, d_min = math.ceil(rate / mu_p - 1e-9), math.ceil(rate / mu_d - 1e-9)
    assert sorted(order) == [p for p in range(1, n) if p >= p_min and n - p >= d_min]
    target = n * (1 / mu_p) / (1 / mu_p + 1 / mu_d)
    dist = [abs(p - target) for p in order]
    assert all(a <= b + 1e-9 for a, b in zip(dist, dist[1:], strict=False))  # ties at .5 round either way


def test_no_fleet_within_the_caps_exits_3(tmp_path, capsys):
    """4 replicas are needed (1 req/s each at 4 req/s): with --max-replicas 2 no shape meets the SLOs, each
    simulated at its N0 clamped to 2 (16.67%, as a plain plan would), and plan exits 3 with answer null."""
    assert main(_argv(_trace(tmp_path), "--gpu", "h100-sxm,h200", "--tp", "2", "--max-replicas", "2",
                      "--json")) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["answer"] is None and report["serve"] is None and report["load"] is None
    assert sorted((r["gpu"], r["replicas"]) for r in report["rows"]) == [("h100-sxm", 2), ("h200", 2)]
    assert all(r["attainment"] == pytest.approx(2 / 12) for r in report["rows"])


def test_why_line_gives_seconds_and_light_rates_as_the_report_does(tmp_path, capsys):
    """The why line's window of a trace shorter than a minute is its span to a tenth of a second (12 requests
    1/3 s apart span 11/3 s: "3.7 s", not "3.66667 s"), and a light load keeps two significant digits where
    two decimals read 0.00: 3 requests 300 s apart are 2 / 600 = 0.0033 req/s, 0.33% of the 1 req/s one
    replica sustains, and the busiest minute holds one of them, 1 / 60 = 0.017 req/s."""
    short = tmp_path / "short.csv"
    short.write_text("arrival_time,prompt_len,output_len\n" + "".join(f"{k / 3!r},10,1\n" for k in range(12)))
    assert main(_argv(short, "--slo-ttft", "2s")) == 0
    why = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("why: "))
    assert why.startswith("why: 3.00 req/s offered on average; one replica sustains ~1.00 req/s (the mean load is "
                          "300% of it): 3 replicas at the mean; the busiest 3.7 s (the whole trace) bring 3.00 req/s, "
                          "1.0x the mean: 3 at that rate; the answer's 3:")
    light = tmp_path / "light.csv"
    light.write_text("arrival_time,prompt_len,output_len\n0,10,1\n300,10,1\n600,10,1\n")
    assert main(_argv(light)) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(0.0033 req/s offered)" in out[0]
    why = next(line for line in out if line.startswith("why: "))
    assert why.startswith("why: 0.0033 req/s offered on average; one replica sustains ~1.00 req/s (the mean load is "
                          "under 1% of it): 1 replica at the mean; the busiest 60 s bring 0.017 req/s, 5.0x the mean:")
    assert next(line for line in out if line.startswith("search: ")).startswith(
        "search: one replica sustains ~1.00 req/s saturated, so 0.0033 req/s needs at least ~1")



def test_counts_of_one_are_singular(tmp_path, capsys):
    """Three requests 600 s apart (0.0017 req/s) need one replica: the search line counts "1 simulation" and
    "1 saturated run". With --max-replicas 1 the 12-request trace (4 replicas needed) finds no fleet "up to
    1 replica"."""
    light = tmp_path / "light.csv"
    light.write_text("arrival_time,prompt_len,output_len\n0,10,1\n600,10,1\n1200,10,1\n")
    assert main(_argv(light)) == 0
    search = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("search: "))
    assert search.startswith("search: one replica sustains ~1.00 req/s saturated, so 0.0017 req/s needs at least ~1 "
                             "(the start); 1 simulation in ")
    assert search.endswith(" s (and 1 saturated run for the bounds)")
    assert main(_argv(_trace(tmp_path), "--max-replicas", "1")) == 3
    out = capsys.readouterr().out
    assert "answer: no fleet up to 1 replica per shape meets TTFT <= 1,000 ms (target 99.00%)" in out
    assert "; 1 simulation in " in out and "(and 1 saturated run for the bounds)" in out


def test_table_goodput_of_a_light_load_keeps_two_digits(tmp_path, capsys):
    """Three requests 600 s apart, each served in a 1 s step, all within the SLO: the table's goodput is 3
    requests in the 1,201 s to the last finish, 0.0025 req/s, with two significant digits (two decimals
    read 0.00); per GPU of the 4 it is 0.00062 (three decimals read 0.001, and 0.000 ten times lighter). The
    12-request trace's answer, 3.20 req/s on 16 GPUs, keeps three decimals per GPU: 0.200."""
    light = tmp_path / "light.csv"
    light.write_text("arrival_time,prompt_len,output_len\n0,10,1\n600,10,1\n1200,10,1\n")
    assert main(_argv(light)) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "x1 least-outstanding" in line)
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:5] == [
        "x1 least-outstanding", "4", "100.00%", "0.0025", "0.00062"]
    assert main(_argv(_trace(tmp_path))) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.endswith("answer │"))
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:5] == [
        "x4 least-outstanding", "16", "100.00%", "3.20", "0.200"]
