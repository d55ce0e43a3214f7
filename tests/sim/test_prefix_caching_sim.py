"""The simulator's prefix caching: the Mooncake reader, the block mapping, the infinite-cache bound,
the hit accounting and the simulate flags."""

from __future__ import annotations

import hashlib
import json
from importlib import resources

import pytest

from stallfree.sim.inputs.traces import load_mooncake, load_trace
from stallfree.sim.inputs.workload import TraceError, Workload
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.simulator import simulate

COST = LinearCostModel(base_s=0.5, per_token_s=0.125)


def write(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [7, 8]},
    {"timestamp": 2000, "input_length": 1100, "output_length": 2, "hash_ids": [7, 8, 9]},
    {"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [7, 5]},
]


def test_mooncake_rows_read_by_auto_with_ms_timestamps_sorted(tmp_path):
    """Timestamps are ms; rows are sorted by arrival with their ids carried along."""
    wl = load_trace(write(tmp_path, ROWS))
    assert wl.arrivals == (0.0, 1.0, 2.0)
    assert wl.prompt_lens == (1000, 600, 1100)
    assert wl.prefix_ids == ((7, 8), (7, 5), (7, 8, 9))


def test_block_hashes_map_512_token_blocks_onto_scheduler_blocks(tmp_path):
    """Blocks of 256: 1000 tokens -> 3 full blocks: (7, 0), (7, 1), (8, 0); a block size not dividing 512
    is an error naming both numbers."""
    wl = load_trace(write(tmp_path, ROWS))
    assert wl.block_hashes(0, 256) == ((7, 0), (7, 1), (8, 0))
    assert len(wl.block_hashes(0, 16) or ()) == 1000 // 16
    with pytest.raises(ValueError, match="block_size 48 must divide .* 512"):
        wl.block_hashes(0, 48)


def test_infinite_cache_bound_by_hand(tmp_path):
    """Blocks of 512; only full blocks are cached. Request 0 (1000 tokens, ids 7 8) hits nothing and
    caches block 7 only (block 8 holds 488 tokens). Request 1 (600, ids 7 5) hits block 7: 512 tokens.
    Request 2 (1100, ids 7 8 9) hits block 7; block 8 was never full before, so 512.
    Bound = (512 + 512) / (1000 + 600 + 1100)."""
    wl = load_trace(write(tmp_path, ROWS))
    assert wl.prefix_hit_bound(512) == pytest.approx(1024 / 2700)
    # Blocks of 8: request 0's 1000 tokens fill 125 blocks, 64 of them in id 7 and 61 in id 8, so
    # request 2 hits 125 blocks = 1000 tokens; request 1 hits id 7's 64 blocks = 512.
    assert wl.prefix_hit_bound(8) == pytest.approx((512 + 1000) / 2700)


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ('{"timestamp": 0, "input_length": 1000, "output_length": 3}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1]}', "hash_ids has 1 ids"),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1, "x"]}', "list of integers"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}', "input_length"),
        ("{not json", ""),
    ],
)
def test_malformed_mooncake_row_is_named_by_line(tmp_path, row, what):
    """A bad second row: the error starts with path:2: and names the field."""
    p = write(tmp_path, [ROWS[0], row])
    with pytest.raises(TraceError, match=rf"t.jsonl:2: .*{what}"):
        load_trace(p, "mooncake")


def test_skip_bad_rows_keeps_the_ids_aligned(tmp_path):
    """A skipped bad row leaves the other rows' ids with their rows."""
    p = write(tmp_path, [ROWS[0], '{"timestamp": 1}', ROWS[1]])
    wl = load_trace(p, "mooncake", skip_bad_rows=True)
    assert wl.skipped_rows == 1 and wl.prefix_ids == ((7, 8), (7, 8, 9))


def test_bundled_mooncake_trace_matches_its_checksum_and_counts():
    """12,031 requests, mean prompt 12,035 tokens (rounded), about an hour; the uncompressed bytes hash to
    the SHA-256 in data/README.md."""
    import gzip

    raw = gzip.decompress((resources.files("stallfree.sim") / "data" / "mooncake_fast25_conversation.jsonl.gz")
                          .read_bytes())
    assert hashlib.sha256(raw).hexdigest() == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    wl = load_mooncake()
    assert len(wl) == 12031
    assert round(sum(wl.prompt_lens) / len(wl)) == 12035
    assert 3000 < wl.duration < 4000


def _shared_workload(n=6):
    """n requests of 600 tokens, all sharing trace block 1, one second apart."""
    return Workload(
        arrivals=tuple(float(i) for i in range(n)),
        prompt_lens=(600,) * n,
        output_lens=(2,) * n,
        prefix_ids=tuple((1, 100 + i) for i in range(n)),
    )


def test_simulated_hit_rate_reaches_the_bound_when_nothing_is_evicted():
    """Requests arrive one at a time, so every one after the first hits the 512 shared tokens: 5 x 512 /
    (6 x 600), and the infinite-cache bound is the same."""
    wl = _shared_workload()
    cfg = SchedulerConfig(100_000, 2048, 8, kv="paged", block_size=16, prefix_caching=True)
    res = simulate(wl, cfg, COST, check=True)
    assert res.prefix_cache_hit_rate == pytest.approx(5 * 512 / 3600)
    assert res.prefix_cache_hit_rate_bound == pytest.approx(5 * 512 / 3600)
    assert res.prefix_cache_evictions == 0
    off = simulate(wl, SchedulerConfig(100_000, 2048, 8, kv="paged", block_size=16), COST)
    assert off.prefix_cache_hit_rate is None
    # Fewer prefill tokens computed: every later request's first step is shorter.
    assert sum(res.step_tokens) == sum(off.step_tokens) - 5 * 512


def test_prefix_caching_needs_paged():
    """SchedulerConfig refuses prefix_caching under the reservation policy."""
    with pytest.raises(ValueError, match="prefix caching needs the paged scheduler"):
        SchedulerConfig(1000, prefix_caching=True)


def test_cli_prefix_caching_needs_paged_and_compare_caching_runs_both(tmp_path, capsys):
    """--enable-prefix-caching on a run that reserves its KV (--kv-policy reserve typed, or the contract's
    default under --kernels none) is a one-line error (exit 2); --compare-caching gives two runs, the second
    with the hit rate and its bound."""
    from stallfree.cli import main

    p = write(tmp_path, [{"timestamp": i * 100, "input_length": 600, "output_length": 2, "hash_ids": [1, 100 + i]}
                         for i in range(6)])
    assert main(["simulate", "--trace", str(p), "--enable-prefix-caching", "--kernels", "none"]) == 2
    assert "--enable-prefix-caching needs --kv-policy paged" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(p), "--enable-prefix-caching", "--kv-policy", "reserve"]) == 2
    assert "--enable-prefix-caching needs --kv-policy paged" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(p), "--kv-policy", "paged", "--compare-caching", "--json",
                 "--linear-cost", "10,100"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["prefix_cache_hit_rate"] is None for r in runs] == [True, False]
    assert runs[1]["prefix_cache_hit_rate"] == pytest.approx(5 * 512 / 3600)
    assert runs[1]["prefix_cache_hit_rate_bound"] == pytest.approx(5 * 512 / 3600)


def test_step_time_target_keeps_prefix_caching(tmp_path, capsys):
    """simulate --step-time-target with --prefix-caching runs the time-budget scheduler with caching on:
    the 6 one-at-a-time requests hit the shared 512 tokens as without a time target (5 x 512 / 3600)."""
    from stallfree.cli import main

    p = write(tmp_path, [{"timestamp": i * 100, "input_length": 600, "output_length": 2, "hash_ids": [1, 100 + i]}
                         for i in range(6)])
    assert main(["simulate", "--trace", str(p), "--kv-policy", "paged", "--enable-prefix-caching", "--json",
                 "--linear-cost", "10,100", "--step-time-target", "100ms"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["prefix_cache_hit_rate"] == pytest.approx(5 * 512 / 3600)


def test_sweep_over_kv_capacity_writes_rows_and_plot(tmp_path, capsys):
    """sweep --kv-tokens LIST --prefix-caching: one run per size, smallest first; the large cache reaches
    the bound (nothing evicted), and kv_sweep.json / kv_sweep.png are written."""
    from stallfree.cli import main

    rows = [{"timestamp": i * 100, "input_length": 600, "output_length": 2, "hash_ids": [1, 100 + i]}
            for i in range(6)]
    p = write(tmp_path, rows)
    out = tmp_path / "out"
    assert main(["sweep", "--trace", str(p), "--enable-prefix-caching", "--kv-tokens", "100000,1000",
                 "--budgets", "2048", "--linear-cost", "10,100", "--out", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["rows"]
    assert [r["kv_tokens"] for r in got] == [1000, 100000]
    assert got[1]["prefix_cache_hit_rate"] == pytest.approx(5 * 512 / 3600)
    assert got[1]["prefix_cache_evictions"] == 0
    assert (out / "kv_sweep.png").stat().st_size > 0 and (out / "kv_sweep.json").exists()


def test_kv_sweep_title_names_the_model_and_gpus():
    """The plot's title gains the replica: the rows' hardware description up to its first ';'."""
    from stallfree.sim.studies.kv_sweep import kv_sweep_title

    rows = [{"hardware": "llama-3.3-70b, 4 x h100-sxm, fp8; steps priced by the floor"}]
    assert kv_sweep_title(rows, "t.jsonl: budget 2,048") == "t.jsonl: budget 2,048\nllama-3.3-70b, 4 x h100-sxm, fp8"
    assert kv_sweep_title([{}], "t") == "t" and kv_sweep_title([], "t") == "t"


def test_cost_model_still_pays_attention_over_the_cached_prefix():
    """A hit chunk of 512 tokens starting at token 4096 costs more than the same 512 tokens from 0: the
    roofline prices its attention over the 4096 cached tokens (the chunk's start)."""
    from stallfree.core.plan import ScheduledChunk, StepPlan
    from stallfree.sim.inputs.pricing import default_cost_model

    model, _ = default_cost_model()

    def plan(start):
        return StepPlan(step=0, decode_rids=(), decode_offsets=(),
                        prefills=(ScheduledChunk(1, 512, True, start, True),), num_tokens=512,
                        decode_context_sum=0, token_budget=2048)

    assert model.step_time(plan(4096)) > model.step_time(plan(0))


def test_cli_compare_caching_on_a_cluster_writes_both_runs_and_shows_the_cache(tmp_path, capsys, monkeypatch):
    """--compare-caching --replicas 2: both runs are the 2-replica cluster (round-robin: 3 requests each, so
    2 hits of 512 tokens per replica), the runs get distinct file tags (-cache), the table shows the hit rate,
    its bound and the evictions, and the "wrote" line names the real files."""
    from stallfree.cli import main
    from stallfree.sim.outputs import plots

    for name in ("plot_cdfs", "plot_timeline", "plot_replica_timeline"):
        monkeypatch.setattr(plots, name, lambda *a, **kw: None)
    p = write(tmp_path, [{"timestamp": i * 100, "input_length": 600, "output_length": 2, "hash_ids": [1, 100 + i]}
                         for i in range(6)])
    base = ["simulate", "--trace", str(p), "--kv-policy", "paged", "--compare-caching", "--linear-cost", "10,100",
            "--replicas", "2", "--router", "round-robin"]
    assert main([*base, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [len(r["replicas"]) for r in runs] == [2, 2]
    assert runs[1]["prefix_cache_hit_rate"] == pytest.approx(4 * 512 / 3600)
    out, rec = tmp_path / "out", tmp_path / "r.csv"
    assert main([*base, "--out", str(out), "--records", str(rec)]) == 0
    text = capsys.readouterr().out
    for row in ("prefix cache hit rate", "56.9%", "prefix cache hit bound (infinite cache)", "71.1%",
                "prefix cache evictions"):
        assert row in text
    assert (f"wrote {out}/summary.json, requests-chunked-paged.csv, steps-chunked-paged.csv, "
            "requests-chunked-paged-cache.csv, steps-chunked-paged-cache.csv") in text
    assert sorted(f.name for f in tmp_path.glob("r-*.csv")) == ["r-chunked-paged-cache.csv", "r-chunked-paged.csv"]
    assert (out / "requests-chunked-paged.csv").read_text() != (out / "requests-chunked-paged-cache.csv").read_text()


def test_cli_prefix_caching_without_block_hashes_says_nothing_can_hit(tmp_path, capsys):
    """--prefix-caching on a trace without prefix ids runs, with a note on stderr that nothing can hit."""
    from stallfree.cli import main

    p = write(tmp_path, ["arrival_time,prompt_len,output_len", "0,100,2", "1,100,2"], name="t.csv")
    assert main(["simulate", "--trace", str(p), "--trace-format", "csv", "--kv-policy", "paged",
                 "--enable-prefix-caching",
                 "--linear-cost", "10,100", "--json"]) == 0
    assert "note: --enable-prefix-caching: " in capsys.readouterr().err

def _kv_trace(tmp_path):
    return write(tmp_path, [{"timestamp": i * 100, "input_length": 600, "output_length": 2, "hash_ids": [1, 100 + i]}
                            for i in range(6)])


def test_kv_sweep_with_a_size_too_small_prints_dashes_and_warns(tmp_path, capsys):
    """A size no request fits: "-" for its figures, a stderr line with the rejections per size, the plot
    written without it; the text starts with a header line naming the trace file (not its path), the
    request count and the default budget 2,048."""
    from stallfree.cli import main

    out = tmp_path / "out"
    assert main(["sweep", "--trace", str(_kv_trace(tmp_path)), "--enable-prefix-caching", "--kv-tokens", "100,100000",
                 "--linear-cost", "10,100", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert lines[0].startswith("kv sweep: t.jsonl: 6 requests, rate x1, budget 2,048, prefix caching")
    assert "rejected" in lines[1] and "preempted" in lines[1]
    assert lines[2].split()[:4] == ["100", "-", "-", "-"] and lines[2].split()[-1] == "6"
    assert "6 at 100" in cap.err and "Traceback" not in cap.err
    rows = json.loads((out / "kv_sweep.json").read_text())
    assert rows[0]["median_ttft_ms"] is None and rows[0]["rejected"] == 6
    assert (out / "kv_sweep.png").stat().st_size > 0


def test_kv_sweep_refuses_several_budgets_and_writes_nothing(tmp_path, capsys):
    from stallfree.cli import main

    out = tmp_path / "out"
    for flag, value in (("--budgets", "256,512"), ("--rate-scales", "1,2"), ("--batching", "chunked,no-chunk")):
        assert main(["sweep", "--trace", str(_kv_trace(tmp_path)), "--kv-tokens", "1000,2000", flag, value,
                     "--linear-cost", "10,100", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{flag} {value}" in err
    assert main(["sweep", "--trace", str(_kv_trace(tmp_path)), "--max-num-partial-prefills", "2",
                 "--max-long-partial-prefills", "9", "--linear-cost", "10,100", "--out", str(out)]) == 2
    assert "--max-long-partial-prefills 9 must be <= --max-num-partial-prefills 2" in capsys.readouterr().err
    assert not out.exists()


def test_kv_sweep_without_caching_drops_the_hit_rate_panel(tmp_path, capsys, recwarn):
    """No --prefix-caching: TTFT only (one panel, no matplotlib warning), the JSON at budget 2,048."""
    from stallfree.cli import main

    out = tmp_path / "out"
    assert main(["sweep", "--trace", str(_kv_trace(tmp_path)), "--kv-tokens", "1000,100000", "--json",
                 "--linear-cost", "10,100", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["token_budget"] == 2048
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]
    assert (out / "kv_sweep.png").stat().st_size > 0


def test_kv_sweep_rows_mark_hit_rates_preemption_inflates():
    """Rows show preemptions and rejections; a row with caching and preemptions is marked "*" with a
    footnote; plain token labels for the log axes."""
    from stallfree.sim.outputs.plot_parts import _tokens_label, _two_five_label
    from stallfree.sim.studies.kv_sweep import kv_sweep_lines

    base = {"prefix_cache_hit_rate": 0.25, "prefix_cache_hit_rate_bound": 0.08, "median_ttft_ms": 10.0,
            "p99_ttft_ms": 20.0, "request_throughput": 1.0, "prefix_cache_evictions": 3, "rejected": 0}
    rows = [dict(base, kv_tokens=10_000, num_preemptions=4, hit_rate_inflated_by_preemption=True),
            dict(base, kv_tokens=1_000_000, num_preemptions=0, hit_rate_inflated_by_preemption=False)]
    lines = kv_sweep_lines(rows, "t")
    assert lines[2].endswith("*") and lines[2].split()[-3:] == ["4", "0", "*"] and not lines[3].endswith("*")
    assert "readmissions" in lines[-1]
    assert [_tokens_label(x) for x in (100, 10_000, 1_500_000)] == ["100", "10k", "1.5M"]
    assert [_two_five_label(y) for y in (20.0, 0.5, 3.0)] == ["20", "0.5", ""]


def test_kv_sweep_first_admission_hit_rate_leaves_readmissions_out(capsys):
    """20 Mooncake requests on 200,000 tokens: requests are preempted and their readmissions push the hit
    rate far above the infinite-cache bound; over first admissions alone it is the bound (nothing
    evicted that a first admission needed). The row is marked; with no preemption the two rates agree."""
    from stallfree.cli import main

    assert main(["sweep", "--trace", "mooncake", "--num-requests", "20", "--enable-prefix-caching",
                 "--kv-tokens", "200000,4000000", "--json"]) == 0
    small, large = json.loads(capsys.readouterr().out)["rows"]
    assert small["num_preemptions"] > 0 and small["hit_rate_inflated_by_preemption"]
    assert small["prefix_cache_hit_rate"] > 2 * small["prefix_cache_hit_rate_bound"]
    assert small["prefix_cache_hit_rate_first_admission"] == pytest.approx(small["prefix_cache_hit_rate_bound"])
    assert large["num_preemptions"] == 0 and not large["hit_rate_inflated_by_preemption"]
    assert large["prefix_cache_hit_rate_first_admission"] == pytest.approx(large["prefix_cache_hit_rate"])
