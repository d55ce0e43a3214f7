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
