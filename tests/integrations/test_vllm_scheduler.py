"""stallfree's scheduler inside vLLM, driven through vLLM's scheduler API with a fake model output (as vLLM's own
scheduler tests drive theirs): its plans are stallfree's own, step for step, on seeded randomized workloads.

These run where vLLM 0.33 or 0.34 is installed with an offline Hugging Face cache of facebook/opt-125m's config
(the environment of benchmarks/vllm_cpu/make_env.sh; benchmarks/vllm_scheduler_tests.py runs them there) and
skip elsewhere, CI included.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.outputs import DraftTokenIds  # noqa: E402

from stallfree.core import InvalidConfig, Request, Scheduler  # noqa: E402
from stallfree.integrations import vllm as sv  # noqa: E402
from stallfree.integrations.vllm import _compat, harness  # noqa: E402
from stallfree.integrations.vllm._version import VLLMVersionError, check_vllm  # noqa: E402
from stallfree.integrations.vllm.config import refused_features  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _model_config_available() -> None:
    try:
        harness.make_scheduler(sv.SyncScheduler, num_blocks=16)
    except Exception as exc:  # no offline model config: not this environment
        pytest.skip(f"cannot build a vLLM config here: {type(exc).__name__}: {str(exc)[:200]}")


def _workload(seed: int) -> tuple[dict, list[tuple[int, str, int, int, int | None, int]]]:
    """A seeded workload: scheduler settings and (arrival step, rid, prompt_len, max_tokens, the output token
    that is EOS or None, priority)."""
    rng = random.Random(seed)
    settings = {
        "max_num_batched_tokens": rng.choice([16, 32, 64, 128, 512]),
        "max_num_seqs": rng.choice([1, 2, 3, 8]),
    }
    reqs = []
    for i in range(rng.randint(4, 12)):
        max_tokens = rng.randint(1, 12)
        stop = rng.randint(1, max_tokens) if rng.random() < 0.3 else None
        reqs.append((rng.randint(0, 20), f"r{i}", rng.randint(1, 200), max_tokens, stop, rng.randint(0, 2)))
    return settings, reqs


def _core_plans(settings: dict, reqs, options: dict) -> list[dict[str, int]]:
    """stallfree.core's own plans for the workload (paged KV with plenty of blocks, no watermark)."""
    s = Scheduler(settings["max_num_batched_tokens"], settings["max_num_seqs"], 10_000 * 16, kv_policy="paged",
                  block_size=16, watermark=0.0, **options)
    stops = {rid: stop for _, rid, _, _, stop, _ in reqs if stop is not None}
    made = {rid: 0 for _, rid, _, _, _, _ in reqs}
    pending = sorted(reqs)
    plans = []
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= len(plans):
            _, rid, p, m, _, prio = pending.pop(0)
            s.add(Request(rid, p, m, priority=prio, arrival=0.0))
        plan = s.schedule()
        stopped = []
        for rid in plan.sampled_rids:
            made[rid] += 1  # type: ignore[index]
            if stops.get(rid) == made[rid]:  # type: ignore[call-overload,index]
                stopped.append(rid)
        s.complete(plan, stopped)
        plans.append({c.rid: c.num_tokens for c in plan})
    return plans


def _adapter_plans(cls: type, settings: dict, reqs, additional: dict | None = None,
                   policy: str = "fcfs") -> list[dict[str, int]]:
    s = harness.make_scheduler(cls, num_blocks=10_000, policy=policy, additional_config=additional,
                               max_model_len=2048, **settings)
    arrivals: dict[int, list] = {}
    for step, rid, p, m, _, prio in sorted(reqs):
        arrivals.setdefault(step, []).append(harness.make_request(rid, p, m, priority=prio, arrival=0.0))
    stops = {rid: stop for _, rid, _, _, stop, _ in reqs if stop is not None}
    records = harness.run_workload(s, arrivals, stops)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10_000 - 1  # every block back
    return [r.tokens for r in records]


@pytest.mark.parametrize("cls", [sv.SyncScheduler, sv.Scheduler], ids=["sync", "async"])
def test_plans_equal_stallfree_core_on_seeded_workloads(cls):
    """8 seeded workloads with plenty of KV, EOS stops included: every step's tokens per request are the core's."""
    for seed in range(8):
        settings, reqs = _workload(seed)
        assert _adapter_plans(cls, settings, reqs) == _core_plans(settings, reqs, {}), f"seed {seed}"


def test_partial_prefills_and_priority_with_aging_equal_stallfree_core():
    """The K/L/T rules and priority with aging, set through additional_config, plan as the core does."""
    for seed in range(4):
        settings, reqs = _workload(100 + seed)
        extra = {"max_num_partial_prefills": 3, "max_long_partial_prefills": 1, "long_prefill_token_threshold": 48}
        got = _adapter_plans(sv.SyncScheduler, settings, reqs, {"stallfree": extra})
        assert got == _core_plans(settings, reqs, extra), f"seed {seed}"
        aging = {"aging_interval": 3}
        got = _adapter_plans(sv.SyncScheduler, settings, reqs, {"stallfree": aging}, policy="priority")
        assert got == _core_plans(settings, reqs, {"policy": "priority", **aging}), f"seed {seed}"


def test_hand_trace_decode_first_then_chunks():
    """The design's hand trace inside vLLM: budget 8, one request decoding, a 20-token prompt arrives: the
    decode runs every step and the prompt gets chunks of 7, 7, 6."""
    s = harness.make_scheduler(sv.SyncScheduler, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    records = harness.run_workload(s, {0: [harness.make_request("d", 4, 6)], 2: [harness.make_request("p", 20, 1)]})
    assert [r.tokens for r in records[:6]] == [
        {"d": 4}, {"d": 1}, {"d": 1, "p": 7}, {"d": 1, "p": 7}, {"d": 1, "p": 6}, {"d": 1},
    ]


def test_preemption_goes_through_vllms_path_and_every_request_completes():
    """A tight KV cache: the core's victims are preempted by vLLM's own path (status, freed blocks,
    preempted_req_ids), the oldest request is never a victim, and every request gets all its tokens."""
    s = harness.make_scheduler(sv.SyncScheduler, max_num_batched_tokens=64, max_num_seqs=4, num_blocks=9,
                               block_size=16, max_model_len=256, scheduler_reserve_full_isl=False)
    reqs = [harness.make_request(f"r{i}", 30, 40) for i in range(4)]
    records = harness.run_workload(s, {0: reqs})
    preempted = [rid for r in records for rid in r.preempted]
    assert preempted and "r0" not in preempted
    assert s.stallfree.stats().num_preemptions == len(preempted)
    assert [len(r.output_token_ids) for r in reqs] == [40, 40, 40, 40]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 8


def test_prefix_cache_hit_starts_the_prefill_after_it():
    """With --enable-prefix-caching, a second request with the same 64-token prompt reuses vLLM's cached
    blocks: its first chunk is the 16 tokens after the 48 cached (capped at prompt - 1, in whole blocks)."""
    s = harness.make_scheduler(sv.SyncScheduler, enable_prefix_caching=True, max_model_len=256)
    ids = list(range(100, 164))
    first = harness.make_request("a", 64, 2, prompt_token_ids=ids)
    records = harness.run_workload(s, {0: [first]})
    assert records[0].tokens == {"a": 64}
    second = harness.make_request("b", 64, 2, prompt_token_ids=ids)
    records = harness.run_workload(s, {0: [second]})
    assert records[0].tokens == {"b": 16}
    assert s.stallfree.stats().prefix_cache_hits == 48


def test_a_request_vllm_stops_ends_in_the_core():
    """An EOS that vLLM detects finishes the request in the core too: it is no longer live there."""
    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    harness.run_workload(s, {0: [harness.make_request("a", 10, 50)]}, stops={"a": 3})
    assert not s.stallfree.has_unfinished()
    assert s.stallfree.num_running == 0


class _Connector:
    """A KV connector stand-in: answers get_num_new_matched_tokens from `answers` in turn and records the
    adapter's calls (the pass-through hooks vLLM's scheduler calls)."""

    requires_kv_delivery = False
    supports_divergent_local_hybrid_hits = False

    def __init__(self, answers):
        self.answers = list(answers)
        self.asked, self.allocated, self.metas = [], [], 0

    def on_new_request(self, request):
        pass

    def get_num_new_matched_tokens(self, request, num_local):
        self.asked.append((request.request_id, num_local))
        return self.answers.pop(0)

    def update_state_after_alloc(self, request, blocks, num_external):
        self.allocated.append((request.request_id, len(blocks.get_block_ids()[0]), num_external))

    def build_connector_meta(self, out):
        self.metas += 1
        return ("meta", self.metas)

    def get_external_cache_hit_sources(self, request, num_hits):
        return None

    def get_loaded_kv_cache_group_ids(self, request):
        return ()

    def update_connector_output(self, output):
        pass

    def request_finished(self, request, block_ids):
        return False, None

    def get_kv_connector_stats(self):
        return None

    def take_events(self):
        return ()

    def has_pending_push_work(self):
        return False

    def has_pending_block_frees(self):
        return False


@pytest.mark.parametrize(
    ("answers", "scheduled", "computed", "external", "sync_load"),
    [
        ([(32, False)], 32, 32, 32, True),  # a synchronous load of 2 blocks: only the 32 tokens after it run
        ([(None, False), (0, False)], 64, 0, 0, False),  # no answer yet: the request waits a step, then runs whole
    ],
)
def test_kv_connector_hooks(answers, scheduled, computed, external, sync_load):
    """With a KV connector, the adapter asks it for the external hit, allocates the blocks of the whole
    64-token prompt (4 blocks of 16), tells it what was allocated and puts its metadata in the output."""
    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    s.connector = conn = _Connector(answers)
    req = harness.make_request("a", 64, 4)
    s.add_request(req)
    out = s.schedule()
    if answers[0][0] is None:
        assert out.total_num_scheduled_tokens == 0 and conn.allocated == []
        assert s.stallfree.num_running == 0
        out = s.schedule()
    assert conn.asked[-1] == ("a", 0)
    assert out.num_scheduled_tokens == {"a": scheduled}
    assert out.scheduled_new_reqs[0].num_computed_tokens == computed
    assert conn.allocated == [("a", 4, external)]
    assert out.has_sync_kv_loads is sync_load
    assert out.kv_connector_metadata == ("meta", conn.metas)
    assert s.stallfree.num_running == 1


def _step(s, finished_recving=(), failed_recving=()):
    """One step of `s` with a fake model output; the KV connector reports the loads in `finished_recving` done,
    those in `failed_recving` failed."""
    from vllm.v1.outputs import KVConnectorOutput

    out = s.schedule()
    result = harness.fake_model_output(out, s.requests)
    result.kv_connector_output = KVConnectorOutput(
        finished_recving=set(finished_recving), failed_recving=set(failed_recving))
    s.update_from_output(out, result)
    return out


@pytest.mark.parametrize("cls", [sv.SyncScheduler, sv.Scheduler], ids=["sync", "async"])
def test_async_kv_load_waits_outside_the_core_and_resumes_from_the_loaded_tokens(cls):
    """A 64-token prompt whose connector loads 32 tokens asynchronously: its 2 blocks are allocated and the
    connector told (32 external tokens), it waits in vLLM's WAITING_FOR_REMOTE_KVS outside the core while the
    40-token request behind it runs; once the load is reported done it is admitted, not asked again, with 32
    tokens computed and the other 32 (4 blocks in all) scheduled."""
    from vllm.v1.request import RequestStatus

    s = harness.make_scheduler(cls, max_model_len=256)
    s.connector = conn = _Connector([(32, True), (0, False)])
    a, b = harness.make_request("a", 64, 4), harness.make_request("b", 40, 4)
    s.add_request(a)
    s.add_request(b)
    out = _step(s)
    assert out.num_scheduled_tokens == {"b": 40}
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and a.num_computed_tokens == 32
    assert list(s.kv_holding_waiting) == [a] and list(s.waiting) == []
    assert conn.allocated == [("a", 2, 32), ("b", 3, 0)]
    assert out.has_sync_kv_loads is False
    assert (s.stallfree.num_waiting, s.stallfree.num_running) == (0, 1)
    out = _step(s, finished_recving={"a"})  # the load lands while b decodes
    assert out.num_scheduled_tokens == {"b": 1}
    out = _step(s)
    assert out.num_scheduled_tokens == {"b": 1, "a": 32}
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("a", 32)]
    assert a.status == RequestStatus.RUNNING and list(s.kv_holding_waiting) == []
    assert [q for q in conn.asked if q[0] == "a"] == [("a", 0)]
    assert conn.allocated[-1] == ("a", 4, 0)
    assert s.stallfree.num_running == 2
    while s.has_unfinished_requests():
        _step(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10_000 - 1


class _ByRid(_Connector):
    """A connector stand-in answering each request's rid from a dict (the same answer every time asked)."""

    def __init__(self, answers):
        super().__init__([])
        self.by_rid = answers

    def get_num_new_matched_tokens(self, request, num_local):
        self.asked.append((request.request_id, num_local))
        return self.by_rid[request.request_id]


@pytest.mark.parametrize("cls", [sv.SyncScheduler, sv.Scheduler], ids=["sync", "async"])
def test_seeded_mix_of_async_loads_completes_in_fcfs_order(cls):
    """6 seeded workloads, a tight KV cache (15 usable blocks of 16), about a third of the requests loading 1-3 blocks
    asynchronously, each load reported done 1-3 steps after it started: every request gets all its tokens,
    every block comes back, a load starts only once every request ahead of it in the queue is admitted or
    loading, and the requests without a load are admitted in the order they were added (the core's FCFS)."""
    from vllm.v1.request import RequestStatus

    for seed in range(6):
        rng = random.Random(seed)
        s = harness.make_scheduler(cls, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                                   max_model_len=256, scheduler_reserve_full_isl=False)
        reqs, answers = [], {}
        for i in range(10):
            rid = f"r{i}"
            prompt = rng.randint(20, 120)
            loads = rng.random() < 0.35 and prompt > 16
            answers[rid] = (16 * rng.randint(1, (prompt - 1) // 16), True) if loads else (0, False)
            reqs.append(harness.make_request(rid, prompt, rng.randint(1, 16)))
        s.connector = _ByRid(answers)
        for r in reqs:
            s.add_request(r)
        due: dict[str, int] = {}
        admitted: list[str] = []
        started: list[str] = []
        for step in range(400):
            if not s.has_unfinished_requests():
                break
            done = {rid for rid, at in due.items() if at <= step}
            for rid in done:
                del due[rid]
            out = _step(s, finished_recving=done)
            admitted += [d.req_id for d in out.scheduled_new_reqs if d.req_id not in admitted]
            for r in reqs:
                rid = r.request_id
                if (r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in due
                        and rid not in s.finished_recving_kv_req_ids):
                    due[rid] = step + rng.randint(1, 3)
                    if rid not in started:
                        started.append(rid)
                        ahead = [q.request_id for q in reqs[: reqs.index(r)]]
                        assert all(q in admitted or q in started for q in ahead), f"seed {seed}: {rid}"
        assert not s.has_unfinished_requests(), f"seed {seed}: not done"
        assert all(r.num_output_tokens == r.max_tokens for r in reqs), f"seed {seed}"
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 16 - 1, f"seed {seed}"
        plain = [rid for rid in admitted if not answers[rid][1]]
        assert plain == sorted(plain, key=lambda rid: int(rid[1:])), f"seed {seed}: {plain}"
        assert sorted(started) == sorted(rid for rid, (n, a) in answers.items() if a), f"seed {seed}"


def test_a_failed_load_that_kept_no_token_is_looked_up_again():
    """A load reported failed with no valid token (vLLM's recompute policy): its 2 blocks are freed and the
    request is looked up again, from the head of the core's queue; the connector now loads it asynchronously
    again (2 blocks, 32 tokens), and once that load lands the other 32 tokens run."""
    from vllm.v1.request import RequestStatus

    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    s.connector = conn = _Connector([(32, True), (32, True)])
    a = harness.make_request("a", 64, 2)
    s.add_request(a)
    _step(s, finished_recving={"a"}, failed_recving={"a"})
    assert a.num_computed_tokens == 0
    out = _step(s)
    assert out.num_scheduled_tokens == {} and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn.allocated == [("a", 2, 32), ("a", 2, 32)] and a.num_computed_tokens == 32
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10_000 - 1 - 2
    _step(s, finished_recving={"a"})
    assert _step(s).num_scheduled_tokens == {"a": 32}


def test_abort_while_loading_frees_the_blocks_and_leaves_nothing_behind():
    """A request aborted while its asynchronous load is in flight: vLLM finishes it and keeps its 2 blocks until
    the worker reports the load finished (it may still be writing them), then frees them; the core, which no
    longer had it, is unaffected, and the request behind it runs."""
    from vllm.v1.request import RequestStatus

    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    s.connector = _Connector([(32, True), (0, False)])
    a, b = harness.make_request("a", 64, 4), harness.make_request("b", 40, 1)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" in s.requests and len(s.kv_cache_manager.get_block_ids("a")[0]) == 2
    out = _step(s, finished_recving={"a"})  # the worker still reports the load it had started
    assert "a" not in out.num_scheduled_tokens and a.status == RequestStatus.FINISHED_ABORTED
    while s.has_unfinished_requests():
        _step(s)
    assert (s.stallfree.num_waiting, s.stallfree.num_running) == (0, 0)
    assert list(s.kv_holding_waiting) == [] and "a" not in s.requests
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10_000 - 1


def test_async_kv_load_fits_beside_the_reservation_of_in_flight_loads():
    """A load is refused while the blocks an in-flight load still needs are reserved (vLLM's reservation). 9
    blocks of 16: a (128 tokens, 4 loaded) takes 4 blocks and reserves 4 more, so b's 4-block load (80
    tokens) does not fit beside it (9 - 4 - 4 = 1 < 4) and b waits in the queue, holding nothing."""
    from vllm.v1.request import RequestStatus

    s = harness.make_scheduler(sv.SyncScheduler, num_blocks=10, max_num_batched_tokens=256, max_model_len=256)
    s.connector = _Connector([(64, True)] * 8)  # b is asked again each step it heads the queue
    a, b = harness.make_request("a", 128, 2), harness.make_request("b", 80, 2)
    s.add_request(a)
    s.add_request(b)
    out = _step(s)
    assert out.total_num_scheduled_tokens == 0
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and b.status == RequestStatus.WAITING
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 9 - 4
    assert s.stallfree.num_waiting == 1  # b, still queued in the core
    out = _step(s, finished_recving={"a"})
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 64}
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0


def test_paused_new_admits_only_finished_loads():
    """Under PAUSED_NEW a request whose load finished is admitted (it holds KV blocks, as vLLM drains them),
    a queued request without KV is not, and no new load starts; unpaused, the queued one's load starts."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.request import RequestStatus

    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    s.connector = _Connector([(32, True), (32, True)])
    a, q = harness.make_request("a", 48, 2), harness.make_request("q", 48, 2)
    s.add_request(a)
    _step(s, finished_recving={"a"})
    s.set_pause_state(PauseState.PAUSED_NEW)
    s.add_request(q)
    assert _step(s).num_scheduled_tokens == {"a": 16}
    assert _step(s).num_scheduled_tokens == {"a": 1}
    assert _step(s).num_scheduled_tokens == {}
    assert q.status == RequestStatus.WAITING and list(s.waiting) == [q]
    s.set_pause_state(PauseState.UNPAUSED)
    s.schedule()
    assert q.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_paused_new_runs_the_running_and_admits_no_new_request():
    """PAUSED_NEW without a connector: the running request decodes, a request added meanwhile waits, in vLLM's
    waiting queue and in the core's, and runs whole once unpaused."""
    from vllm.v1.core.sched.interface import PauseState

    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    s.add_request(harness.make_request("d", 8, 4))
    assert _step(s).num_scheduled_tokens == {"d": 8}
    s.set_pause_state(PauseState.PAUSED_NEW)
    s.add_request(harness.make_request("p", 20, 2))
    assert _step(s).num_scheduled_tokens == {"d": 1}
    assert [r.request_id for r in s.waiting] == ["p"] and s.stallfree.num_waiting == 1
    s.set_pause_state(PauseState.UNPAUSED)
    assert _step(s).num_scheduled_tokens == {"d": 1, "p": 20}


def test_unsupported_features_are_refused_by_name():
    """Each unsupported feature is named in the refusal, with the flag that turns it on; multimodal models,
    encoder-cache connectors, hybrid KV cache groups, a prefill schedule interval and LoRA are not refused."""
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace())
    config = SimpleNamespace(
        speculative_config=object(), lora_config=object(), kv_transfer_config=object(), ec_transfer_config=object(),
        model_config=SimpleNamespace(is_multimodal_model=True, is_encoder_decoder=False, runner_type="generate"),
        scheduler_config=SimpleNamespace(prefill_schedule_interval=4),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2),
    )
    got = refused_features(config, SimpleNamespace(kv_cache_groups=[group, group], has_mamba_layers=True))
    assert got == [
        "pipeline parallelism (--pipeline-parallel-size > 1)",
    ]


def _with_encoder(s, budget: int, cache: int):
    """Give a text model's scheduler an encoder compute budget and an encoder cache of that many embeddings."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    s.max_num_encoder_input_tokens = budget
    s.encoder_cache_manager = EncoderCacheManager(cache_size=cache)
    return s


def test_a_chunk_stops_before_an_image_over_the_encoder_budget():
    """Budget 900 tokens and 900 encoder embeddings: a (1,220 tokens) has images at 10 (600) and 610 (600). Its
    first chunk would be 900 tokens, but only image 0 fits the encoder budget, so it stops at 610, before
    image 1, and keeps the rest of the budget (b waits, the K = 1 contract). Next step image 1 is encoded
    (image 0's output was freed) with a's last 610 tokens, and b's 50 run in the 290 left."""
    s = _with_encoder(harness.make_scheduler(sv.SyncScheduler, max_num_batched_tokens=900, max_model_len=2048),
                      900, 900)
    a = harness.make_request("a", 1220, 1, images=[(10, 600), (610, 600)])
    b = harness.make_request("b", 50, 1)
    s.add_request(a)
    s.add_request(b)
    encoded = []
    tokens = []
    while s.has_unfinished_requests():
        out = s.schedule()
        tokens.append(dict(out.num_scheduled_tokens))
        encoded.append(dict(out.scheduled_encoder_inputs))
        s.update_from_output(out, harness.fake_model_output(out, s.requests))
    assert tokens == [{"a": 610}, {"a": 610, "b": 50}]
    assert encoded == [{"a": [0]}, {"a": [1]}]
    assert s.encoder_cache_manager.num_freeable_slots == 900


def test_an_image_the_encoder_cache_cannot_hold_yet_holds_the_chunk():
    """An encoder cache of 600: a's image (600) is cached while a decodes; b's image (600) at token 20 does not
    fit, so b's first chunk is the 20 tokens before it, and the image runs once a finishes and frees it."""
    s = _with_encoder(harness.make_scheduler(sv.SyncScheduler, max_num_batched_tokens=2048, max_model_len=2048),
                      2048, 600)
    a = harness.make_request("a", 700, 3, images=[(50, 600)])
    s.add_request(a)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 700} and out.scheduled_encoder_inputs == {"a": [0]}
    s.update_from_output(out, harness.fake_model_output(out, s.requests))
    # a's image is freed once its tokens are computed, so it is only freeable: b's image evicts it.
    b = harness.make_request("b", 640, 1, images=[(20, 600)])
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 640} and out.scheduled_encoder_inputs == {"b": [0]}


def test_prefill_schedule_interval_holds_prefill_between_bursts():
    """--prefill-schedule-interval 2: d's prefill is executed step 1; at step 2 (1 step since) p's prefill is
    held and d decodes alone; at step 3 p runs beside d's decode."""
    s = harness.make_scheduler(sv.SyncScheduler, max_num_batched_tokens=64, max_model_len=256,
                               prefill_schedule_interval=2)
    records = harness.run_workload(s, {0: [harness.make_request("d", 4, 6)], 1: [harness.make_request("p", 20, 1)]})
    assert [r.tokens for r in records[:4]] == [{"d": 4}, {"d": 1}, {"d": 1, "p": 20}, {"d": 1}]
    assert s.last_prefill_step == 3


def test_pause_new_admits_nothing_and_running_requests_go_on():
    """PAUSED_NEW: the decode runs, the waiting request is admitted only once unpaused."""
    from vllm.v1.core.sched.interface import PauseState

    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    s.add_request(harness.make_request("d", 4, 6))
    out = s.schedule()
    s.update_from_output(out, harness.fake_model_output(out, s.requests))
    s.add_request(harness.make_request("p", 8, 1))
    s.set_pause_state(PauseState.PAUSED_NEW)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"d": 1}
    s.update_from_output(out, harness.fake_model_output(out, s.requests))
    s.set_pause_state(PauseState.UNPAUSED)
    assert s.schedule().num_scheduled_tokens == {"d": 1, "p": 8}


def test_a_hybrid_model_with_a_sliding_window_group_plans_as_one_group():
    """Two KV cache groups (full attention and a 32-token sliding window) with blocks to spare: the plans of
    seeded workloads are those of one group (vLLM's manager keeps each group's blocks), and every block is
    back in the pool at the end."""
    for seed in range(3):
        settings, reqs = _workload(seed)
        arrivals: dict[int, list] = {}
        plans = []
        for window in (None, 32):
            s = harness.make_scheduler(sv.SyncScheduler, num_blocks=10_000, max_model_len=2048,
                                       sliding_window=window, **settings)
            arrivals = {}
            for step, rid, p, m, _, prio in sorted(reqs):
                arrivals.setdefault(step, []).append(harness.make_request(rid, p, m, priority=prio, arrival=0.0))
            stops = {rid: stop for _, rid, _, _, stop, _ in reqs if stop is not None}
            plans.append([r.tokens for r in harness.run_workload(s, arrivals, stops)])
            assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 10_000 - 1
        assert plans[0] == plans[1], f"seed {seed}"


def test_stallfree_options_from_additional_config():
    """K, L, T and aging reach the core; an unknown key is refused by name and nothing is built."""
    extra = {"max_num_partial_prefills": 4, "max_long_partial_prefills": 2, "long_prefill_token_threshold": 64,
             "decode_overflow": "rotate"}
    s = harness.make_scheduler(sv.SyncScheduler, additional_config={"stallfree": extra}, max_model_len=256)
    core = s.stallfree
    assert (*core.config.partial_prefill_limits, core.config.decode_overflow) == (4, 2, 64, "rotate")
    with pytest.raises(InvalidConfig, match="unknown key.*'aging'"):
        harness.make_scheduler(sv.SyncScheduler, additional_config={"stallfree": {"aging": 3}})


def test_another_vllm_version_is_refused_with_both_versions_named():
    assert check_vllm("0.33.4") == "0.33.4"
    assert check_vllm("0.34.0") == "0.34.0"
    with pytest.raises(VLLMVersionError, match=r"supports vLLM 0\.33\.x and 0\.34\.x, but vLLM 0\.35\.0 is installed"):
        check_vllm("0.35.0")
    with pytest.raises(VLLMVersionError, match=r"vLLM 0\.32\.1 is installed: install 'vllm>=0\.33,<0\.35'"):
        check_vllm("0.32.1")


@pytest.mark.skipif(
    "cache_aware_admission_window" not in getattr(__import__("vllm.config").config.SchedulerConfig,
                                                  "__dataclass_fields__", {}),
    reason="vLLM 0.34's admission knobs")
def test_vllm_034_admission_knobs_are_refused_by_flag():
    """Cache-aware admission reorders the waiting queue and --max-num-inflight-kv-loads gives loads a queue of
    their own: both are refused at build, the flag named; a window vLLM itself ignores (no prefix caching) is
    not."""
    with pytest.raises(InvalidConfig, match="--cache-aware-admission-window"):
        harness.make_scheduler(sv.SyncScheduler, enable_prefix_caching=True,
                               scheduler_kwargs={"cache_aware_admission_window": 8})
    harness.make_scheduler(sv.SyncScheduler, scheduler_kwargs={"cache_aware_admission_window": 8})
    with pytest.raises(InvalidConfig, match="--max-num-inflight-kv-loads"):
        harness.make_scheduler(sv.SyncScheduler, scheduler_kwargs={"max_num_inflight_kv_loads": 2})


def _spec_run(cls: type, seed: int, lag: bool = False) -> tuple[list[tuple[dict, dict]], dict]:
    """A seeded speculative-decoding run: each step a drafter proposes 0 to 3 drafts per decode (never past the
    request's max_tokens, as a drafter that knows it would), and the fake model accepts a seeded share of them.
    `lag`: the async order (step N + 1 is scheduled before step N's output). Returns per step (tokens, drafts
    scheduled) and each request's output length."""
    rng = random.Random(seed)
    s = harness.make_scheduler(cls, num_blocks=10_000, max_num_seqs=rng.choice([2, 4, 8]), max_model_len=2048,
                               num_speculative_tokens=3)
    # Prompts of 2 tokens or more: vLLM pads a 1-token prefill with placeholder drafts, which the core does not.
    reqs = [harness.make_request(f"r{i}", rng.randint(2, 60), rng.randint(1, 20)) for i in range(rng.randint(3, 8))]
    arrive = {r.request_id: rng.randint(0, 6) for r in reqs}
    steps: list[tuple[dict, dict]] = []
    queue: list = []
    step = 0

    def finish(out: Any) -> None:
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = s.requests.get(rid)
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            done = r is not None and (drafts or r.num_computed_tokens >= r.num_tokens)
            # Seeded by (seed, rid, step), so that the two schedulers' batch orders do not matter.
            n = random.Random(f"{seed}-{rid}-{step}-a").randint(0, len(drafts))
            sampled.append([7] * (1 + n) if done else [])
        s.update_from_output(out, _compat.model_runner_output(ids, sampled))
        if not lag:
            ids = [rid for rid in ids if rid in s.requests and not s.requests[rid].is_prefill_chunk]
            proposals = [[5] * min(random.Random(f"{seed}-{rid}-{step}-d").randint(0, 3),
                                   max(0, s.requests[rid].max_tokens - s.requests[rid].num_output_tokens - 1))
                         for rid in ids]
            s.update_draft_token_ids(DraftTokenIds(ids, proposals))

    while any(not r.is_finished() for r in reqs) or queue:
        for r in reqs:
            if arrive[r.request_id] == step:
                s.add_request(r)
        if s.has_unfinished_requests():
            out = s.schedule()
            drafts = {k: len(v) for k, v in out.scheduled_spec_decode_tokens.items()}
            steps.append((dict(out.num_scheduled_tokens), drafts))
            queue.append(out)
            if cls is sv.Scheduler or cls is sv.SyncScheduler:
                core = s.stallfree
                for rid in core._live:
                    st = core.request_state(rid)
                    if st.status.name == "DECODING":  # the core counts vLLM's tokens, drafts included
                        assert core._live[rid].num_computed_tokens == s.requests[rid].num_computed_tokens
        if len(queue) > int(lag) or (queue and not s.has_unfinished_requests()):
            finish(queue.pop(0))
        step += 1
        assert step < 2000
    return steps, {r.request_id: (r.num_output_tokens, r.max_tokens) for r in reqs}


@pytest.mark.parametrize("seed", range(4))
def test_spec_decode_plans_equal_vllms_on_seeded_workloads(seed):
    """With drafts from update_draft_token_ids and an ample budget (where the designs agree: every decode gets
    1 + its drafts), stallfree's plans and scheduled drafts equal vLLM's step for step, rejections included."""
    theirs = _spec_run(VllmScheduler, seed)
    ours = _spec_run(sv.SyncScheduler, seed)
    assert ours == theirs
    assert any(d for _, d in ours[0])  # drafts were scheduled


@pytest.mark.parametrize("seed", range(3))
def test_async_spec_decode_keeps_the_core_in_step_and_ends_every_request(seed):
    """Async scheduling: drafts are vLLM's placeholders and their rejections arrive a step late (take_back after
    the next step was planned); the core's computed tokens equal vLLM's at every step and every request ends
    with exactly its max_tokens tokens."""
    steps, lengths = _spec_run(sv.Scheduler, seed, lag=True)
    assert any(d for _, d in steps)
    assert all(made == want for made, want in lengths.values())


def test_spec_decode_hand_trace():
    """Budget 8, two decodes with 3 drafts each and a 10-token prompt waiting: one token each, then the drafts in
    running order (3, then 3), then the prompt gets the 0 left; the rejected drafts are taken back in both."""
    s = harness.make_scheduler(sv.SyncScheduler, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=256,
                               num_speculative_tokens=3)
    a, b = harness.make_request("a", 2, 20), harness.make_request("b", 2, 20)
    for r in (a, b):
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, harness.fake_model_output(out, s.requests))
    s.add_request(harness.make_request("c", 10, 5))
    s.update_draft_token_ids(DraftTokenIds(["a", "b"], [[5, 5, 5], [5, 5, 5]]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [5, 5, 5], "b": [5, 5, 5]}
    assert s.stallfree.unsettled_drafts("a") == (3,)
    ids = ["a", "b"]
    s.update_from_output(out, _compat.model_runner_output(ids, [[7, 7], [7, 7, 7, 7]]))
    # a: 1 of 3 drafts accepted (2 taken back); b: all 3.
    assert (a.num_computed_tokens, b.num_computed_tokens) == (2 + 2, 2 + 4)
    assert s.stallfree.request_state("a").num_generated == 3 and s.stallfree.request_state("b").num_generated == 5
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}


@pytest.mark.parametrize("cls", [VllmScheduler, sv.SyncScheduler])
def test_draft_slots_come_out_of_the_step_budget(cls, monkeypatch):
    """A drafter with 2 draft slots per scheduled request (as parallel drafting with k = 3): budget 20, two
    10-token prompts. vLLM: a gets min(10, 20 - 2) = 10, leaving 20 - 12 = 8 input slots; b min(10, 8 - 2) = 6.
    stallfree: the step's budget is 20 - 2 x 2 requests that may run = 16: a 10, b 6. (The slots are set on the
    config's property: vLLM 0.33 derives them from `parallel_drafting`, 0.34 from the drafter's own config.)"""
    s = harness.make_scheduler(cls, max_num_batched_tokens=20, max_num_seqs=4, max_model_len=256,
                               num_speculative_tokens=3)
    spec = s.vllm_config.speculative_config
    monkeypatch.setattr(type(spec), "max_num_new_slots_for_drafting", property(lambda self: 2))
    assert spec.max_num_new_slots_for_drafting == 2
    for rid in ("a", "b"):
        s.add_request(harness.make_request(rid, 10, 5))
    assert s.schedule().num_scheduled_tokens == {"a": 10, "b": 6}


def test_a_structured_output_grammar_that_fails_finishes_only_its_request():
    """A request whose grammar does not compile is held (nothing runs in its step), finished with vLLM's
    validation error at the next update_from_output, and the request behind it then runs."""
    from unittest.mock import Mock

    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.request import RequestStatus

    s = harness.make_scheduler(sv.SyncScheduler, max_model_len=256)
    manager = s.structured_output_manager
    manager.backend = Mock()
    manager.backend_name = "xgrammar"
    manager.backend.compile_grammar.side_effect = RuntimeError("no such grammar")
    manager._use_async_grammar_compilation = False
    so = StructuredOutputsParams(json='{"type": "object"}')
    so._backend = "xgrammar"
    params = SamplingParams(max_tokens=4, structured_outputs=so)
    params.update_from_generation_config({}, harness.EOS)
    bad = VllmRequest(request_id="g", prompt_token_ids=[5, 6, 7], sampling_params=params, pooling_params=None)
    manager.grammar_init(bad)
    s.add_request(bad)
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    s.update_from_output(out, _compat.model_runner_output([], []))
    assert bad.status == RequestStatus.FINISHED_ERROR and not s.stallfree.has_unfinished()
    s.add_request(harness.make_request("b", 8, 1))
    assert s.schedule().num_scheduled_tokens == {"b": 8}
