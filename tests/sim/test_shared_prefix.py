"""Tests of the shared-prefix synthetic workload: its prompts, its prefix ids and the hits they give, by hand."""

from __future__ import annotations

import pytest

from stallfree.sim.inputs.options import SetupError, WorkloadOptions, build_workload
from stallfree.sim.inputs.synthetic import parse_length_spec, parse_shared_prefix, shared_prefix
from stallfree.sim.run.config import legacy_scheduler_config as SchedulerConfig
from stallfree.sim.run.costs import LinearCostModel
from stallfree.sim.run.simulator import simulate


def _small():
    return shared_prefix(2, 3, 40, 10, parse_length_spec("fixed:5"), rate=1.0, block=16, seed=0)


def test_prompts_and_ids_by_hand():
    """2 groups x 3 prompts of 40 + 10 tokens: blocks 0-1 (tokens 0-31) are the group's, blocks 2-3 the
    request's own (block 2 holds question tokens 40-47; block 3 is partial)."""
    wl = _small()
    assert len(wl) == 6 and tuple(wl.prompt_lens) == (50,) * 6 and tuple(wl.output_lens) == (5,) * 6
    firsts = {row[:2] for row in wl.prefix_ids}
    assert len(firsts) == 2  # one shared pair of ids per group
    owns = [i for row in wl.prefix_ids for i in row[2:]]
    assert len(owns) == len(set(owns)) == 12  # every request's own blocks are unique
    assert sorted(row[:2] for row in wl.prefix_ids).count(min(firsts)) == 3


def test_hits_by_hand():
    """Each group's later two prompts hit its 2 full system blocks: 2 groups x 2 prompts x 32 tokens = 128
    of 6 x 50 = 300 prompt tokens, both as the bound and in a paged simulation with prefix caching."""
    wl = _small()
    assert wl.prefix_hit_bound(16) == pytest.approx(128 / 300)
    res = simulate(wl, SchedulerConfig(10_000, 256, 16, kv="paged", block_size=16, prefix_caching=True),
                   LinearCostModel(1e-3, 1e-5))
    assert res.prefix_cache_hit_rate == pytest.approx(128 / 300)


def test_seeded_and_options():
    """The same seed gives the same workload; the options build it; bad specs name the flag."""
    assert _small() == _small()
    wl, scale = build_workload(WorkloadOptions(synthetic="shared-prefix", shared_prefix="2,3,40,10",
                                               output_len="fixed:5", rate=1.0))
    assert wl.prefix_ids == _small().prefix_ids and scale == 1.0
    assert parse_shared_prefix("4,16,1024,64") == (4, 16, 1024, 64)
    with pytest.raises(ValueError, match="`shared_prefix` wants GROUPS,PROMPTS"):
        parse_shared_prefix("4,16")
    with pytest.raises(SetupError, match="go together"):
        build_workload(WorkloadOptions(synthetic="shared-prefix"))


def test_token_counts_take_vllm_suffixes_and_counts_do_not():
    """--shared-prefix's S and Q and --system-prompt's TOKENS are tokens and take vLLM's suffixes, as every
    token flag does (1k = 1,000, 1K = 1,024); the groups, prompts and COUNT are plain counts. A suffixed
    count that is not a whole number of tokens is refused, quoting the text."""
    from stallfree.sim.inputs.sessions import parse_system_prompt

    assert parse_shared_prefix("4,16,2k,1K") == (4, 16, 2000, 1024)
    assert parse_shared_prefix("4,16,0,64") == (4, 16, 0, 64)
    assert parse_system_prompt("1.5k") == (1500, 1)
    assert parse_system_prompt("2K,3") == (2048, 3)
    for bad in ("2k,16,1024,64", "4,16,1.0005k,64", "4,16,1024,1x"):
        with pytest.raises(ValueError, match=f"`shared_prefix` wants .*got '{bad}'"):
            parse_shared_prefix(bad)
    for bad in ("1.0005k", "1k,2k", "1x"):
        with pytest.raises(ValueError, match=f"`system_prompt` wants TOKENS.*got '{bad}'"):
            parse_system_prompt(bad)


def test_cli_shared_prefix_and_system_prompt_take_suffixes(capsys):
    """`--shared-prefix 2,2,1k,64`: 4 prompts of 1,000 + 64 tokens; `--system-prompt 1K,2`: two 1,024-token
    system prompts (they were refused as not integers)."""
    import json

    from stallfree.cli import main

    base = ["simulate", "--kernels", "none", "--no-range", "--json", "--output-len", "fixed:2"]
    assert main([*base, "--no-records", "--synthetic", "shared-prefix", "--shared-prefix", "2,2,1k,64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"]["workload"].startswith("shared-prefix(groups=2, prompts=2, system=1000, question=64;")
    assert out["runs"][0]["total_input_tokens"] == 4 * 1064
    assert main([*base, "--synthetic", "sessions", "--system-prompt", "1K,2", "--num-requests", "4"]) == 0
    assert "system 1024x2" in json.loads(capsys.readouterr().out)["header"]["workload"]
