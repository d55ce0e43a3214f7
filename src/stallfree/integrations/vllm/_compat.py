"""Every difference between the vLLM versions the adapter supports (0.33 and 0.34), in one place.

Imports allowed: the standard library and vLLM (0.33 or 0.34). The rest of the adapter calls these functions
wherever the two versions differ, and nothing else branches on the version.

What changed in vLLM 0.34 that the adapter sees (its V1 model runner was removed):

- A preempted request that resumes is sent to the worker in full, as a new request (NewRequestData, whose
  `prefill_token_ids`, every token to prefill, is now required): `Scheduler.use_v2_model_runner`,
  `prev_step_scheduled_req_ids`, `CachedRequestData.resumed_req_ids` and `.all_token_ids` are gone, and
  `_make_cached_request_data` takes no resumed requests (four arguments, not five). In 0.33 the adapter follows
  the model runner vLLM chose (`use_v2_model_runner`), as vLLM's scheduler does.
- `SchedulerOutput.ec_manager_metadata` and `.num_common_prefix_blocks` and `ModelRunnerOutput.req_id_to_index`
  are gone (the output's order is `req_ids`).
- A request's `skip_reading_prefix_cache` no longer bounds the KV connector's hit: `skip_reading_external_kv` does.
- An asynchronous KV load parked for its blocks reserves them through `_reserve_parked` / `_unreserve_parked`
  (0.33: membership of `_inflight_prefills`).
- New scheduler knobs: `--cache-aware-admission-window` (with `--cache-aware-admission-threshold`) reorders the
  waiting queue by cached prefix, and `--max-num-inflight-kv-loads` keeps a queue of its own for asynchronous
  loads. Neither is supported (admission is strictly in queue order, and the adapter starts the loads at the
  head of the core's queue): the scheduler refuses to build with either, naming it (`refused_features`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

__all__ = [
    "V1_RUNNER",
    "model_runner_output",
    "output_index",
    "output_kwargs",
    "park_async_load",
    "refresh_parked_load",
    "refused_features",
    "request_data",
    "skips_external_kv",
    "unpark_async_load",
]

#: vLLM 0.33 (and earlier): a V1 model runner exists, and resumed requests can go as cached ones.
V1_RUNNER: bool = "resumed_req_ids" in getattr(CachedRequestData, "__dataclass_fields__", {})
_EC_MANAGER_METADATA = "ec_manager_metadata" in getattr(SchedulerOutput, "__dataclass_fields__", {})
_REQ_ID_TO_INDEX = "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {})


def request_data(
    sched: Any, new_reqs: list[Any], resumed_reqs: list[Any], running: list[Any],
    num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]], to_new_blocks: dict[str, Any],
) -> tuple[list[Any], Any]:
    """The SchedulerOutput's new and cached request data for a step, as vLLM's own schedule() builds them.

    Args:
        sched: the scheduler (a vLLM Scheduler subclass).
        new_reqs / resumed_reqs: the requests admitted this step, never started / resumed after a preemption.
        running: the running requests scheduled this step (not admitted in it).
        num_scheduled, spec_tokens, to_new_blocks: the step's tokens, drafts and new blocks per request id.

    Returns:
        (scheduled_new_reqs, scheduled_cached_reqs). Resumed requests go as new ones (all their tokens) on
        vLLM 0.34 and on 0.33's V2 model runner; as cached ones on 0.33's V1 model runner, which also records
        the step's request ids (`prev_step_scheduled_req_ids`).
    """
    mrope = sched.model_uses_mrope
    if not V1_RUNNER:
        new_data = [
            NewRequestData.from_request(
                r, to_new_blocks[r.request_id].get_block_ids(), r.prefill_token_ids, uses_mrope=mrope)
            for r in new_reqs + resumed_reqs
        ]
        return new_data, sched._make_cached_request_data(running, num_scheduled, spec_tokens, to_new_blocks)
    if sched.use_v2_model_runner:
        new_data = [
            NewRequestData.from_request(
                r, to_new_blocks[r.request_id].get_block_ids(), r._all_token_ids, uses_mrope=mrope)
            for r in new_reqs + resumed_reqs
        ]
        return new_data, sched._make_cached_request_data(running, [], num_scheduled, spec_tokens, to_new_blocks)
    new_data = [
        NewRequestData.from_request(r, to_new_blocks[r.request_id].get_block_ids(), uses_mrope=mrope)
        for r in new_reqs
    ]
    cached = sched._make_cached_request_data(running, resumed_reqs, num_scheduled, spec_tokens, to_new_blocks)
    sched.prev_step_scheduled_req_ids.clear()
    sched.prev_step_scheduled_req_ids.update(num_scheduled)
    return new_data, cached


def output_kwargs(sched: Any) -> dict[str, Any]:
    """SchedulerOutput fields only one version has: vLLM 0.33's encoder-cache manager metadata."""
    if _EC_MANAGER_METADATA:
        return {"ec_manager_metadata": sched.encoder_cache_manager.get_manager_metadata()}
    return {}


def output_index(model_runner_output: Any) -> dict[str, int]:
    """Request id -> its row in a ModelRunnerOutput (0.34 dropped `req_id_to_index`: rows follow `req_ids`)."""
    index = getattr(model_runner_output, "req_id_to_index", None)
    if index is not None:
        return dict(index)
    return {rid: i for i, rid in enumerate(model_runner_output.req_ids)}


def model_runner_output(req_ids: list[str], sampled: list[list[int]]) -> Any:
    """A ModelRunnerOutput with these rows (for the test harness)."""
    kw: dict[str, Any] = {}
    if _REQ_ID_TO_INDEX:
        kw["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[], **kw,
    )


def skips_external_kv(request: Any) -> bool:
    """Whether the KV connector's hit must not be used for `request` (vLLM 0.34: `skip_reading_external_kv`,
    a bounded prefix-cache hit; 0.33: `skip_reading_prefix_cache`)."""
    if hasattr(request, "skip_reading_external_kv"):
        return bool(request.skip_reading_external_kv)
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def park_async_load(sched: Any, request: Any) -> None:
    """An asynchronous KV load starts for `request`: the blocks it still needs are reserved against further
    loads, as vLLM does when it parks the load."""
    if hasattr(sched, "_reserve_parked"):
        sched._reserve_parked(request)
    else:
        sched._inflight_prefills.add(request)


def refresh_parked_load(sched: Any, request: Any) -> None:
    """A parked load finished (vLLM 0.34 refreshes its reservation when it promotes it; 0.33 has none)."""
    if hasattr(sched, "_reserve_parked"):
        sched._reserve_parked(request)


def unpark_async_load(sched: Any, request: Any) -> None:
    """`request` is admitted: a parked load's reservation becomes an in-flight prefill's, kept until vLLM's
    _update_after_schedule drops it (vLLM 0.34; 0.33 kept it in `_inflight_prefills` all along)."""
    parked = getattr(sched, "_parked_reservations", None)
    if parked is not None and request in parked:
        sched._inflight_prefills.add(request)
        sched._unreserve_parked(request)


def refused_features(sched: Any) -> list[str]:
    """The vLLM 0.34 scheduler knobs in use that the adapter does not support, each named with its flag."""
    out = []
    sc = sched.scheduler_config
    if getattr(sched, "cache_aware_window", 0):
        out.append(
            "cache-aware admission (--cache-aware-admission-window, with --cache-aware-admission-threshold): "
            "admission is strictly in queue order"
        )
    if getattr(sc, "max_num_inflight_kv_loads", None) is not None:
        out.append("--max-num-inflight-kv-loads")
    return out
