"""Sessions: multi-turn conversations, each turn sent its delay after the previous turn's last token, its
history a cached prefix; checked by hand on a linear cost model.

Step time = 0.5 s + 0.125 s per token (exact in binary floating point, so times compare with ==). Paged
KV in blocks of 4 tokens with prefix caching, token budget 64. Two sessions share an 8-token system
prompt "p" (2 blocks):

    session "a": starts at 0 s. Turn 0: input 4, output 6 -> prompt 8 + 4 = 12.
                 Turn 1 after 1.0 s: input 4, output 2 -> prompt 12 + 6 + 4 = 22.
    session 7:   starts at 10 s. Turn 0: input 6, output 5 -> prompt 8 + 6 = 14.
                 Turn 1 after 0.5 s: input 2, output 1 -> prompt 14 + 5 + 2 = 21.

a/0 arrives at 0, nothing cached: a 12-token prefill, 0.5 + 1.5 = 2.0 s (first token at 2.0, TTFT 2.0),
    then 5 decodes of 0.625 s: it ends at 5.125 s. Its KV holds 12 + 6 - 1 = 17 computed tokens: 4 full
    blocks (3 of the prompt, 1 of its output), all cached when it finishes.
a/1 is sent at 5.125 + 1.0 = 6.125 s. Its history is 18 tokens: 4 full blocks = 16 tokens hit (the 4th is
    a/0's output: without caching output blocks it would hit 12); it computes 22 - 16 = 6 tokens, 1.25 s:
    first token at 7.375 (TTFT 1.25), one decode, ends at 8.0 s.
7/0 arrives at 10 s: the system prompt's 2 blocks (8 tokens) are cached by a/0, so it computes 6
    tokens, 1.25 s (TTFT 1.25, first token at 11.25), 4 decodes: ends at 13.75 s.
7/1 is sent at 13.75 + 0.5 = 14.25 s. History 19 tokens: 4 blocks = 16 hit; computes 5 tokens, 1.125 s:
    its first and only token at 15.375 s (TTFT 1.125).

Hit rate = (0 + 16 + 8 + 16) / (12 + 22 + 14 + 21) = 40 / 69, equal to the bound (everything before each
turn's new input, block-rounded; a first turn counts its system prompt when an earlier session used it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree.cli import main
from stallfree.sim import LinearCostModel, simulate
from stallfree.sim.inputs.session_traces import load_sessions
from stallfree.sim.inputs.sessions import (
    SessionWorkload,
    ThinkSpec,
    dump_turn,
    parse_think_spec,
    synthetic_sessions,
)
from stallfree.sim.inputs.synthetic import LengthSpec
from stallfree.sim.inputs.workload import TraceError
from stallfree.sim.outputs.records import request_records
from stallfree.sim.outputs.report import summarize_result
from stallfree.sim.run.cluster import simulate_cluster
from stallfree.sim.run.config import legacy_scheduler_config
from stallfree.sim.run.routers import RoundRobinRouter, SessionAffinityRouter, make_router
from stallfree.sim.run.session_run import SESSION_ENDED

COST = LinearCostModel(base_s=0.5, per_token_s=0.125)
CFG = legacy_scheduler_config(kv_tokens=4096, token_budget=64, max_seqs=8, kv="paged", block_size=4,
                              prefix_caching=True)

TWO = [
    {"session_id": "a", "turn": 0, "start_s": 0.0, "input_tokens": 4, "output_tokens": 6,
     "system_prompt_id": "p", "system_prompt_tokens": 8},
    {"session_id": 7, "turn": 0, "start_s": 10.0, "input_tokens": 6, "output_tokens": 5,
     "system_prompt_id": "p", "system_prompt_tokens": 8},
    {"session_id": "a", "turn": 1, "delay_s": 1.0, "input_tokens": 4, "output_tokens": 2},
    {"session_id": 7, "turn": 1, "delay_s": 0.5, "input_tokens": 2, "output_tokens": 1},
]


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    """A session trace of `rows`, one JSON object a line."""
    path.write_text("".join(dump_turn(r) + "\n" for r in rows))
    return path


@pytest.fixture
def two(tmp_path: Path) -> SessionWorkload:
    """The two sessions of the module docstring, read from a file."""
    return load_sessions(write(tmp_path / "two.jsonl", TWO))


def test_two_sessions_read_in_turn_order(two: SessionWorkload) -> None:
    """Turns are laid out by session start, then turn; prompts are the whole history plus the new input."""
    assert two.session_ids == ("a", 7)
    assert two.turn == (0, 1, 0, 1)
    assert two.prompt_lens == (12, 22, 14, 21)
    assert two.output_lens == (6, 2, 5, 1)
    assert two.delay_s == (0.0, 1.0, 0.0, 0.5)
    assert two.arrivals == (0.0, 0.0, 10.0, 10.0)
    assert two.prefix_hit_bound(4) == 40 / 69


def test_subset_bound_counts_only_what_that_replica_saw(two: SessionWorkload) -> None:
    """A replica's bound: a/1 alone saw neither the system prompt nor a/0 (0 of 22); a/0 then a/1 hit 16 of
    34; session 7 alone: 7/0 misses its system prompt, 7/1 hits 16, of 35."""
    assert two.subset_bound([1], 4) == 0.0
    assert two.subset_bound([0, 1], 4) == 16 / 34
    assert two.subset_bound([2, 3], 4) == 16 / 35


def test_two_sessions_by_hand(two: SessionWorkload) -> None:
    """Arrivals, cached tokens and TTFT of each turn as worked out in the module docstring."""
    res = simulate(two, CFG, COST, check=True)
    assert res.arrival == (0.0, 6.125, 10.0, 14.25)
    ttft = [res.step_end[res.first_step[r]] - res.arrival[r] for r in range(4)]
    assert ttft == [2.0, 1.25, 1.25, 1.125]
    assert [res.step_end[res.finish_step[r]] for r in range(4)] == [5.125, 8.0, 13.75, 15.375]
    # Each turn's prefill runs alone in one step: the prompt tokens it did not compute were cached.
    assert [res.prompt_len[r] - res.step_tokens[res.first_step[r]] for r in range(4)] == [0, 16, 8, 16]
    assert res.prefix_cache_hit_rate == 40 / 69
    assert res.prefix_cache_hit_rate_bound == 40 / 69
    summary = summarize_result(res)
    assert [(t["turn"], t["num_requests"], t["mean_ttft_ms"]) for t in summary["ttft_by_turn"]] == [
        (0, 2, 1625.0), (1, 2, 1187.5)]
    sessions = summary["sessions"]
    assert sessions["completed"] == 2 and sessions["ended_by_reason"] == {}
    assert sessions["max_duration_s"] == 8.0 and sessions["mean_duration_s"] == (8.0 + 5.375) / 2
    assert sessions["max_kv_tokens_per_session"] == 24  # a/1: 22 prompt + 2 output tokens
    rows = request_records(res)
    assert list(rows[0])[-2:] == ["session_id", "turn"]
    assert [(r["session_id"], r["turn"]) for r in rows] == [("a", 0), ("a", 1), (7, 0), (7, 1)]


def test_without_caching_nothing_hits_and_turns_still_wait(two: SessionWorkload) -> None:
    """Reserved KV, no cache: a/1 computes its 22 tokens (0.5 + 2.75 = 3.25 s) and is still sent at 6.125 s."""
    res = simulate(two, legacy_scheduler_config(kv_tokens=4096, token_budget=64, max_seqs=8), COST, check=True)
    assert res.arrival[1] == 6.125
    assert res.step_end[res.first_step[1]] - res.arrival[1] == 3.25
    assert res.prefix_cache_hit_rate is None


def test_rate_scale_scales_starts_not_delays(two: SessionWorkload) -> None:
    """Half as fast: session 7 starts at 20 s; its turn 1 is still sent 0.5 s after its turn 0 ends at
    20 + 3.75 s, and a/1 1.0 s after a/0 ends."""
    res = simulate(two.scale_rate(0.5), CFG, COST)
    assert res.arrival == (0.0, 6.125, 20.0, 24.25)


def test_a_refused_turn_ends_its_session(tmp_path: Path) -> None:
    """Turn 1 (prompt 4 + 4 + 4 = 12, + max_new 4 = 16 > 15) is refused for the context length at 2.125 s,
    when it is sent; turn 2 is never sent and counts as session_ended at that instant."""
    rows = [{"session_id": "c", "turn": 0, "start_s": 0.0, "input_tokens": 4, "output_tokens": 4},
            {"session_id": "c", "turn": 1, "delay_s": 0.25, "input_tokens": 4, "output_tokens": 4},
            {"session_id": "c", "turn": 2, "delay_s": 0.25, "input_tokens": 1, "output_tokens": 1}]
    wl = load_sessions(write(tmp_path / "c.jsonl", rows))
    res = simulate(wl, CFG, COST, max_model_len=15, check=True)
    # c/0: 4-token prefill 1.0 s, 3 decodes of 0.625 s: ends at 2.875 s; c/1 sent at 3.125 s.
    assert res.arrival == (0.0, 3.125, 3.125)
    assert res.rejected_by_reason == {"context_length": 1, SESSION_ENDED: 1}
    assert summarize_result(res)["sessions"]["ended_by_reason"] == {"context_length": 1}


def test_kv_rejection_ends_the_session(tmp_path: Path) -> None:
    """A turn that can never fit the KV cache (32 tokens of blocks > 24) is rejected; the next is not sent."""
    rows = [{"session_id": 1, "turn": 0, "start_s": 0.0, "input_tokens": 8, "output_tokens": 4},
            {"session_id": 1, "turn": 1, "delay_s": 0.0, "input_tokens": 16, "output_tokens": 4},
            {"session_id": 1, "turn": 2, "delay_s": 0.0, "input_tokens": 1, "output_tokens": 1}]
    wl = load_sessions(write(tmp_path / "k.jsonl", rows))
    small = legacy_scheduler_config(kv_tokens=24, token_budget=64, max_seqs=8, kv="paged", block_size=4,
                                    prefix_caching=True)
    res = simulate(wl, small, COST, check=True)
    assert res.rejected_by_reason == {"kv_capacity": 1, SESSION_ENDED: 1}
    assert res.finish_step[0] >= 0 and res.finish_step[1] < 0 and res.finish_step[2] < 0


@pytest.mark.parametrize(
    ("rows", "line", "needle"),
    [
        ([{"session_id": "x", "turn": 1, "delay_s": 1, "input_tokens": 1, "output_tokens": 1}], 1,
         "turn 1: before its session's turn 0"),
        ([{"session_id": "x", "turn": 0, "start_s": 0, "input_tokens": 1, "output_tokens": 1},
          {"session_id": "x", "turn": 0, "start_s": 1, "input_tokens": 1, "output_tokens": 1}], 2, "repeated"),
        ([{"session_id": "x", "turn": 0, "start_s": 0, "input_tokens": 1, "output_tokens": 1},
          {"session_id": "x", "turn": 2, "delay_s": 1, "input_tokens": 1, "output_tokens": 1}], 2,
         "after turn 0: turns go in order"),
        ([{"session_id": "x", "turn": 0, "start_s": 0, "input_tokens": 1, "output_tokens": 1},
          {"session_id": "x", "turn": 1, "delay_s": -1, "input_tokens": 1, "output_tokens": 1}], 2, "delay_s -1"),
        ([{"session_id": "x", "turn": 0, "start_s": 0, "input_tokens": -3, "output_tokens": 1}], 1,
         "input_tokens -3"),
        ([{"session_id": "x", "turn": 0, "input_tokens": 1, "output_tokens": 1}], 1, "'start_s'"),
        ([{"session_id": "x", "turn": 0, "start_s": 0, "input_tokens": 0, "output_tokens": 1}], 1,
         "input_tokens 0 on turn 0 without a system prompt"),
        ([{"session_id": "x", "turn": 0, "start_s": 0, "input_tokens": 1, "output_tokens": 1,
           "system_prompt_id": 1, "system_prompt_tokens": 8},
          {"session_id": "y", "turn": 0, "start_s": 0, "input_tokens": 1, "output_tokens": 1,
           "system_prompt_id": 1, "system_prompt_tokens": 9}], 2, "system_prompt_tokens 9"),
    ],
)
def test_bad_turns_name_file_line_and_field(tmp_path: Path, rows: list[dict[str, object]], line: int,
                                           needle: str) -> None:
    """A broken session is one error naming the file, the line and the field."""
    path = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError) as err:
        load_sessions(path)
    assert f"bad.jsonl:{line}:" in str(err.value) and needle in str(err.value)


def test_skip_bad_rows_counts_the_broken_session(tmp_path: Path) -> None:
    """With skip_bad_rows a bad turn and its session's later turns are skipped and counted."""
    rows = [*TWO[:3],
            {"session_id": 7, "turn": 1, "delay_s": -2, "input_tokens": 2, "output_tokens": 1},
            {"session_id": 7, "turn": 2, "delay_s": 1, "input_tokens": 2, "output_tokens": 1}]
    wl = load_sessions(write(tmp_path / "s.jsonl", rows), skip_bad_rows=True)
    assert wl.skipped_rows == 2 and wl.turn == (0, 1, 0)


def test_cli_refuses_a_broken_trace_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command exits 2 with the file and line; nothing is simulated."""
    path = write(tmp_path / "b.jsonl", [TWO[0], TWO[0]])
    assert main(["simulate", "--trace", str(path), "--linear-cost", "1,1"]) == 2
    err = capsys.readouterr().err
    assert "b.jsonl:2:" in err and "repeated" in err


def test_cli_trace_json_and_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--trace` detects the session format; the JSON has ttft_by_turn and the records end with the keys."""
    path = write(tmp_path / "two.jsonl", TWO)
    rec = tmp_path / "rec.json"
    code = main(["simulate", "--trace", str(path), "--linear-cost", "500,125000", "--kv-tokens", "4096",
                 "--max-num-batched-tokens", "64", "--kv-policy", "paged", "--block-size", "4",
                 "--enable-prefix-caching", "--json", "--records", str(rec)])
    assert code == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["prefix_cache_hit_rate"] == 40 / 69
    assert [t["mean_ttft_ms"] for t in run["ttft_by_turn"]] == [1625.0, 1187.5]
    rows = json.loads(rec.read_text())
    assert [(r["session_id"], r["turn"]) for r in rows] == [("a", 0), ("a", 1), (7, 0), (7, 1)]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--turns", "fixed:3"], "--turns applies to --synthetic sessions"),
        (["--synthetic", "sessions", "--disaggregate", "1:1"], "does not model sessions"),
        (["--synthetic", "sessions", "--concurrency", "2"], "--concurrency does not apply"),
        (["--synthetic", "sessions", "--think-time", "uniform:3,1"], "bad think time"),
        (["--concurrency", "2", "--think-time", "fixed:1"], "closed-loop load takes one duration"),
    ],
)
def test_cli_refuses_flags_at_odds_with_sessions(extra: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Flags that would be ignored or are not modelled with sessions exit 2 naming the flag."""
    try:
        code = main(["simulate", "--num-requests", "3", "--linear-cost", "1,1", *extra])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    assert needle in capsys.readouterr().err


def test_synthetic_sessions_are_seeded_and_grow() -> None:
    """Same seed, same sessions; each turn's prompt is the previous prompt plus its output plus the new input."""
    spec = LengthSpec("uniform", 10, 50)
    a = synthetic_sessions(20, 2.0, LengthSpec("uniform", 1, 5), spec, spec, ThinkSpec("exponential", 3.0),
                           system_tokens=40, num_system_prompts=2, seed=3)
    b = synthetic_sessions(20, 2.0, LengthSpec("uniform", 1, 5), spec, spec, ThinkSpec("exponential", 3.0),
                           system_tokens=40, num_system_prompts=2, seed=3)
    assert a == b and a.num_sessions == 20
    for i in range(1, len(a)):
        if a.turn[i]:
            assert a.prompt_lens[i] == a.prompt_lens[i - 1] + a.output_lens[i - 1] + a.input_lens[i]
        else:
            assert a.prompt_lens[i] == 40 + a.input_lens[i]


def test_parse_think_spec() -> None:
    """Seconds, or a named distribution; anything else names the text."""
    assert parse_think_spec(2.5) == ThinkSpec("fixed", 2.5)
    assert parse_think_spec("lognormal:3,0.5") == ThinkSpec("lognormal", 3.0, 0.5)
    with pytest.raises(ValueError, match="'gauss:1'"):
        parse_think_spec("gauss:1")


def test_session_affinity_overload_rule() -> None:
    """With a cap of (1.5, 4), a session stays on its replica while its unfinished requests are
    <= max(1.5 x low, low + 4);
    past it the turn goes to the least loaded replica, which the session then follows."""

    class Rep:
        def __init__(self, n: int) -> None:
            self.num_outstanding = n

    from stallfree.core.request import Request

    r = SessionAffinityRouter(1.5, 4, sessions=(0, 0, 0))
    reps = [Rep(2), Rep(0)]
    assert r.route(Request(0, 4, 1), reps) == 1  # type: ignore[arg-type]  # first turn: least loaded
    reps[1].num_outstanding = 4  # low 2: cap max(3, 6) = 6 >= 4, stays
    assert r.route(Request(1, 4, 1), reps) == 1  # type: ignore[arg-type]
    reps[1].num_outstanding = 7  # 7 > 6: moves to replica 0
    assert r.route(Request(2, 4, 1), reps) == 0 and r.num_moved == 1  # type: ignore[arg-type]
    assert isinstance(make_router("session-affinity"), SessionAffinityRouter)


@pytest.mark.slow
def test_session_affinity_keeps_each_session_on_one_replica() -> None:
    """With the cap off every turn of a session runs where its first turn ran, and the hit rate reaches the
    bound, while round-robin scatters turns and loses hits."""
    spec = LengthSpec("fixed", 64, 64)
    wl = synthetic_sessions(12, 1.0, LengthSpec("fixed", 4, 4), spec, spec, ThinkSpec("fixed", 1.0), seed=1)
    cfg = legacy_scheduler_config(kv_tokens=65_536, token_budget=512, max_seqs=16, kv="paged", block_size=16,
                                  prefix_caching=True)
    cost = LinearCostModel(base_s=0.01, per_token_s=1e-4)
    aff = simulate_cluster(wl, cfg, cost, 3, SessionAffinityRouter(load_factor=float("inf")), check=True)
    for s in range(wl.num_sessions):
        assert len({aff.routed[i] for i in range(len(wl)) if wl.session[i] == s}) == 1
    assert aff.merged.prefix_cache_hit_rate == aff.merged.prefix_cache_hit_rate_bound
    for res in aff.replicas:  # each replica reaches the bound of the turns it served
        assert res.prefix_cache_hit_rate == pytest.approx(res.prefix_cache_hit_rate_bound, abs=1e-12)
    rr = simulate_cluster(wl, cfg, cost, 3, RoundRobinRouter(), check=True)
    assert rr.merged.prefix_cache_hit_rate is not None and aff.merged.prefix_cache_hit_rate is not None
    assert rr.merged.prefix_cache_hit_rate < aff.merged.prefix_cache_hit_rate


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from([0.0, 0.25, 2.0])),
                            min_size=1, max_size=4), min_size=1, max_size=5),
    starts=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=5, max_size=5),
    system=st.integers(0, 12),
)
def test_turns_follow_their_delay_and_never_beat_the_bound(
        turns: list[list[tuple[int, int, float]]], starts: list[float], system: int) -> None:
    """Random sessions under the invariant checker: each later turn arrives exactly its delay after its
    predecessor's last token, and the hit rate never exceeds the bound (it reaches it with ample KV)."""
    rows: list[dict[str, object]] = []
    for s, sess in enumerate(turns):
        for k, (inp, out, delay) in enumerate(sess):
            row: dict[str, object] = {"session_id": s, "turn": k, "input_tokens": inp, "output_tokens": out}
            row |= {"start_s": starts[s]} if k == 0 else {"delay_s": delay}
            if k == 0 and system:
                row |= {"system_prompt_id": 0, "system_prompt_tokens": system}
            rows.append(row)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        wl = load_sessions(write(Path(d) / "r.jsonl", rows))
    res = simulate(wl, CFG, COST, check=True)
    for i in range(len(wl)):
        if wl.turn[i]:
            assert res.arrival[i] == res.step_end[res.finish_step[i - 1]] + wl.delay_s[i]
    assert res.prefix_cache_hit_rate is not None and res.prefix_cache_hit_rate_bound is not None
    assert res.prefix_cache_hit_rate <= res.prefix_cache_hit_rate_bound + 1e-12


@pytest.mark.slow
def test_cpu_tier_keeps_histories_a_small_gpu_cache_evicts() -> None:
    """Sessions whose histories overflow a small GPU cache between turns: the CPU tier brings the hit rate
    at first admission back to the bound, the GPU alone falls short of it."""
    spec = LengthSpec("fixed", 96, 96)
    wl = synthetic_sessions(16, 4.0, LengthSpec("fixed", 3, 3), spec, spec, ThinkSpec("fixed", 2.0), seed=2)
    cost = LinearCostModel(base_s=0.01, per_token_s=1e-4)
    opts = dict(kv_tokens=1024, token_budget=256, max_seqs=8, kv="paged", block_size=16, prefix_caching=True)
    gpu = simulate(wl, legacy_scheduler_config(**opts), cost, check=True)  # type: ignore[arg-type]
    tier = simulate(wl, legacy_scheduler_config(**opts, cpu_kv_tokens=8192), cost, check=True)  # type: ignore[arg-type]
    bound = tier.prefix_cache_hit_rate_bound
    assert bound is not None and gpu.prefix_cache_hit_rate_first_admission is not None
    assert gpu.prefix_cache_hit_rate_first_admission < bound - 0.1
    assert tier.prefix_cache_hit_rate_first_admission == pytest.approx(bound, abs=1e-12)


@pytest.mark.parametrize("command", [["plan", "--slo-ttft", "1s"], ["tune", "--slo-ttft", "1s", "--slo-tpot", "50ms"]])
def test_plan_and_tune_refuse_sessions(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """plan and tune search at an offered request rate, which sessions do not have: exit 2, saying so."""
    assert main([*command, "--synthetic", "sessions", "--linear-cost", "1,1"]) == 2
    assert "sessions have none in advance" in capsys.readouterr().err


def test_cli_cluster_session_affinity(capsys: pytest.CaptureFixture[str]) -> None:
    """`--synthetic sessions` on 2 replicas behind session-affinity: every turn served, the summary per turn."""
    code = main(["simulate", "--synthetic", "sessions", "--num-requests", "6", "--rate", "2", "--turns", "fixed:3",
                 "--prompt-len", "fixed:64", "--output-len", "fixed:16", "--think-time", "uniform:0.5,1",
                 "--system-prompt", "128,2", "--linear-cost", "10,100", "--replicas", "2",
                 "--router", "session-affinity", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["sessions"] == 6 and out["header"]["offered_rate"] is None
    run = out["runs"][0]
    assert run["completed"] == 18 and [t["num_requests"] for t in run["ttft_by_turn"]] == [6, 6, 6]
    assert run["sessions"]["completed"] == 6


def test_cli_table_shows_ttft_by_turn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The terminal table of a session run has a TTFT row per turn and the sessions completed."""
    path = write(tmp_path / "two.jsonl", TWO)
    assert main(["simulate", "--trace", str(path), "--linear-cost", "500,125000", "--kv-tokens", "4096",
                 "--max-num-batched-tokens", "64", "--kv-policy", "paged", "--block-size", "4",
                 "--enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "TTFT mean | p99 (ms), turn 1" in out and "1,187.5 |" in out
    assert "2 sessions starting at 0.1/s" in out and "2 of 2" in out


def test_fields_outside_their_turn_are_ignored(tmp_path: Path) -> None:
    """start_s and the system prompt are read on turn 0 only, delay_s on later turns only; a later turn may
    bring no new tokens (its prompt is its history): 12 + 6 + 0 = 18 tokens."""
    rows = [TWO[0] | {"delay_s": 5.0},
            {"session_id": "a", "turn": 1, "start_s": 99.0, "delay_s": 1.0, "input_tokens": 0, "output_tokens": 2,
             "system_prompt_id": "q", "system_prompt_tokens": 3}]
    wl = load_sessions(write(tmp_path / "f.jsonl", rows))
    assert wl.arrivals == (0.0, 0.0) and wl.delay_s == (0.0, 1.0) and wl.prompt_lens == (12, 18)


def test_front_end_delays_the_next_turn(two: SessionWorkload) -> None:
    """With an engine front end of 0.25 s a turn reaches the engine 0.25 s after its client sends it: a/1
    arrives at 5.125 + 1.0 + 0.25 = 6.375 s (a closed-loop client's think time is lengthened the same way)."""

    class Fronted:
        frontend_s = 0.25

        def step_time(self, plan: object) -> float:
            return COST.step_time(plan)  # type: ignore[arg-type]

    res = simulate(two, CFG, Fronted(), check=True)  # type: ignore[arg-type]
    assert res.arrival[:2] == (0.0, 6.375)
