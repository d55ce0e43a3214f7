"""Prometheus metrics of the server: latency histograms fed from request timestamps, and engine gauges
and counters sampled after each step; plus the periodic stats log line.

Definitions (docs/DESIGN.md): TTFT = first token time - arrival; ITL = each gap between consecutive tokens
of a request; TPOT = (finish - first token) / (num_generated - 1), only when num_generated > 1;
E2E = finish - arrival. Times are server-side: arrival is when the request reached the HTTP handler,
a token's time is when the step that produced it returned.

Imports allowed: the standard library, prometheus_client, stallfree.engine.outputs (torch-free) and
stallfree.server.async_engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stallfree.engine.outputs import EngineStats
from stallfree.server.async_engine import RequestRecord
from stallfree.server.tenants import MAX_TENANT_LABELS, OTHER_TENANT, tenant_label

__all__ = ["ServerMetrics"]

logger = logging.getLogger("stallfree.server")

# Bucket edges in seconds (upper bounds): from a fast decode step to a long queueing delay.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    """Own a private CollectorRegistry with the stallfree_* metrics; implements StepObserver.

    Args:
        model_name: the value of the model_name label.
        registry: the registry to register in (a new one by default, so that several apps in one
            process, as in tests, do not collide).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("stallfree_time_to_first_token_seconds", "Time to first token (TTFT), seconds.",
                              lab, registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("stallfree_inter_token_latency_seconds",
                             "Gap between consecutive tokens of a request (ITL), seconds.",
                             lab, registry=r, buckets=_ITL_BUCKETS).labels(model_name)
        self.tpot = Histogram("stallfree_time_per_output_token_seconds",
                              "Per-request mean time per output token after the first (TPOT), seconds.",
                              lab, registry=r, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("stallfree_e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             lab, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        self.step_time = Histogram("stallfree_step_duration_seconds", "Wall time of one step, seconds.",
                                   lab, registry=r, buckets=_ITL_BUCKETS).labels(model_name)
        self.tokens_per_step = Histogram("stallfree_tokens_per_step", "Tokens in one step (all kinds).",
                                         lab, registry=r, buckets=_TOKENS_BUCKETS).labels(model_name)
        self.running = Gauge("stallfree_num_requests_running", "Requests admitted and not finished.",
                             lab, registry=r).labels(model_name)
        self.waiting = Gauge("stallfree_num_requests_waiting", "Requests waiting for admission.",
                             lab, registry=r).labels(model_name)
        self.kv_usage = Gauge("stallfree_kv_cache_usage_ratio", "Fraction of the KV cache in use (0..1).",
                              lab, registry=r).labels(model_name)
        self.preemptions = Counter("stallfree_preemptions",
                                   "Running requests preempted (recompute; paged KV only, else 0).",
                                   lab, registry=r).labels(model_name)
        self.prompt_tokens = Counter("stallfree_prompt_tokens", "Prompt tokens prefilled.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = Counter("stallfree_generation_tokens", "Tokens generated.",
                                         lab, registry=r).labels(model_name)
        self._success = Counter("stallfree_request_success",
                                "Requests that ended, by outcome: stop, length, abort (the client left) or "
                                "error (a failed step or a dead engine); each request is counted once.",
                                ["model_name", "finished_reason"], registry=r)
        self.prefix_cache_queries = Counter(
            "stallfree_prefix_cache_queries", "Prefix caching: prompt tokens looked up at admissions (tokens).",
            lab, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter(
            "stallfree_prefix_cache_hits", "Prefix caching: prompt tokens found cached at admissions (tokens).",
            lab, registry=r).labels(model_name)
        self._tier_hits = Counter(
            "stallfree_prefix_cache_tier_hits",
            "Prefix caching: prompt tokens found cached at admissions, by KV tier (gpu; cpu: a CPU KV tier, "
            "--kv-offloading-size) (tokens).", ["model_name", "tier"], registry=r)
        self._kv_blocks = Counter(
            "stallfree_kv_tier_blocks",
            "KV blocks copied between the cache and a CPU KV tier, by direction (load: into the cache; "
            "offload: out of it).", ["model_name", "direction"], registry=r)
        self._tenant_queued = Gauge(
            "stallfree_tenant_queued_tokens",
            "Prompt tokens of a tenant's requests not yet at their first token (waiting or in prefill); at most "
            f"{MAX_TENANT_LABELS} tenant labels, the rest as \"{OTHER_TENANT}\".", ["model_name", "tenant"], registry=r)
        self._tenant_served = Counter(
            "stallfree_tenant_served_tokens",
            "Tokens served to a tenant: prompt tokens at its requests' first token, then generated tokens; at "
            f"most {MAX_TENANT_LABELS} tenant labels, the rest as \"{OTHER_TENANT}\".", ["model_name", "tenant"],
            registry=r)
        self._lora_requests = Counter(
            "stallfree_lora_requests", "Requests that ended, by LoRA adapter and outcome (stop, length, abort, error).",
            ["model_name", "lora", "finished_reason"], registry=r)
        self._lora_active = Gauge(
            "stallfree_lora_requests_active", "Requests of a LoRA adapter added and not ended (waiting or running).",
            ["model_name", "lora"], registry=r)
        self._lora_loads = Counter(
            "stallfree_lora_loads", "Times a LoRA adapter's weights were put on the device (at most --max-loras "
            "are there at once).", ["model_name", "lora"], registry=r)
        self._lora_served = Gauge("stallfree_lora_adapters_served", "LoRA adapters served now.", lab,
                                  registry=r).labels(model_name)
        #: LoRA adapter -> its active requests (the AsyncEngine's count, read at render time); {} when unset.
        self.lora_active: Mapping[str, int] = {}
        #: The served adapters (LoraInfo: name, lora_id, num_loads), read at render time.
        self.lora_adapters: Callable[[], Sequence[Any]] = list
        self._lora_loads_seen: dict[tuple[str, int], int] = {}
        self._tenant_labels: set[str] = set()
        #: tenant -> prompt tokens queued (the AsyncEngine's count, read at render time); {} when unset.
        self.queued_by_tenant: Mapping[str, int] = {}
        self._last_prefix = (0, 0)
        self._last_tier = (0, 0, 0, 0)  # gpu hits, cpu hits, blocks loaded, offloaded
        self._model_name = model_name
        self._last_preemptions = 0
        # Plain totals for the stats log line (read without touching prometheus internals).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage_ratio = 0.0
        self._log_last = (time.perf_counter(), 0, 0)

    def request_success(self, reason: str) -> Any:
        """The stallfree_request_success_total child for one finish reason."""
        return self._success.labels(self._model_name, reason)

    # ------------------------------------------------------------------ StepObserver

    def on_tokens(self, record: RequestRecord, num_new: int, now: float) -> None:
        """Observe TTFT on a request's first token, ITL otherwise; count tokens."""
        if record.first_token_time is None:
            self.ttft.observe(now - record.arrival)
            self.prompt_tokens.inc(record.num_prompt_tokens)
            self.num_prompt_tokens += record.num_prompt_tokens
        else:
            assert record.last_token_time is not None
            self.itl.observe(now - record.last_token_time)
        self.generation_tokens.inc(num_new)
        self.num_generation_tokens += num_new
        first = record.num_prompt_tokens if record.first_token_time is None else 0
        label = tenant_label(record.tenant, self._tenant_labels)
        self._tenant_served.labels(self._model_name, label).inc(first + num_new)

    def on_finish(self, record: RequestRecord) -> None:
        """Count the request's outcome (finished_reason stop, length, abort or error); for a request
        that finished (stop, length), also observe E2E and TPOT (when more than one token)."""
        assert record.finish_time is not None
        reason = record.finish_reason or "stop"
        if reason in ("stop", "length"):
            self.e2e.observe(record.finish_time - record.arrival)
            if record.num_generated > 1 and record.first_token_time is not None:
                self.tpot.observe((record.finish_time - record.first_token_time) / (record.num_generated - 1))
        self.request_success(reason).inc()
        if record.lora is not None:
            self._lora_requests.labels(self._model_name, record.lora, reason).inc()

    def on_step(self, stats: EngineStats, duration_s: float) -> None:
        """Observe the step's duration and tokens; sample the gauges and the preemption counter."""
        self.step_time.observe(duration_s)
        self.tokens_per_step.observe(stats.last_step_tokens)
        self.on_queue_change(stats)

    def on_queue_change(self, stats: EngineStats) -> None:
        """Sample running, waiting, KV usage and preemptions (no step is in flight when called)."""
        self.num_running, self.num_waiting = stats.num_running, stats.num_waiting
        self.kv_usage_ratio = stats.kv_usage
        self.running.set(self.num_running)
        self.waiting.set(self.num_waiting)
        self.kv_usage.set(self.kv_usage_ratio)
        if stats.num_preemptions > self._last_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if queries > self._last_prefix[0]:
            self.prefix_cache_queries.inc(queries - self._last_prefix[0])
            self.prefix_cache_hits.inc(hits - self._last_prefix[1])
            self._last_prefix = (queries, hits)
        cpu = stats.prefix_cache_cpu_hits
        now = (hits - cpu, cpu, stats.kv_blocks_loaded, stats.kv_blocks_offloaded)
        if now != self._last_tier:
            for (name, value), last in zip((("gpu", now[0]), ("cpu", now[1])), self._last_tier[:2], strict=True):
                if value > last:
                    self._tier_hits.labels(self._model_name, name).inc(value - last)
            for (name, value), last in zip((("load", now[2]), ("offload", now[3])), self._last_tier[2:], strict=True):
                if value > last:
                    self._kv_blocks.labels(self._model_name, name).inc(value - last)
            self._last_tier = now

    # ------------------------------------------------------------------ export and log

    def render(self) -> bytes:
        """The registry in the Prometheus text format (the per-tenant queued tokens sampled now)."""
        totals: dict[str, int] = {}
        for tenant, tokens in list(self.queued_by_tenant.items()):
            label = tenant_label(tenant, self._tenant_labels)
            totals[label] = totals.get(label, 0) + tokens
        for label, tokens in totals.items():
            self._tenant_queued.labels(self._model_name, label).set(tokens)
        for lora, n in list(self.lora_active.items()):
            self._lora_active.labels(self._model_name, lora).set(n)
        served = self.lora_adapters()
        self._lora_served.set(len(served))
        for a in served:  # num_loads only grows while an adapter is served; a reload has a new lora_id
            key = (a.name, a.lora_id)
            seen = self._lora_loads_seen.get(key, 0)
            if a.num_loads > seen:
                self._lora_loads.labels(self._model_name, a.name).inc(a.num_loads - seen)
                self._lora_loads_seen[key] = a.num_loads
        return generate_latest(self.registry)

    def stats_line(self, num_pending: int = 0, now: float | None = None) -> str:
        """One log line: running, waiting, KV usage and prompt/generation throughput (tokens/s)
        since the previous call."""
        now = time.perf_counter() if now is None else now
        t0, p0, g0 = self._log_last
        dt = max(now - t0, 1e-9)
        p, g = self.num_prompt_tokens, self.num_generation_tokens
        self._log_last = (now, p, g)
        return (
            f"running {self.num_running} | waiting {self.num_waiting + num_pending} "
            f"| KV usage {100 * self.kv_usage_ratio:.1f}% | prompt {(p - p0) / dt:.1f} tokens/s "
            f"| generation {(g - g0) / dt:.1f} tokens/s"
        )
