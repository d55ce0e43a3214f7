"""vLLM scheduler classes whose step policy is stallfree.core.Scheduler's (docs/vllm.md).

Imports allowed: the standard library, stallfree.core and vLLM 0.33.

What each side does in a step:

- stallfree's core plans it: decodes first (one token each, oldest admitted first, or rotated / by priority
  when they overflow the budget), then the partial prefill(s) under the K/L/T rules, then admission in queue
  order (FCFS, or priority with aging), spending the token budget (docs/DESIGN.md section 1).
- vLLM keeps the blocks: every admission and growth is vLLM's KVCacheManager (get_computed_blocks for the
  prefix-cache hit, allocate_slots for the rest) through stallfree.integrations.vllm.kv.VLLMKV, and a request
  the core preempts goes through vLLM's own `_preempt_request`.
- A request whose KV connector load is asynchronous waits outside the core while its KV arrives: the adapter
  allocates the blocks of its hit in vLLM's KV cache manager, puts it in vLLM's WAITING_FOR_REMOTE_KVS state
  (vLLM's `kv_holding_waiting` queue) and takes it out of the core's queue; when the worker reports the load
  done (`finished_recving`) it goes back to the front of the core's queue with the loaded tokens as KV it
  holds (a prefix hit in its own blocks), so the core's FCFS contract holds for everything it schedules.
- vLLM builds the SchedulerOutput (its NewRequestData, `_make_cached_request_data`, `_update_after_schedule`)
  and handles the model's output (`update_from_output`, unchanged): a stop, an abort or an error vLLM detects
  ends the request in the core (`_free_request`); a request reaching max_tokens ends in both.

The core's complete() runs at the end of schedule(): vLLM itself counts a step's tokens as computed when it
schedules them (`_update_after_schedule`), and both sides then agree on every request's num_computed_tokens.

Source: vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py, Apache-2.0), whose methods these classes call
and whose SchedulerOutput they fill; nothing of it is copied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from vllm.outputs import RequestError
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
from vllm.v1.core.sched.scheduler import KV_FETCH_IN_PROGRESS
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from stallfree.core.errors import InvalidConfig, RequestRejected
from stallfree.core.plan import StepPlan
from stallfree.core.request import Request
from stallfree.core.scheduler import Scheduler as CoreScheduler
from stallfree.integrations.vllm import _compat
from stallfree.integrations.vllm.config import (
    StallfreeOptions,
    core_config,
    core_lora,
    refused_features,
    refused_request_features,
)
from stallfree.integrations.vllm.kv import VLLMKV, Hit

__all__ = ["Scheduler", "SyncScheduler"]

logger = logging.getLogger(__name__)


class SyncScheduler(_VllmScheduler):
    """stallfree's step policy on vLLM's synchronous v1 Scheduler (for vLLM's own tests, and for
    `--no-async-scheduling`); the constructor is vLLM's.

    Attributes:
        stallfree: the stallfree.core.Scheduler that plans every step (paged KV through VLLMKV; its
            num_preemptions, step, num_waiting and num_running are the figures of the policy).
        stallfree_options: the StallfreeOptions read from `additional_config["stallfree"]`.

    Raises:
        InvalidConfig: at construction, a vLLM feature the adapter does not support is on (encoder-decoder,
            pooling or diffusion models, pipeline or context parallelism, the adaptive
            long-prefill threshold; the message names each), or a stallfree option is out of range (named).
            Any KV cache groups are accepted (vLLM's KV cache manager keeps them).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refused = refused_features(self.vllm_config, self.kv_cache_config) + _compat.refused_features(self)
        if refused:
            raise InvalidConfig(
                f"{type(self).__name__} (stallfree's vLLM scheduler) does not support: " + "; ".join(refused)
                + ". Use vLLM's own scheduler for these (no --scheduler-cls)."
            )
        self.stallfree_options = StallfreeOptions.from_additional_config(self.vllm_config.additional_config)
        pool = self.kv_cache_manager.block_pool
        num_blocks = int(pool.get_num_free_blocks())
        self._sf_kv = VLLMKV(self, self.block_size, num_blocks)
        config = core_config(self.vllm_config, self.stallfree_options, num_blocks * self.block_size, self.block_size)
        self.stallfree = CoreScheduler(config, kv_manager=self._sf_kv)
        self._sf_admitted: list[tuple[VllmRequest, bool]] = []
        self._sf_orphans: dict[str, VllmRequest] = {}
        self._sf_stale_victims: list[VllmRequest] = []
        self._sf_time = 0.0
        #: Live requests with multimodal inputs (their chunks are capped by vLLM's encoder rules), and those
        #: waiting for their structured-output grammar (held until it is compiled).
        self._sf_mm: set[str] = set()
        self._sf_fsm: set[str] = set()
        #: The step's encoder compute budget left, and the encoder inputs scheduled per request.
        self._sf_enc_budget = 0
        self._sf_enc_inputs: dict[str, list[int]] = {}
        #: The encoder inputs of the chunk last capped, allocated once its KV is given (VLLMKV calls
        #: _stallfree_chunk_taken): (rid, inputs, external loads, duplicates, the budget left after it).
        self._sf_enc_pending: tuple[str, list[int], list[int], list[int], int] | None = None
        if not self.scheduler_config.enable_chunked_prefill:
            logger.warning("stallfree's scheduler always chunks prompts: --no-enable-chunked-prefill is ignored")
        # Under vLLM's logger, so that the line is in vLLM's log with its handlers and level.
        logging.getLogger("vllm.stallfree").info(
            "stallfree's vLLM scheduler: %s, async_scheduling=%s", type(self).__name__,
            bool(self.scheduler_config.async_scheduling))

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: VllmRequest) -> None:
        """vLLM's add_request, and the request is queued in the core; one with a feature the adapter does not
        support (pooling, streaming input, KV transfer), or that can never fit in the KV cache, is
        finished with an error naming why at the next update_from_output."""
        known = request.request_id in self.requests
        super().add_request(request)
        if known:
            return
        refused = refused_request_features(request)
        if not refused:
            try:
                self._sf_queue(request)
            except RequestRejected as exc:
                refused = [str(exc)]
        if refused:
            self.grammar_compile_error_reqs[request.request_id] = RequestError(
                code="validation_error",
                message="stallfree's vLLM scheduler does not support: " + "; ".join(refused),
            )

    def _sf_queue(self, request: VllmRequest, front: bool = False) -> None:
        """Queue `request` in the core: its known tokens (prompt, plus output before a preemption the core did
        not make) are the prompt the core prefills, up to max_tokens and max_model_len in all; `front`: at the
        head of the queue (FCFS only)."""
        prompt = request.num_tokens
        max_new = min(request.max_tokens - request.num_output_tokens, self.max_model_len - prompt)
        self.stallfree.add(Request(
            request.request_id, prompt, max(max_new, 1), int(request.priority), float(request.arrival_time),
            lora=core_lora(request),
        ), front=front)
        if request.has_encoder_inputs:
            self._sf_mm.add(request.request_id)
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            self._sf_fsm.add(request.request_id)

    def _free_request(self, request: VllmRequest, delay_free_blocks: bool = False) -> Any:
        """vLLM finished the request (a stop, max_tokens, an abort, an error): vLLM frees it, the core forgets it."""
        out = super()._free_request(request, delay_free_blocks)
        self._sf_orphans.pop(request.request_id, None)
        self._sf_forget(request.request_id)
        return out

    def _preempt_request(self, request: VllmRequest, timestamp: float, drop_stale_output: bool = False) -> None:
        """vLLM's preemption. One the core did not decide (vLLM's reset_prefix_cache with running requests, a
        KV-cache release, a caller) also ends the request in the core, which queues it again, with the tokens it
        has by then as its prompt, at the next schedule() once its in-flight output has come back."""
        super()._preempt_request(request, timestamp, drop_stale_output)
        if not self._sf_kv.in_schedule:
            self._sf_forget(request.request_id)
            self._sf_orphans[request.request_id] = request

    def _sf_requeue_orphans(self) -> None:
        for rid, request in list(self._sf_orphans.items()):
            if request.num_stale_output_tokens:
                continue
            del self._sf_orphans[rid]
            if not request.is_finished() and rid in self.requests:
                # In front of the never-started requests, as the core queues its own victims (and vLLM
                # prepends a preempted request); a priority queue orders it by its key.
                self._sf_queue(request, front=self.stallfree.config.policy == "fcfs")

    def _sf_forget(self, rid: str) -> None:
        self._sf_mm.discard(rid)
        self._sf_fsm.discard(rid)
        try:
            self.stallfree.abort(rid)
        except KeyError:  # finished in the core already (max_tokens), or never queued there (refused)
            pass

    # ------------------------------------------------------------------ the KV manager's callbacks

    def _stallfree_admitted(self, request: VllmRequest, num_local: int, num_external: int) -> None:
        """The core admitted a waiting (or preempted) request whose blocks VLLMKV just allocated, `num_local`
        tokens of them cached in vLLM's prefix cache and `num_external` loaded by the KV connector."""
        resumed = request.status == RequestStatus.PREEMPTED
        if request in self.kv_holding_waiting:
            self.kv_holding_waiting.remove_request(request)
        else:
            self.waiting.remove_request(request)
        self.deferred_waiting.discard(request)
        # A request in its own blocks (an asynchronous load that finished) had its hit counted when its load
        # started, as vLLM counts it, and keeps its num_computed_tokens.
        if not request.num_computed_tokens:
            if request.prefill_stats and request.num_preemptions <= 0:
                request.prefill_stats.set(
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_local_cached_tokens=num_local,
                    num_external_cached_tokens=num_external,
                )
            self.kv_cache_manager.record_prefix_cache_stats(request, num_local)
            request.num_computed_tokens = num_local + num_external
        self._set_kv_fetch_stage(request, None)
        _compat.unpark_async_load(self, request)
        self.running.append(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED, self._sf_time)
        request.status = RequestStatus.RUNNING
        self._sf_admitted.append((request, resumed))

    def _stallfree_chunk_taken(self, request: VllmRequest) -> None:
        """VLLMKV gave the KV of a prompt chunk of `request`: the encoder inputs its cap counted are scheduled
        (vLLM's `_allocate_encoder_inputs`) and the step's encoder budget is spent."""
        pending = self._sf_enc_pending
        if pending is None or pending[0] != request.request_id:
            return
        self._sf_enc_pending = None
        rid, inputs, external, duplicates, budget_left = pending
        if inputs:
            self._sf_enc_inputs.setdefault(rid, []).extend(inputs)
            self._sf_enc_budget = budget_left
        self._allocate_encoder_inputs(request, inputs + external, duplicates)

    def _stallfree_encoder_tokens(self, request: VllmRequest) -> int:
        """An encoder-decoder model's encoder tokens for the cross-attention blocks of `request`'s admission:
        those of the encoder inputs its capped first chunk schedules (vLLM's admission); 0 otherwise."""
        pending = self._sf_enc_pending
        if not self.is_encoder_decoder or pending is None or pending[0] != request.request_id:
            return 0
        return sum(request.get_num_encoder_embeds(i) for i in pending[1])

    def _sf_chunk_cap(self, rid: Any, start: int, n: int) -> int:
        """The core's chunk cap (schedule(chunk_cap=...)): the tokens a prompt chunk of `n` tokens from token
        `start` may take under vLLM's own rules. A request whose structured-output grammar is still compiling
        is held (0; vLLM's `_handle_blocked_waiting_request`). Under Mamba's "align" cache mode,
        `_mamba_block_aligned_split` ends the chunk where a Mamba state is cached. Then, for a request with
        multimodal inputs: an encoder input still in transit through the encoder-cache connector holds it
        (0); vLLM's `_try_schedule_encoder_inputs` stops it before an input whose encoder output does not fit
        the step's encoder budget or the encoder cache; `_reserve_prefill_lookahead` keeps a drafter's
        look-ahead out of its end."""
        request = self.requests[rid]
        if rid in self._sf_fsm:
            # vLLM's check of a grammar still compiling (a failed one is finished with its error).
            if not self._handle_blocked_waiting_request(request):
                return 0
            self._sf_fsm.discard(rid)
        if self.need_mamba_block_aligned_split:
            # Before the encoder caps, as vLLM: the chunk ends where a Mamba state is cached.
            # min: with drafts vLLM's split may answer 1 + k for a 1-token chunk (its padding), which the core
            # does not schedule on a prompt.
            n = min(n, self._mamba_block_aligned_split(request, n, start - request.num_computed_tokens))
            if n == 0:
                return 0
        if rid not in self._sf_mm:
            return n
        self._sf_enc_pending = None
        if self._ec_transfer_pending(request, start):
            return 0
        inputs, m, budget_left, external, duplicates = self._try_schedule_encoder_inputs(
            request, start, n, self._sf_enc_budget, shift_computed_tokens=self.num_prefill_lookahead,
        )
        m = self._reserve_prefill_lookahead(request, start, m)
        if m and (inputs or external or duplicates):
            self._sf_enc_pending = (rid, inputs, external, duplicates, budget_left)
        return int(m)

    def _sf_deferred_cap(self, rid: Any, start: int, n: int) -> int:
        """The chunk cap of a step whose prefill vLLM defers (`--prefill-schedule-interval`, throttle_prefills):
        every chunk that computes prompt tokens is held (0); a chunk of only the prompt's last token (a request
        whose KV was all loaded, as on the decode side of a disaggregated deployment) runs, as vLLM lets it:
        it has no prefill compute to defer."""
        return min(n, 1) if start >= self.requests[rid].num_tokens - 1 else 0

    def _stallfree_preempted(self, request: VllmRequest) -> None:
        """The core preempted a running request: vLLM's preemption path (frees its blocks, resets its
        progress, queues it in front)."""
        self.running.remove(request)
        self._preempt_request(request, self._sf_time, drop_stale_output=self.requires_kv_delivery)
        if self.num_spec_tokens and request.num_stale_output_tokens > 0:
            # Its drafts in flight were counted provisionally in the core, and vLLM does not take back a stale
            # step's rejections: the core requeues it with the tokens vLLM has once that output is back.
            self._sf_stale_victims.append(request)

    # ------------------------------------------------------------------ asynchronous KV connector loads

    def _sf_start_loads(self, token_budget: int) -> None:
        """Start the asynchronous KV connector loads at the head of the core's queue, as vLLM's admission loop
        does when it reaches them: while a running slot and some of the step's `token_budget` (tokens) are
        left, and the head is a request without KV whose connector loads its hit asynchronously, allocate the
        blocks of its hit and take it out of the core until its load finishes (`_sf_take_back_loaded`).

        The head is looked at before the core plans the step and again after, so a load behind requests the
        core admits starts in the same step; the first head that is no such load, or whose blocks do not fit
        (vLLM's reservation for the in-flight prefills included), stops it, so the loads start in queue order.
        Nothing starts unless unpaused (vLLM starts none under PAUSED_NEW)."""
        if self.connector is None or self._pause_state != PauseState.UNPAUSED or token_budget <= 0:
            return
        core = self.stallfree
        kv = self._sf_kv
        while len(self.running) < self.max_num_active_reqs:
            head = core.peek_waiting()
            if head is None:
                return
            request = self.requests[head]
            if request.num_computed_tokens or (request.num_stale_output_tokens and not request.drop_stale_output):
                return
            hit = kv.external_hit(request)
            if hit is None or not hit.load_async or not self._sf_start_load(request, hit):
                return

    def _sf_start_load(self, request: VllmRequest, hit: Hit) -> bool:
        """vLLM's admission of an asynchronous load for `request` (its Hit): allocate_slots for the local and
        external hit and no new token, with vLLM's reservation for the in-flight prefills; on success tell the
        connector (now, or after the in-flight steps when vLLM defers async loads), count the hits, set
        WAITING_FOR_REMOTE_KVS and move the request from the core to vLLM's kv_holding_waiting queue.

        Returns:
            False, allocating nothing, when vLLM has too few blocks.
        """
        kvm = self.kv_cache_manager
        connector = self.connector
        rid = request.request_id
        new = kvm.allocate_slots(
            request, 0,
            num_new_computed_tokens=hit.num_local,
            new_computed_blocks=hit.blocks,
            num_lookahead_tokens=0,
            num_external_computed_tokens=hit.num_external,
            delay_cache_blocks=True,
            skip_zeroing_group_ids=connector.get_loaded_kv_cache_group_ids(request),
            full_sequence_must_fit=self.scheduler_reserve_full_isl,
            reserved_blocks=self._inflight_prefill_reserved_blocks() + self._spec_decode_step_blocks,
            has_scheduled_reqs=bool(self.running),
        )
        if new is None:
            return False
        if self.defer_async_loads and self.sched_step_seq > self.processed_step_seq:
            request.last_sched_seq = self.sched_step_seq
            self.deferred_loads[rid] = (self.sched_step_seq, hit.num_external, hit.queries, hit.num_external)
        else:
            connector.update_state_after_alloc(request, kvm.get_blocks(rid), hit.num_external)
            stats = self.connector_prefix_cache_stats
            if stats is not None and hit.queries:
                preempted = request.num_preemptions > 0
                stats.record(
                    num_tokens=hit.queries, num_hits=hit.num_external, preempted=preempted,
                    hits_by_source=(
                        connector.get_external_cache_hit_sources(request, hit.num_external)
                        if not preempted else None
                    ),
                )
        if request.prefill_stats and request.num_preemptions <= 0:
            request.prefill_stats.set(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=hit.num_local,
                num_external_cached_tokens=hit.num_external,
            )
        kvm.record_prefix_cache_stats(request, hit.num_local)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = hit.num_local + hit.num_external
        if self.aux_output_connector is not None:
            self.aux_output_connector.request_loading(request, request.num_computed_tokens)
        _compat.park_async_load(self, request)
        self._set_kv_fetch_stage(request, KV_FETCH_IN_PROGRESS)
        if request not in self.kv_holding_waiting:  # there already after a failed load that kept no token
            self.waiting.remove_request(request)
            self.kv_holding_waiting.add_request(request)
        self.deferred_waiting.add(request)
        self.stallfree.abort(rid)
        return True

    def _sf_take_back_loaded(self) -> None:
        """Requests whose asynchronous load the worker reported finished (`finished_recving`) go back to the
        core, in front of its queue in the order their loads started, with the tokens loaded as KV they hold
        (vLLM's _update_waiting_for_remote_kv caches them and, for a load of the whole prompt, leaves the last
        token to compute; a failed load keeps what was valid, or frees all). A request a caller put in
        WAITING_FOR_REMOTE_KVS while the core had it queued leaves the core until its load finishes."""
        core = self.stallfree
        back: list[VllmRequest] = []
        for request in list(self.kv_holding_waiting):
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            rid = request.request_id
            if rid in core:
                core.abort(rid)
            if rid not in self.finished_recving_kv_req_ids:
                continue
            self._update_waiting_for_remote_kv(request)
            _compat.refresh_parked_load(self, request)
            request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            back.append(request)
        if not back:
            return
        # Each add(front=True) goes to the head: added last to first, they keep the order their loads started.
        fcfs = core.config.policy == "fcfs"
        for request in reversed(back) if fcfs else back:
            self._sf_queue(request, front=fcfs)

    # ------------------------------------------------------------------ the step

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Plan one step with stallfree's core and return vLLM's SchedulerOutput for it.

        Args:
            throttle_prefills: vLLM's data-parallel prefill balancing: when True and the last step that
                admitted prefills was not capacity-bound, a step with running decodes carries no prefill
                (as vLLM's; `--prefill-schedule-interval` holds prefill the same way between bursts).

        Returns:
            The SchedulerOutput of the step: new and resumed requests with their block ids, running ones with
            their new blocks, num_scheduled_tokens in the core's batch order (decodes, then prefill chunks),
            the encoder inputs the chunks need.
        """
        self.current_step += 1
        self._sf_time = time.monotonic()
        self.kv_cache_manager.new_step_starts()
        kv = self._sf_kv
        kv.new_step()
        self._sf_admitted = []
        self._sf_enc_budget = self.max_num_encoder_input_tokens
        self._sf_enc_inputs = {}
        self._sf_enc_pending = None
        if self._sf_orphans:
            self._sf_requeue_orphans()
        plan: StepPlan | None = None
        core = self.stallfree
        defer = self._sf_defer_prefills(throttle_prefills)
        if self._pause_state != PauseState.PAUSED_ALL:
            if self.kv_holding_waiting:
                self._sf_take_back_loaded()
            if not defer:
                self._sf_start_loads(self.max_num_scheduled_tokens)
        if self._pause_state != PauseState.PAUSED_ALL and core.has_unfinished():
            kv.in_schedule = True
            # PAUSED_NEW: running requests go on, and of the waiting only those that hold KV blocks (an
            # asynchronous load that finished) are admitted, as vLLM does: the core's admission filter passes
            # over the others, which keep their places. A deferred prefill: only the decodes run.
            admit: bool | Callable[[Hashable], bool] = True
            num_waiting = core.num_waiting
            if self._pause_state == PauseState.PAUSED_NEW and not defer:
                admit = self._sf_holds_kv
                num_waiting = sum(map(self._sf_holds_kv, core.waiting_order()))
            budget = None
            if self.num_spec_tokens:
                self._sf_set_drafts()
                budget = self._sf_budget_with_draft_slots(num_waiting)
            cap = self._sf_deferred_cap if defer else (
                self._sf_chunk_cap if self._sf_mm or self._sf_fsm or self.need_mamba_block_aligned_split else None)
            try:
                plan = core.schedule(budget, admit=admit, chunk_cap=cap)
            finally:
                kv.in_schedule = False
                self._sf_enc_pending = None
            if not plan.preempted and not defer:
                self._sf_start_loads(self.max_num_scheduled_tokens - plan.num_tokens)
        out = self._sf_output(plan)
        if not defer and self._pause_state != PauseState.PAUSED_ALL:
            self._sf_after_prefills(plan)
        self._update_after_schedule(out)
        if plan is not None:
            core.complete(plan)
            if self._sf_stale_victims:
                for request in self._sf_stale_victims:
                    self._sf_forget(request.request_id)
                    self._sf_orphans[request.request_id] = request
                self._sf_stale_victims = []
        return out

    def _sf_holds_kv(self, rid: Hashable) -> bool:
        """PAUSED_NEW's admission filter: whether waiting request `rid` already holds KV (computed tokens, as
        after an asynchronous load that finished); vLLM admits only those while paused."""
        return bool(self.requests[rid].num_computed_tokens)

    def _sf_set_drafts(self) -> None:
        """Speculative decoding: each running decode's drafts (vLLM's `spec_token_ids`, set by
        update_draft_token_ids, or the async scheduler's placeholders) for the core's next plan."""
        core, reqs = self.stallfree, self.requests
        for rid in self._sf_kv.decodes:
            request = reqs.get(rid)
            if request is not None and request.spec_token_ids:
                core.set_draft_tokens(rid, len(request.spec_token_ids))

    def _sf_budget_with_draft_slots(self, num_waiting: int) -> int | None:
        """With draft slots per scheduled request (vLLM's `max_num_new_slots_for_drafting`: parallel drafting,
        draft models), the step's token budget: max_num_batched_tokens less the slots of every request that may
        run in it (min(max_num_seqs, running + `num_waiting`, the waiting requests the step may admit)), so
        that tokens and slots never exceed vLLM's input budget; None (the configured budget) without slots."""
        spec = self.vllm_config.speculative_config
        slots = int(getattr(spec, "max_num_new_slots_for_drafting", 0) or 0) if spec is not None else 0
        if not slots:
            return None
        core = self.stallfree
        n = min(core.config.max_seqs, core.num_running + num_waiting)
        left = int(self.scheduler_config.max_num_batched_tokens) - slots * n
        return max(1, min(core.config.token_budget, left))

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> Any:
        """vLLM's update_from_output; first, each decode's rejected drafts are taken back in the core (vLLM takes
        them back from the request's num_computed_tokens in the same way), so both count the same tokens."""
        if scheduler_output.scheduled_spec_decode_tokens:
            self._sf_take_back(scheduler_output, model_runner_output)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _sf_take_back(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> None:
        core, reqs = self.stallfree, self.requests
        sampled = model_runner_output.sampled_token_ids
        index = _compat.output_index(model_runner_output)
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            request = reqs.get(rid)
            if not drafts or request is None or request.is_finished() or request.num_stale_output_tokens > 0:
                continue
            try:
                pending = core.unsettled_drafts(rid)
            except KeyError:  # not in the core (finished there, refused, or set up by hand)
                continue
            i = index.get(rid)
            tokens = sampled[i] if sampled and i is not None else []
            if not pending or not tokens:
                continue
            # As vLLM counts them: tokens sampled = 1 + drafts accepted.
            rejected = len(drafts) - max(len(tokens) - self.num_sampled_tokens_per_step, 0)
            core.take_back(rid, min(max(rejected, 0), pending[0]))

    def _sf_defer_prefills(self, throttle_prefills: bool) -> bool:
        """vLLM's two prefill holds (its schedule()): data-parallel balancing (`throttle_prefills`) and the
        local `--prefill-schedule-interval` cadence (executed steps since the last one that carried prefill),
        each only while decodes run and the last releasing step was not capacity-bound."""
        interval = self.local_prefill_interval
        if not throttle_prefills and (interval <= 1 or (self.num_executed_steps + 1) - self.last_prefill_step
                                      >= interval):
            return False
        return not self.prefill_capacity_bound and any(not r.is_prefill_chunk for r in self.running)

    def _sf_after_prefills(self, plan: StepPlan | None) -> None:
        """After a step that could carry prefill: vLLM's capacity-bound flag (requests still waiting) and the
        cadence's last prefill step (a step with a chunk that computes more than a prompt's last token)."""
        self.prefill_capacity_bound = len(self.waiting) + len(self.kv_holding_waiting) > len(self.deferred_waiting)
        if plan is None or self.local_prefill_interval <= 1:
            return
        reqs = self.requests
        admitted = {r.request_id for r, _ in self._sf_admitted}
        if any(
                c.rid not in admitted or c.start < reqs[c.rid].num_tokens - 1 for c in plan.prefills):
            self.last_prefill_step = self.num_executed_steps

    def _sf_output(self, plan: StepPlan | None) -> SchedulerOutput:
        """vLLM's SchedulerOutput for the core's plan (None: an empty step)."""
        reqs: dict[Any, Any] = self.requests
        kvm = self.kv_cache_manager
        num_scheduled: dict[Any, int] = {}
        running: list[VllmRequest] = []
        to_new_blocks: dict[Any, Any] = {}
        new_blocks = self._sf_kv.new_blocks
        empty = kvm.empty_kv_cache_blocks
        admitted = {r.request_id for r, _ in self._sf_admitted}
        spec_tokens: dict[Any, list[int]] = {}
        if plan is not None:
            costs = plan.decode_tokens
            for i, rid in enumerate(plan.decode_rids):
                request = reqs[rid]
                n = num_scheduled[rid] = 1 if costs is None else costs[i]
                if n > 1:
                    spec_tokens[rid] = list(request.spec_token_ids[:n - 1])
                if request.spec_token_ids:
                    request.spec_token_ids = []  # as vLLM: new drafts come with update_draft_token_ids
                running.append(request)
                to_new_blocks[rid] = new_blocks.get(rid, empty)
            for c in plan.prefills:
                rid = c.rid
                num_scheduled[rid] = c.num_tokens
                if rid not in admitted:
                    running.append(reqs[rid])
                    to_new_blocks[rid] = new_blocks.get(rid, empty)
                elif not c.is_last:
                    # vLLM's in-flight prefills: an asynchronous load is admitted only if it fits beside the
                    # blocks these still need (allocate_slots' reserved_blocks).
                    self._inflight_prefills.add(reqs[rid])
        new_reqs = [r for r, resumed in self._sf_admitted if not resumed]
        resumed_reqs = [r for r, resumed in self._sf_admitted if resumed]
        for r in self._sf_admitted:
            to_new_blocks[r[0].request_id] = kvm.get_blocks(r[0].request_id)
        total = sum(num_scheduled.values())
        if total > 0:
            self.num_executed_steps += 1
        new_data, cached = _compat.request_data(
            self, new_reqs, resumed_reqs, running, num_scheduled, spec_tokens, to_new_blocks)
        offloads = kvm.take_boundary_state_offloads()
        block_state = None
        if self.connector is not None:
            # As vLLM: every request scheduled this step may become a connector job (a save lands on the step
            # that fills a block).
            block_ids = set(num_scheduled)
            block_ids.update(rid for rid in offloads if rid in reqs)
            block_state = KVConnectorBlockState(
                req_ids=block_ids, resolve_block_ids=kvm.get_block_ids, boundary_state_offloads=offloads,
            )
        # Speculative decoding, as vLLM: the drafters' K for the next step (dynamic K by batch size), and
        # whether no request scheduled now can use the drafts proposed after this step.
        num_spec = self.num_spec_tokens
        if self.dynamic_sd_lookup is not None and num_scheduled:
            num_spec = self.dynamic_sd_lookup[len(num_scheduled)]
        skip_drafts = self.can_skip_drafts and all(
            self._drafts_unused(reqs[rid], reqs[rid].num_computed_tokens, n) for rid, n in num_scheduled.items()
        )
        # A victim of the step (preempted after its chunk was capped) runs no encoder input.
        encoder_inputs = {rid: ids for rid, ids in self._sf_enc_inputs.items() if rid in num_scheduled}
        copies, retained = kvm.take_kv_cache_block_copies()
        if copies:
            self._free_cow_retained_blocks(retained, self.sched_step_seq + 1)
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec_tokens,
            scheduled_encoder_inputs=encoder_inputs,
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            encoder_input_updates=self._get_encoder_input_updates(num_scheduled, new_data, encoder_inputs),
            new_block_ids_to_zero=self._get_new_block_ids_to_zero(),
            has_sync_kv_loads=self._sf_kv.has_sync_kv_loads,
            kv_cache_block_copies=copies or None,
            kv_connector_block_state=block_state,
            num_spec_tokens_to_schedule=num_spec,
            skip_drafts=skip_drafts,
            **_compat.output_kwargs(self),
        )
        if self.connector is not None:
            out.kv_connector_metadata = self._build_kv_connector_meta(self.connector, out)
        if self.aux_output_connector is not None:
            out.aux_output_connector_metadata = self.aux_output_connector.build_connector_meta(out, reqs)
        if self.ec_connector is not None:
            out.ec_connector_metadata = self.ec_connector.build_connector_meta(out)
        # As vLLM: the block state is the scheduler-side connectors' (its resolver reads the KV cache manager)
        # and never goes to a worker.
        out.kv_connector_block_state = None
        return out




class Scheduler(SyncScheduler, _VllmAsyncScheduler):
    """stallfree's step policy on vLLM's AsyncScheduler: `vllm serve MODEL --scheduler-cls
    stallfree.integrations.vllm.Scheduler` (async scheduling stays on; docs/vllm.md).

    Everything is SyncScheduler's; vLLM's AsyncScheduler adds its output placeholders after each step
    (`_update_after_schedule`), so the next step is planned while this one runs.

    Raises:
        InvalidConfig: as SyncScheduler.
    """
