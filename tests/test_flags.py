"""One flag vocabulary (stallfree.flags): every command that has a scheduler knob accepts it under the same
name, vLLM's where vLLM has it; the older names still work with one deprecation line; a knob given under
two of its names is a usage error naming both; library errors name config fields and the commands word
them as flags."""

from __future__ import annotations

import argparse
import re

import pytest

from stallfree.cli import build_parser, main
from stallfree.core import InvalidConfig, SchedulerConfig
from stallfree.flags import (
    KNOBS,
    VTC_BURST_TOKENS,
    VTC_CHUNK_TOKENS,
    add_scheduler_flags,
    flag_text,
    scheduler_config,
    scheduler_options,
)

COMMANDS = ("simulate", "sweep", "tune", "plan", "validate", "serve", "generate", "demo")

#: The knobs each command has (flag names as vLLM spells them), read from the command's --help below.
EXPECTED = {
    "simulate": {"--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--enable-prefix-caching",
                 "--max-num-partial-prefills", "--max-long-partial-prefills", "--long-prefill-token-threshold",
                 "--async-scheduling", "--max-model-len", "--gpu-memory-utilization", "--kv-offloading-size",
                 "--kv-policy", "--enable-chunked-prefill", "--kv-tokens", "--cpu-kv-tokens", "--watermark"},
    "sweep": {"--max-num-seqs", "--block-size", "--enable-prefix-caching", "--max-num-partial-prefills",
              "--async-scheduling", "--max-model-len", "--gpu-memory-utilization", "--kv-policy"},
    "tune": {"--max-num-seqs", "--max-num-partial-prefills", "--async-scheduling", "--max-model-len",
             "--gpu-memory-utilization"},
    "plan": {"--max-num-batched-tokens", "--max-num-seqs", "--async-scheduling", "--max-model-len"},
    "validate": {"--max-num-batched-tokens", "--max-num-seqs", "--gpu-memory-utilization", "--kv-policy"},
    "serve": {"--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--enable-prefix-caching",
              "--scheduling-policy", "--max-num-partial-prefills", "--max-long-partial-prefills",
              "--long-prefill-token-threshold", "--max-model-len", "--kv-offloading-size", "--kv-policy",
              "--enable-chunked-prefill", "--kv-tokens"},
    "generate": {"--max-num-batched-tokens", "--max-num-seqs", "--max-num-partial-prefills",
                 "--enable-chunked-prefill", "--kv-tokens"},
    "demo": {"--max-num-batched-tokens"},
}


def _help_flags(command: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", capsys.readouterr().out))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_knobs_by_vllms_names(command, capsys):
    """Each command's --help lists the knobs it has under one vocabulary; no knob appears under a name of
    its own that is not the vocabulary's (the older names are listed only as aliases of the same option)."""
    flags = _help_flags(command, capsys)
    assert EXPECTED[command] <= flags
    vocabulary = {k.flag for k in KNOBS.values()} | {a for k in KNOBS.values() for a in k.aliases}
    for own in ("--token-budget", "--budget", "--max-seqs", "--scheduler", "--prefix-caching"):
        if own in flags and command != "validate":  # validate's --token-budget names its engine run
            assert own in vocabulary


@pytest.mark.parametrize("old, new, value", [
    ("--budget", "--max-num-batched-tokens", "64"), ("--token-budget", "--max-num-batched-tokens", "64"),
    ("--max-seqs", "--max-num-seqs", "8"), ("--scheduler", "--kv-policy", "paged"),
])
def test_old_names_still_work_and_say_what_replaced_them(old, new, value, capsys):
    """An older name parses to the same option, printing one line that names its replacement."""
    parser = build_parser()
    a = parser.parse_args(["simulate", old, value])
    b = parser.parse_args(["simulate", new, value])
    dest = next(k.dest for k in KNOBS.values() if k.flag == new)
    assert vars(a)[dest] == vars(b)[dest] == (int(value) if value.isdigit() else value)
    err = capsys.readouterr().err
    assert err == f"warning: {old} is deprecated and will be removed; use {new}\n"


def test_prefix_caching_alias_turns_the_switch_on(capsys):
    a = build_parser().parse_args(["serve", "--prefix-caching"])
    assert a.enable_prefix_caching is True
    assert "use --enable-prefix-caching" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize("argv, names", [
    (["simulate", "--budget", "64", "--max-num-batched-tokens", "128"], ("--budget", "--max-num-batched-tokens")),
    (["serve", "--max-seqs", "4", "--max-num-seqs", "4"], ("--max-seqs", "--max-num-seqs")),
    (["serve", "--prefix-caching", "--no-enable-prefix-caching"], ("--prefix-caching", "--enable-prefix-caching")),
])
def test_one_option_under_two_names_is_a_usage_error(argv, names, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "set the same option" in err
    for name in names or ():
        assert name in err


def test_a_knob_added_once_reaches_the_config():
    """The walk of one option: a command that registers a knob gets it back as a SchedulerConfig field."""
    p = argparse.ArgumentParser()
    add_scheduler_flags(p, {"token_budget": 512, "max_seqs": 8, "kv_policy": "paged", "block_size": 16,
                            "enable_prefix_caching": False, "async_scheduling": False})
    args = p.parse_args(["--max-num-batched-tokens", "96", "--kv-policy", "paged", "--enable-prefix-caching"])
    cfg = scheduler_config(args, kv_tokens=4096)
    assert cfg == SchedulerConfig(96, 8, 4096, kv_policy="paged", block_size=16, enable_prefix_caching=True)


def test_vtc_turns_tenant_isolation_on_unless_told_otherwise():
    """--fairness vtc: C = VTC_CHUNK_TOKENS and B = VTC_BURST_TOKENS unless given; --tenant-chunk-tokens 0
    turns the cap off; a CPU KV tier (which the cap does not go with) leaves it off; fcfs sets neither."""
    p = argparse.ArgumentParser()
    add_scheduler_flags(p, {"cpu_kv_tokens": None})

    def options(*argv: str) -> dict:
        o = scheduler_options(p.parse_args(list(argv)))
        return {k: o.get(k) for k in ("tenant_chunk_tokens", "tenant_burst_tokens")}

    assert options("--fairness", "vtc") == {"tenant_chunk_tokens": 768, "tenant_burst_tokens": 2048}
    assert (VTC_CHUNK_TOKENS, VTC_BURST_TOKENS) == (768, 2048)
    assert options("--fairness", "vtc", "--tenant-chunk-tokens", "256", "--tenant-burst-tokens", "0") == {
        "tenant_chunk_tokens": 256, "tenant_burst_tokens": 0}
    assert options("--fairness", "vtc", "--tenant-chunk-tokens", "0") == {
        "tenant_chunk_tokens": None, "tenant_burst_tokens": 2048}
    assert options("--fairness", "vtc", "--cpu-kv-tokens", "4096") == {
        "tenant_chunk_tokens": None, "tenant_burst_tokens": 2048}
    assert options() == {"tenant_chunk_tokens": None, "tenant_burst_tokens": None}  # SchedulerConfig's: off
    cfg = SchedulerConfig(64, 8, 4096, **scheduler_options(p.parse_args(["--fairness", "vtc"])))
    assert (cfg.tenant_chunk_tokens, cfg.tenant_burst_tokens) == (768, 2048)


def test_library_errors_name_fields_and_commands_word_them_as_flags():
    with pytest.raises(InvalidConfig, match="token_budget") as exc:
        SchedulerConfig(0, 8, 64)
    assert flag_text(str(exc.value)).startswith("--max-num-batched-tokens")
    assert flag_text("max_long_partial_prefills 3 > max_num_partial_prefills 2") == (
        "--max-long-partial-prefills 3 > --max-num-partial-prefills 2")


def test_out_of_range_config_from_the_command_line_is_a_usage_error(capsys):
    """A value each flag accepts alone but the config refuses together: exit 2, the flags named, nothing run."""
    rc = main(["simulate", "--kv-policy", "paged", "--block-size", "64", "--kv-tokens", "32", "--linear-cost",
               "10,50", "--num-requests", "5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--kv-tokens" in err and "--block-size" in err and "kv_tokens" not in err


def test_core_config_derives_the_threshold_and_the_tier():
    """T defaults to 4% of max_model_len (vLLM's rule) and the CPU tier is a config field."""
    cfg = SchedulerConfig(512, 8, 4096, max_num_partial_prefills=2, max_model_len=10_000)
    assert cfg.partial_prefill_limits == (2, 1, 400)
    with pytest.raises(InvalidConfig, match="long_prefill_token_threshold"):
        SchedulerConfig(512, 8, 4096, max_num_partial_prefills=2)
    tiered = SchedulerConfig(512, 8, 4096, kv_policy="paged", block_size=16, enable_prefix_caching=True,
                             cpu_kv_tokens=100)
    assert tiered.cpu_blocks == 6
    assert type(__import__("stallfree").Scheduler(tiered).kv_manager).__name__ == "TieredKV"


def test_the_walk_of_one_option(monkeypatch):
    """Adding a scheduler option is the config field, the rule that reads it and one Knob line in
    stallfree.flags: with a Knob for the core's existing `decode_overflow` declared `everywhere`, every
    command that builds its scheduler from its flags takes --decode-overflow, and simulate's Setup and
    serve's engine options carry it, with no other file touched."""
    import stallfree.flags as flags
    from stallfree.sim.commands.setup_args import setup_from_args

    knob = flags.Knob("--decode-overflow", "decode_overflow", "which decodes wait when they do not all fit",
                      kind="choice", choices=("oldest", "rotate"), everywhere=True)
    monkeypatch.setattr(flags, "_KNOB_LIST", (*flags._KNOB_LIST, knob))
    monkeypatch.setattr(flags, "KNOBS", {**flags.KNOBS, knob.dest: knob})
    parser = build_parser()
    args = parser.parse_args(["simulate", "--decode-overflow", "rotate", "--linear-cost", "10,50",
                              "--num-requests", "5"])
    assert setup_from_args(args).scheduler_config.decode_overflow == "rotate"
    assert flags.scheduler_options(parser.parse_args(["serve", "--decode-overflow", "rotate"]))[
        "decode_overflow"] == "rotate"
    assert flags.scheduler_options(parser.parse_args(["tune"]))["decode_overflow"] == "oldest"
    with pytest.raises(SystemExit):  # validate's replay and demo build fixed schedulers: not there
        parser.parse_args(["demo", "--decode-overflow", "rotate"])


@pytest.mark.parametrize("text, tokens", [("2M", 2 * 2**20), ("2m", 2_000_000), ("1.5k", 1500), ("32K", 32768),
                                          ("512", 512)])
def test_token_counts_take_vllms_suffixes(text, tokens):
    """k, m, g are decimal and K, M, G binary, as vLLM reads them; on every token knob."""
    a = build_parser().parse_args(["simulate", "--kv-tokens", text, "--max-num-batched-tokens", text])
    assert a.kv_tokens == a.token_budget == tokens


@pytest.mark.parametrize("text", ["1.5K2", "2MB", "0.0001k", "-3", "k"])
def test_bad_token_counts_are_usage_errors(text, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["simulate", "--kv-tokens", text])
    assert exc.value.code == 2
    assert "--kv-tokens" in capsys.readouterr().err


def test_an_absurd_offered_rate_is_refused(capsys):
    """--rate-scale 1e9 on the bundled trace (about 1.85e9 requests/s) is past the stated bound: exit 2, one
    line naming the flag, the rate and the bound, before anything runs."""
    assert main(["simulate", "--rate-scale", "1e9", "--num-requests", "50", "--kernels", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rate-scale 1e+09" in err and "past the bound of 100,000 requests/s" in err


@pytest.mark.parametrize("command", ["simulate", "sweep", "plan"])
def test_a_run_that_served_nothing_exits_4(command, capsys):
    """--kv-tokens 10 rejects every request: the report is printed, then one line saying why, exit 4."""
    extra = {"sweep": ["--budgets", "256", "--batching", "chunked", "--jobs", "1", "--executor", "serial"],
             "plan": ["--slo-ttft", "1s", "--slo-tpot", "50ms", "--max-replicas", "2", "--executor", "serial"],
             }.get(command, [])
    rc = main([command, "--kv-tokens", "10", "--num-requests", "20", "--kernels", "none", *extra])
    assert rc == 4
    err = capsys.readouterr().err
    assert "no run served any request (" in err and "requests rejected" in err  # plan: each cluster's 20


def test_a_kv_cache_smaller_than_one_block_names_only_the_kv_flags(capsys):
    """--kv-tokens 10 under paged KV: exit 2, naming --kv-tokens and --block-size, not the budget the user
    never typed."""
    rc = main(["simulate", "--kv-policy", "paged", "--kv-tokens", "10", "--num-requests", "5", "--kernels", "none"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--kv-tokens (10) must be >= --block-size (16)" in err and "--max-num-batched-tokens" not in err


def test_the_simulator_takes_the_scheduling_policy():
    a = build_parser().parse_args(["simulate", "--scheduling-policy", "priority"])
    assert scheduler_config(a, token_budget=2048, kv_tokens=1000).policy == "priority"
