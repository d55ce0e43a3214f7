"""A CPU KV tier in the server: serve --kv-offloading-size reaches the engine (or is refused before
anything loads), and the Prometheus counters per tier follow EngineStats."""

from __future__ import annotations

import re

import pytest

from stallfree.engine.outputs import EngineStats
from stallfree.server.prometheus import ServerMetrics


def stats(hits: int, cpu: int, loaded: int, offloaded: int) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_will_wait=0, kv_free_tokens=0, kv_total_tokens=1,
                       num_preemptions=0, last_step_tokens=0, prefix_cache_queries=100 + hits,
                       prefix_cache_hits=hits, prefix_cache_cpu_hits=cpu, kv_blocks_loaded=loaded,
                       kv_blocks_offloaded=offloaded)


def value(text: str, name: str, label: str) -> float:
    m = re.search(rf'^{name}_total\{{[^}}]*="{label}"[^}}]*\}} (\S+)$', text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_tier_counters_count_the_increments():
    """Hits 32 (16 from the CPU tier), then 80 (48): GPU 16 + 16, CPU 16 + 32; blocks 1 then 3 loaded."""
    m = ServerMetrics("m")
    m.on_queue_change(stats(32, 16, 1, 5))
    m.on_queue_change(stats(80, 48, 3, 9))
    text = m.render().decode()
    assert value(text, "stallfree_prefix_cache_tier_hits", "gpu") == 32
    assert value(text, "stallfree_prefix_cache_tier_hits", "cpu") == 48
    assert value(text, "stallfree_kv_tier_blocks", "load") == 3
    assert value(text, "stallfree_kv_tier_blocks", "offload") == 9


def test_serve_kv_offloading_size_reaches_the_engine_or_is_refused(monkeypatch, capsys):
    from stallfree import cli
    from stallfree.server import cli as serve_cli

    args = cli.build_parser().parse_args(["serve", "--kv-offloading-size", "0.5"])
    seen = {}
    monkeypatch.setattr("stallfree.engine.LLMEngine.from_pretrained", lambda **kw: seen.update(kw))
    serve_cli.build_engine(args)
    assert seen["kv_offloading_size"] == 0.5 and seen["enable_prefix_caching"] is True
    monkeypatch.setattr(serve_cli, "build_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--no-enable-prefix-caching", "--kv-offloading-size", "1"]) == 2
    assert "--kv-offloading-size keeps prefix-cache blocks" in capsys.readouterr().err
