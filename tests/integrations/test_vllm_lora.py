"""LoRA through the vLLM adapter, without vLLM: vLLM's config and requests are read by attribute only
(integrations/vllm/config.py), so fakes of them (SimpleNamespace, as the integration tests' refusal test uses)
drive the mapping: --max-loras into the core's max_loras, lora_request.lora_int_id into Request.lora."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import stallfree
from stallfree.core import Request, Scheduler


def _config_module():
    """integrations/vllm/config.py loaded alone: it imports only the standard library and stallfree.core,
    while the package's __init__ asks for vLLM."""
    path = Path(stallfree.__file__).parent / "integrations" / "vllm" / "config.py"
    spec = importlib.util.spec_from_file_location("stallfree_vllm_config_alone", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


_cfg = _config_module()
StallfreeOptions, core_config, core_lora = _cfg.StallfreeOptions, _cfg.core_config, _cfg.core_lora
refused_features, refused_request_features = _cfg.refused_features, _cfg.refused_request_features


def _vllm_config(lora_config: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_scheduled_tokens=None, max_num_batched_tokens=64,
                                         max_num_active_seqs=None, max_num_seqs=8, policy="fcfs",
                                         long_prefill_token_threshold=0),
        model_config=SimpleNamespace(max_model_len=1024, is_encoder_decoder=False, runner_type="generate"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), lora_config=lora_config)


def test_max_loras_comes_from_vllms_lora_config() -> None:
    """--enable-lora --max-loras 3 gives the core max_loras 3; without LoRA the core has no limit."""
    with_lora = core_config(_vllm_config(SimpleNamespace(max_loras=3, max_lora_rank=16)), StallfreeOptions(),
                            4096, 16)
    assert with_lora.max_loras == 3
    assert core_config(_vllm_config(), StallfreeOptions(), 4096, 16).max_loras is None


def test_lora_is_no_longer_refused() -> None:
    """Neither a LoRA config nor a request with a lora_request is refused."""
    cfg = _vllm_config(SimpleNamespace(max_loras=1))
    assert refused_features(cfg, SimpleNamespace(kv_cache_groups=[])) == []
    req = SimpleNamespace(lora_request=SimpleNamespace(lora_int_id=7, lora_name="sql"), pooling_params=None)
    assert refused_request_features(req) == []


def test_lora_request_maps_to_its_int_id() -> None:
    """A request's adapter is lora_request.lora_int_id (vLLM's own key); no lora_request is the base model."""
    assert core_lora(SimpleNamespace(lora_request=SimpleNamespace(lora_int_id=7))) == 7
    assert core_lora(SimpleNamespace(lora_request=None)) is None
    assert core_lora(SimpleNamespace()) is None


def test_core_built_from_the_vllm_config_runs_at_most_max_loras_per_step() -> None:
    """The core the adapter builds (max_loras 1 from vLLM's config) never puts two adapter ids in one step:
    requests of adapters 1, 2 and the base arrive together; the base joins adapter 1's step, adapter 2 waits."""
    config = core_config(_vllm_config(SimpleNamespace(max_loras=1)), StallfreeOptions(), 4096, 16)
    s = Scheduler(config)
    ids = {"a": 1, "b": 2, "c": None}
    for rid, lora in ids.items():
        s.add(Request(rid, 8, 2, lora=core_lora(SimpleNamespace(lora_request=None if lora is None else
                                                              SimpleNamespace(lora_int_id=lora)))))
    first = s.schedule()
    assert {c.rid for c in first} == {"a", "c"}
    s.complete(first)
    steps = [first]
    while s.has_unfinished():
        plan = s.schedule()
        s.complete(plan)
        steps.append(plan)
    for plan in steps:
        assert len({ids[c.rid] for c in plan} - {None}) <= 1
