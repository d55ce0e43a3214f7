"""Tests of `validate --against` on disaggregated benchmark rows: the prefill_* / decode_* columns read by hand,
the concurrency rule, the skip reasons, the closed loop on P prefill and D decode replicas by hand (a linear
step cost), and the replay's wiring (workers, link, KV bytes, the waves rule)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.sim.inputs.engine_profile import EngineProfile
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.disagg_link import Interconnect
from stallfree.validate import silicon
from stallfree.validate.silicon import NO_WORKERS, WorkerGroup, disagg_closed_loop, read_rows, select

_SIDE = ("batch_size", "num_workers", "tp_size", "pp_size", "attention_dp_size", "moe_tp_size", "moe_ep_size")
HEADER = ",".join(["id", "silicon_data_source", "backend", "backend_version", "model_path", "system", "precision",
                   "mode", "isl", "osl", "batch_size", "tp_size", "pp_size", "attention_dp_size", "moe_tp_size",
                   "moe_ep_size", *(f"prefill_{c}" for c in _SIDE), *(f"decode_{c}" for c in _SIDE),
                   "silicon_ttft_ms", "silicon_tpot_ms"])


def _row(source: str, prefill: str, decode: str, mode: str = "disagg", model: str = "Qwen/Qwen3-32B") -> str:
    return f"r,{source},vllm,0.12.0,{model},h100_sxm,fp8,{mode},64,4,,,,,,,{prefill},{decode},100.0,10.0"


def _csv(tmp_path: Path, *rows: str) -> Path:
    p = tmp_path / "d.csv"
    p.write_text("\n".join([HEADER, *rows]) + "\n")
    return p


def test_disagg_rows_by_hand(tmp_path):
    """Each side from its columns; the concurrency is silicon_concurrency=N, else decode_batch_size x
    decode_attention_dp_size x decode_num_workers (48 x 1 x 11 = 528; 4 x 2 x 3 = 24); empty fields as 0,
    pp, attention_dp and moe_ep as at least 1; mode all selects every row."""
    rows = read_rows(_csv(tmp_path,
                          _row("x; silicon_concurrency=36", "1,2,8,1,1,1,8", "4,9,8,1,1,1,8"),
                          _row("y", "1,5,1,1,1,0,0", "48,11,1,1,1,0,0"),
                          _row("z", "1,1,4,1,1,,", "4,3,4,1,2,,"),
                          _row("w", ",,4,1,1,4,1", ",,8,1,1,2,4")))
    assert [r.concurrency for r in rows] == [36, 528, 24, 0]
    assert rows[0].prefill == WorkerGroup(2, 8, 1, 1, 1, 8, 1) and rows[0].decode == WorkerGroup(9, 8, 1, 1, 1, 8, 4)
    assert rows[1].decode == WorkerGroup(11, 1, 1, 1, 0, 1, 48)
    assert rows[2].decode is not None and rows[2].decode.attention_dp == 2
    assert rows[3].prefill == WorkerGroup(0, 4, 1, 1, 4, 1, 0)
    assert rows[0].decode.layout() == "9 x tp8 ep8" and rows[2].decode.layout() == "3 x tp4 dp2"
    assert len(select(rows, mode="all")) == 4 and len(select(rows, mode="agg")) == 0


def test_disagg_skip_reasons_name_the_figures(tmp_path):
    """No worker counts, pipeline parallel on a side, or experts over more GPUs than the side's tp x
    attention_dp: refused with the reason, before any pricing; attention DP on a dense model by the cost
    model, naming the field. Fewer expert GPUs than tp (a dense model's moe_tp 1 x moe_ep 1 at tp 4)
    is not a refusal."""
    rows = read_rows(_csv(tmp_path,
                          _row("a; silicon_concurrency=5", ",,4,1,1,4,1", ",,8,1,1,8,1"),
                          _row("b; silicon_concurrency=5", "1,1,1,1,4,1,4", "1,4,8,1,1,1,8"),
                          _row("c; silicon_concurrency=5", "1,1,8,1,1,1,8", "1,2,8,1,1,2,8")))
    none = EngineProfile("none")
    with pytest.raises(ValueError, match="prefill_num_workers / decode_num_workers not given"):
        silicon.replay_row(rows[0], none, "none", 1)
    with pytest.raises(ValueError, match="line 3: ep 4: qwen3-32b has no experts"):  # DP attention is priced now
        silicon.replay_row(rows[1], none, "none", 1)
    with pytest.raises(ValueError, match=r"decode_moe_tp_size 2 x decode_moe_ep_size 8 = 16 GPUs against "
                                         r"decode_tp_size 8 x decode_attention_dp_size 1: implied attention data "
                                         "parallel"):
        silicon.replay_row(rows[2], none, "none", 1)
    piped = read_rows(_csv(tmp_path, _row("p; silicon_concurrency=5", "1,1,4,2,1,1,1", "1,1,4,1,1,1,1")))[0]
    with pytest.raises(ValueError, match="prefill_pp_size 2: pipeline parallel, not replayed"):
        silicon.replay_row(piped, none, "none", 1)
    dense = read_rows(_csv(tmp_path, _row("d; silicon_concurrency=1", "1,1,1,1,1,1,1", "1,1,4,1,1,1,1")))[0]
    assert silicon.replay_row(dense, none, "none", 1)["layout"] == "P 1 x tp1 : D 1 x tp4"
    assert NO_WORKERS.startswith("prefill_num_workers")


def test_disagg_closed_loop_by_hand():
    """Step = 10 ms + 0.1 ms per token; a 100-token prompt's KV (1,000 B a token) crosses a 1e8 B/s link with
    1 ms latency: 2 ms. Two requests of 100 prompt and 3 output tokens at concurrency 2:
    one prefill replica prefills both in one 200-token step (30 ms); two prefill one each (20 ms). The decode
    side feeds the first token then makes the third: one decode replica batches both (10.2 ms a step), two
    decode one each (10.1 ms). So the finish is first + 2 + 2 x step, ms. At concurrency 1 the second
    request is sent when the first ends, and repeats its timeline."""
    cost = LinearCostModel(0.01, 1e-4)
    sched = SchedulerConfig(10_000, 8192, 64, kv="paged", block_size=16)
    link = Interconnect("test", 1e8, 1e-3)
    for p, d, first, step in ((1, 1, 0.030, 0.0102), (2, 1, 0.020, 0.0102), (1, 2, 0.030, 0.0101),
                              (2, 2, 0.020, 0.0101)):
        got = disagg_closed_loop((sched, cost, p), (sched, cost, d), 1000, link, 2, 2, 100, 3)
        assert got == [pytest.approx((0.0, first, first + 0.002 + 2 * step))] * 2, (p, d)
    one = disagg_closed_loop((sched, cost, 1), (sched, cost, 1), 1000, link, 1, 2, 100, 3)
    assert one == [pytest.approx((0.0, 0.020, 0.0422)), pytest.approx((0.0422, 0.0622, 0.0844))]
    with pytest.raises(ValueError, match="concurrency=0"):
        disagg_closed_loop((sched, cost, 1), (sched, cost, 1), 1000, link, 0, 2, 100, 3)


def test_disagg_replay_wiring(tmp_path, monkeypatch):
    """A Qwen3-32B fp8 row on H100 SXM, 2 prefill replicas of tp 1 and 3 decode replicas of tp 2, concurrency
    8, replayed as 2 waves of hand-made times: TTFT over both waves (8 x 1.0 + 8 x 0.2) / 16 = 0.6 s, TPOT
    over the second wave, 3 gaps in 0.03 s = 10 ms. The KV crosses the H100's NVLink (450 GB/s a direction)
    with the prefill side's bytes per token per GPU: 2 (K, V) x 64 layers x 8 KV heads x 128 x 2 B (the KV
    cache in bf16, as the aggregated replay sizes it) at tp 1 = 262,144 B."""
    row = read_rows(_csv(tmp_path, _row("s; silicon_concurrency=8", "1,2,1,1,1,0,0", "4,3,2,1,1,0,0")))[0]
    seen = {}

    def fake(prefill, decode, kvb, link, concurrency, n, isl, osl, think_s=0.0, spread=False):  # type: ignore[no-untyped-def]
        seen.update(p=prefill[2], d=decode[2], kvb=kvb, bw=link.bandwidth_bytes_per_s, n=n, think=think_s)
        return [(0.0, 1.0, 1.15)] * concurrency + [(1.15, 1.35, 1.38)] * (n - concurrency)

    monkeypatch.setattr(silicon, "disagg_closed_loop", fake)
    got = silicon.replay_row(row, EngineProfile("none"), "none", 2)
    assert seen == {"p": 2, "d": 3, "kvb": 262_144, "bw": 450e9, "n": 16, "think": 0.0}
    assert got["mode"] == "disagg" and got["layout"] == "P 2 x tp1 : D 3 x tp2"
    assert got["sim_ttft_ms"] == pytest.approx(600.0) and got["sim_tpot_ms"] == pytest.approx(10.0)
    assert got["ttft_ape_pct"] == pytest.approx(500.0) and got["tpot_ape_pct"] == pytest.approx(0.0)
    summary = silicon._summary([got])
    assert summary[0]["mode"] == "disagg" and summary[0]["rows"] == 1
