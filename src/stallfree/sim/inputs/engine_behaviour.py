"""How the engine whose kernel tables price a run schedules: the scheduler defaults a run takes from it.

Imports allowed: the standard library only.

A run priced by an engine's measured kernels (`--kernels vllm[:VERSION]`, the commands' default where the
tables have the GPU) is simulated as that engine schedules by default, so that a bare command is the
engine's behaviour and not only its kernels: asynchronous scheduling, paged KV and prefix caching where
the engine has them on. Only what the user did not give is filled in (flags and Setup fields always win);
a run priced otherwise (`--kernels none`, `--linear-cost`, a GPU without tables, the package missing)
keeps the contract's defaults: synchronous, KV reserved at admission, no caching.

The scheduler's own limits are not engine behaviour here: token budget 2,048 and 256 sequences unless
given (docs/simulator.md says what each engine's `serve` would pick on a GPU and how to ask for it).

`engine_defaults(source)` returns the defaults of one pricing (`cost_model_source` of
stallfree.sim.inputs.pricing.build_priced); `ENGINE_RULES` says in words which engine settings each maps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ASYNC_SCHEDULING_DEFAULT_SINCE",
    "BEHAVIOUR_FIELDS",
    "CONTRACT_FLAGS",
    "ENGINE_RULES",
    "VLLM_ADMISSION_RULE",
    "async_default",
    "behaviour_line",
    "engine_defaults",
]

#: The fields an engine may set, in the order the header names them (SchedulerConfig fields, and
#: async_scheduling, the simulator's ReplicaConfig field).
BEHAVIOUR_FIELDS = ("async_scheduling", "kv_policy", "block_size", "watermark", "enable_prefix_caching")

#: The flags that give the contract's behaviour under any pricing.
CONTRACT_FLAGS = "--kv-policy reserve --no-async-scheduling --no-enable-prefix-caching"

#: The first vLLM release whose default is asynchronous scheduling. vLLM's SchedulerConfig.async_scheduling
#: (`--async-scheduling` / `--no-async-scheduling`) became a tri-state (None = decide) with an
#: "Enable async scheduling unless there is an incompatible option" branch in VllmConfig (vllm/config/vllm.py)
#: that, in the releases before the switch, was not reached (SchedulerConfig.async_scheduling: bool =
#: False, and the branch's note "we won't reach here until async scheduling is enabled by default", as
#: vLLM-Ascend's copy of VllmConfig.__post_init__ quotes it). vLLM pull request
#: 27614 ("Enable async scheduling by default") made None the default; it is ticked in vLLM's async
#: scheduling tracking issue 27679 after pull requests 31332 and 31373 (late December 2025), and
#: vLLM-Gaudi adapted to it on 2025-12-31 (its commit 4520274), so 0.13.0 (December 2025) still
#: defaults off and 0.14.0 (January 2026) is the first release that defaults on. Cross-checked on our
#: data: the RTX 4090 run of data/validation/llmservingsim_vllm (vLLM 0.19.0, engine_kwargs
#: not setting it) resolves scheduler_config.async_scheduling = true. Release months from memory.
#: What it changes (vLLM pull request 19970, vllm/v1/engine/core.py step_with_batch_queue): the
#: scheduler plans step n + 1 while step n runs (a batch queue of depth 2) and processes step n's
#: outputs after that, so a request that arrives, or finds a freed slot, while a step runs is first
#: scheduled in the step after the one already planned: one step later than a synchronous engine
#: would take it. Later tokens are not delayed (one per step either way).
ASYNC_SCHEDULING_DEFAULT_SINCE = (0, 14, 0)

#: vLLM v1's KV admission and preemption, as read in vLLM 0.33.0 and 0.34.0 (vllm/v1/core/sched/scheduler.py,
#: vllm/v1/core/kv_cache_manager.py KVCacheManager.allocate_slots, vllm/config/scheduler.py, Apache-2.0):
#: blocks of `block_size` (16 on CUDA) allocated as tokens are scheduled; `SchedulerConfig.watermark`
#: defaults to 0.0 ("0.0 (the default) disables the watermark"), applied only to waiting or preempted
#: requests while something runs; `scheduler_reserve_full_isl` defaults to True: a new request is
#: admitted only if the blocks of its whole prompt (after prefix-cache hits) are free, not only its first
#: chunk's; a running request that cannot get a block preempts the newest running request
#: (`self.running[-1]` under FCFS) by recompute. Mapped onto the paged policy: paged, 16-token blocks,
#: watermark 0, preemption by recompute of the most recently admitted (the core's rule). Not modelled:
#: the whole-prompt gate (the core admits on the first chunk's blocks, so under KV pressure it admits
#: a long prompt earlier than vLLM and may preempt where vLLM would wait). The versions read are later
#: than the tables' (0.24.0); the rule is taken to hold from the release that made the v1 engine the
#: default on.
VLLM_ADMISSION_RULE = ("vLLM v1: paged KV in 16-token blocks, no watermark (SchedulerConfig.watermark 0.0), "
                       "preemption by recompute of the newest running request; its whole-prompt admission "
                       "gate (scheduler_reserve_full_isl) is not modelled: admission needs the first chunk's "
                       "blocks")

#: Which engine settings each pricing engine's defaults map (docs/simulator.md, "The engine's behaviour").
ENGINE_RULES: Mapping[str, str] = {
    "vllm": "asynchronous scheduling from 0.14.0 (earlier: synchronous); " + VLLM_ADMISSION_RULE
    + "; prefix caching on (CacheConfig.enable_prefix_caching = True)",
    "sglang": "overlap scheduling (on unless --disable-overlap-schedule) as asynchronous scheduling; the radix "
    "cache (on unless --disable-radix-cache) as prefix caching over paged KV in 16-token blocks, watermark 0; "
    "not modelled: SGLang's page size 1 (hits at token, not block, granularity) and its admission by an "
    "estimated new-token ratio",
    "trtllm": "the PyTorch backend's overlap scheduler (on unless disable_overlap_scheduler) as asynchronous "
    "scheduling; its capacity scheduler GUARANTEED_NO_EVICT (each request's whole max tokens reserved at "
    "admission) as KV reserved at admission; not modelled: KV block reuse (enable_block_reuse, on), which "
    "needs paged KV here (--kv-policy paged --enable-prefix-caching models it without the reservation)",
}


def async_default(vllm_version: str) -> tuple[bool, str]:
    """vLLM's default for asynchronous scheduling at `vllm_version` ("0.19.0", "v0.14.1", "0.12.0rc1"),
    and the reason as a line: on from ASYNC_SCHEDULING_DEFAULT_SINCE (0.14.0) on; off before it and
    where no version is given (nothing says the engine scheduled ahead)."""
    nums = tuple(int(n) for n in re.findall(r"\d+", vllm_version or "")[:3])
    if not nums:
        return False, "no vLLM version given: taken as synchronous scheduling"
    on = nums >= ASYNC_SCHEDULING_DEFAULT_SINCE
    since = ".".join(map(str, ASYNC_SCHEDULING_DEFAULT_SINCE))
    return on, f"vLLM {vllm_version}'s default ({'on' if on else 'off'}; on by default since {since})"


#: Each engine's scheduler defaults as (field, value, where it comes from), the engine's name put before the
#: reason. vLLM's asynchronous scheduling depends on its version (async_default) and is added there.
_ENGINE_DEFAULTS: dict[str, tuple[tuple[str, Any, str], ...]] = {
    "vllm": (
        ("kv_policy", "paged", "the v1 engine's paged KV cache"),
        ("block_size", 16, "CacheConfig.block_size on CUDA"),
        ("watermark", 0.0, "SchedulerConfig.watermark 0.0 (none)"),
        ("enable_prefix_caching", True, "CacheConfig.enable_prefix_caching"),
    ),
    "sglang": (
        ("async_scheduling", True, "overlap scheduling (on by default)"),
        ("kv_policy", "paged", "the radix cache's paged KV"),
        ("block_size", 16, "page size 1, modelled in 16-token blocks"),
        ("watermark", 0.0, "no free-block watermark"),
        ("enable_prefix_caching", True, "the radix cache (on by default)"),
    ),
    "trtllm": (
        ("async_scheduling", True, "the PyTorch backend's overlap scheduler"),
        ("kv_policy", "reserve", "capacity scheduler GUARANTEED_NO_EVICT"),
        ("enable_prefix_caching", False, "KV block reuse is not modelled under reservation"),
    ),
}


def engine_defaults(source: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The scheduler defaults of the engine whose kernels priced a run: {field: {"value", "source"}} for
    each field of BEHAVIOUR_FIELDS the engine sets; {} for a run not priced by an engine's kernels or by an
    engine without a table here (`source` is build_priced's cost_model_source: kind "kernels" with engine
    and version)."""
    if source.get("kind") != "kernels":
        return {}
    engine, version = str(source.get("engine") or ""), str(source.get("version") or "")
    name = f"{engine} {version}".strip()
    out: dict[str, dict[str, Any]] = {}
    if engine == "vllm":
        on, why = async_default(version)
        out["async_scheduling"] = {"value": on, "source": why}
    for field, value, why in _ENGINE_DEFAULTS.get(engine, ()):
        out[field] = {"value": value, "source": f"{name}: {why}"}
    return out
    engine, version = str(source.get("engine") or ""), str(source.get("version") or "")
    name = f"{engine} {version}".strip()
    if engine == "vllm":
        on, why = async_default(version)
        return {
            "async_scheduling": {"value": on, "source": why},
            "kv_policy": {"value": "paged", "source": f"{name}: the v1 engine's paged KV cache"},
            "block_size": {"value": 16, "source": f"{name}: CacheConfig.block_size on CUDA"},
            "watermark": {"value": 0.0, "source": f"{name}: SchedulerConfig.watermark 0.0 (none)"},
            "enable_prefix_caching": {"value": True, "source": f"{name}: CacheConfig.enable_prefix_caching"},
        }
    if engine == "sglang":
        return {
            "async_scheduling": {"value": True, "source": f"{name}: overlap scheduling (on by default)"},
            "kv_policy": {"value": "paged", "source": f"{name}: the radix cache's paged KV"},
            "block_size": {"value": 16, "source": f"{name}: page size 1, modelled in 16-token blocks"},
            "watermark": {"value": 0.0, "source": f"{name}: no free-block watermark"},
            "enable_prefix_caching": {"value": True, "source": f"{name}: the radix cache (on by default)"},
        }
    if engine == "trtllm":
        return {
            "async_scheduling": {"value": True, "source": f"{name}: the PyTorch backend's overlap scheduler"},
            "kv_policy": {"value": "reserve", "source": f"{name}: capacity scheduler GUARANTEED_NO_EVICT"},
            "enable_prefix_caching": {"value": False, "source": f"{name}: KV block reuse is not modelled "
                                      "under reservation"},
        }
    return {}


def behaviour_line(resolved: Mapping[str, Any], by_engine: Mapping[str, Mapping[str, Any]],
                   source: Mapping[str, Any]) -> str:
    """The header's words for how the run schedules: the engine's behaviour (which fields it set) or the
    contract's, and the flags that change it. `resolved`: the fields as the run uses them; `by_engine`:
    engine_defaults' fields that the run took (not given by the user); `source`: the pricing's
    cost_model_source."""
    kv = ("paged KV" + (f" in {resolved.get('block_size')}-token blocks" if resolved.get("block_size") else "")
          + (f", watermark {resolved.get('watermark'):g}" if resolved.get("watermark") is not None else "")
          if resolved.get("kv_policy") == "paged" else "KV reserved at admission")
    parts = ["asynchronous scheduling" if resolved.get("async_scheduling") else "synchronous scheduling", kv,
             "prefix caching" if resolved.get("enable_prefix_caching") else "no prefix caching"]
    text = ", ".join(parts)
    if by_engine:
        engine = f"{source.get('engine')} {source.get('version')}"
        named = {"async_scheduling": parts[0], "kv_policy": kv, "enable_prefix_caching": parts[2]}
        taken = [named[f] for f in named if f in by_engine]
        if len(taken) == len(named):
            return f"scheduling as {engine} does by default: {text} (engine defaults; flags override)"
        return (f"scheduling: {text} ({', '.join(taken)} as {engine} does by default; "
                "the rest as given or as the command requires)")
    if source.get("kind") == "kernels":
        return f"scheduling: {text} (as given)"
    return f"scheduling: {text} (no engine's kernel tables price the run: the contract's defaults)"
