"""Tenants in the simulator: the trace's tenant column, --fairness / --tenant-weights, and by_tenant."""

from __future__ import annotations

import json

import pytest

from stallfree.cli import main
from stallfree.sim.inputs.traces import load_trace
from stallfree.sim.inputs.workload import TraceError, Workload
from stallfree.sim.outputs.records import request_records
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.simulator import simulate


class _Flat:
    """Every step costs 10 ms, whatever it holds (so that times are worked out by hand)."""

    def step_time(self, plan: object) -> float:
        return 0.010


def test_csv_tenant_column_and_jsonl_field(tmp_path):
    """A CSV `tenant` column and a JSONL `tenant` field are read (empty or null: None, the "default"); a
    trace without them has no tenants."""
    csv = tmp_path / "t.csv"
    csv.write_text("arrival_time,prompt_len,output_len,tenant\n0,4,2,a\n1,5,3,\n0.5,6,1, b \n")
    wl = load_trace(csv)
    assert wl.tenants == ("a", "b", None)  # sorted by arrival
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n'
                  '{"arrival_time": 1, "prompt_len": 4, "output_len": 2, "tenant": "x"}\n'
                  '{"arrival_time": 2, "prompt_len": 4, "output_len": 2, "tenant": null}\n')
    assert load_trace(jl).tenants == (None, "x", None)
    plain = tmp_path / "p.csv"
    plain.write_text("arrival_time,prompt_len,output_len\n0,4,2\n")
    assert load_trace(plain).tenants is None


def test_bad_tenant_value_names_the_line(tmp_path):
    """A tenant that is not a string in JSONL is a TraceError naming the file and line."""
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"arrival_time": 0, "prompt_len": 4, "output_len": 2, "tenant": 7}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:1: tenant 7 is not a string"):
        load_trace(jl)


def _flood() -> Workload:
    # Tenant "flood": 6 prompts of 40 tokens at 0 s; tenant "light": one 4-token prompt at 0.001 s.
    return Workload((0.0,) * 6 + (0.001,), (40,) * 6 + (4,), (2,) * 6 + (2,), "flood",
                    tenants=("flood",) * 6 + ("light",))


def test_by_tenant_fcfs_against_vtc():
    """Budget 16, 1,000 KV tokens, 10 ms steps. FCFS: the light request waits behind the six 40-token
    prompts (240 prefill tokens, 16 a step, each next prompt taking what the last one leaves) and their
    decodes: its prompt runs in step 15, first token 0.160 s after the first arrival (0.159 s after its
    own). VTC: it is added after step 0 at the flood's counter (16, lifted) but with no service of its own,
    so it ranks first and is set aside in step 1 beside the flood's partial prefill: first token at the end
    of step 1, 0.019 s after its arrival."""
    wl = _flood()
    out = {}
    for fairness in ("fcfs", "vtc"):
        res = simulate(wl, ReplicaConfig.of(1000, 16, 8, fairness=fairness), _Flat())
        out[fairness] = summarize_result(res)["by_tenant"]
    assert out["vtc"]["light"]["median_ttft_ms"] == pytest.approx(19.0)
    assert out["fcfs"]["light"]["median_ttft_ms"] == pytest.approx(159.0)
    for f in out.values():
        assert f["light"]["num_requests"] == 1 and f["flood"]["num_requests"] == 6
        assert f["flood"]["completed"] == 6 and f["light"]["shed"] == 0


def test_records_carry_the_tenant_last():
    """The per-request records end with the tenant column when the workload names tenants."""
    res = simulate(_flood(), ReplicaConfig.of(1000, 16, 8), _Flat())
    rows = request_records(res)
    assert list(rows[0])[-1] == "tenant"
    assert [r["tenant"] for r in rows] == ["flood"] * 6 + ["light"]


def test_cli_fairness_and_weights(tmp_path, capsys):
    """`simulate --trace F --fairness vtc --tenant-weights flood=2 --json` reports by_tenant; a weight of 0 is a
    usage error (exit 2) naming the tenant."""
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_len,output_len,tenant\n" + "0,400,20,flood\n" * 5 + "0.01,10,5,light\n")
    assert main(["simulate", "--trace", str(f), "--json", "--fairness", "vtc", "--tenant-weights", "flood=2"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert set(run["by_tenant"]) == {"flood", "light"}
    assert run["by_tenant"]["light"]["completed"] == 1
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", str(f), "--tenant-weights", "flood=0"])
    assert e.value.code == 2
    assert "weight of tenant 'flood'" in capsys.readouterr().err


def test_cli_says_when_vtc_has_no_tenants_or_no_step_cap(tmp_path, capsys):
    """--fairness vtc on a trace without a tenant column says every request is the tenant 'default'; with a
    CPU KV tier it says the step cap stays off (and the header shows none); a trace with tenants says neither."""
    f = tmp_path / "t.csv"
    f.write_text("arrival_time,prompt_len,output_len\n" + "0,40,4\n" * 3)
    assert main(["simulate", "--trace", str(f), "--json", "--no-range", "--fairness", "vtc"]) == 0
    assert "has no tenant column" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(f), "--json", "--no-range", "--fairness", "vtc", "--cpu-kv-tokens",
                 "4096", "--enable-prefix-caching"]) == 0
    out = capsys.readouterr()
    assert "stays off with a CPU KV tier" in out.err
    assert "tenant_chunk_tokens" not in json.dumps(json.loads(out.out)["header"])
    g = tmp_path / "u.csv"
    g.write_text("arrival_time,prompt_len,output_len,tenant\n0,40,4,a\n0,40,4,b\n")
    assert main(["simulate", "--trace", str(g), "--json", "--no-range", "--fairness", "vtc"]) == 0
    out = capsys.readouterr()
    assert "note: --fairness" not in out.err
    assert '"tenant_chunk_tokens": 768' in json.dumps(json.loads(out.out)["header"])


def test_queue_time_limit_sheds_and_reports_apart():
    """Budget 16, 10 ms steps, FCFS, a 0.05 s queue limit: flood prompts 0-2 are admitted in steps 0, 2 and 5
    (t = 0.05 s: waited exactly the limit, not past it); at step 6 (t = 0.06 s) prompts 3-5 and the light
    request (waited 0.059 s) are shed: reason "timeout", no token, counted in `shed`, in no latency figure,
    and the run's token check still holds."""
    wl = _flood()
    res = simulate(wl, ReplicaConfig(ReplicaConfig.of(1000, 16, 8).scheduler, max_queue_time_s=0.05), _Flat())
    by = summarize_result(res)["by_tenant"]
    shed = [r for r in range(len(wl)) if res.finish_reason[r] == "timeout"]
    assert shed == [3, 4, 5, 6] and all(res.first_step[r] < 0 for r in shed)
    assert [res.admit_step[r] for r in range(3)] == [0, 2, 5]
    assert (by["flood"]["shed"], by["flood"]["completed"], by["light"]["shed"]) == (3, 3, 1)
    assert by["light"]["median_ttft_ms"] is None
    rows = request_records(res)
    assert [row["output_tokens"] for row in rows if row["finish_reason"] == "timeout"] == [0] * len(shed)
    with pytest.raises(ValueError, match="max_queue_time_s must be a finite number of seconds > 0, got 0"):
        ReplicaConfig(ReplicaConfig.of(1000, 16, 8).scheduler, max_queue_time_s=0)
