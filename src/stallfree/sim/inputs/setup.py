"""What a simulation is run on, built from typed options: the workload, the cost model, the KV
capacity and the scheduler configs. The commands (stallfree.sim.commands) fill these options from
the command line; a Python caller fills them directly.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim.

Example (the default replica on the first 500 requests of the bundled trace)::

    from stallfree.sim.inputs.setup import HardwareOptions, Setup, WorkloadOptions

    setup = Setup(WorkloadOptions(num_requests=500), HardwareOptions())
    config = setup.config("chunked", 2048)       # a ReplicaConfig for simulate()
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from stallfree.core.config import SchedulerConfig
from stallfree.costmodel import CostModelError
from stallfree.costmodel.hardware import get_gpu
from stallfree.costmodel.host_link import KVTransferCost, host_link, kv_offloading_tokens
from stallfree.costmodel.lora import lora_shape
from stallfree.costmodel.model import get_model
from stallfree.costmodel.roofline import CostModel
from stallfree.sim.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_SEQS,
    DEFAULT_RATE_SCALE,
    DEFAULT_TOKEN_BUDGET,
    TIME_BUDGET_CAP,
)
from stallfree.sim.inputs.engine_behaviour import BEHAVIOUR_FIELDS, behaviour_line, engine_defaults
from stallfree.sim.inputs.options import (
    HardwareOptions,
    SetupError,
    WorkloadOptions,
    build_workload,
    scaled_workload,
)
from stallfree.sim.inputs.pricing import build_priced, context_length, option_words
from stallfree.sim.inputs.sessions import SessionWorkload
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig, warn_deprecated
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.lora import DEFAULT_LORA_RANK, LoraCost

__all__ = [
    "DEFAULT_RATE_SCALE",
    "Setup",
    "TIME_BUDGET_CAP",
]


#: The former keyword forms of Setup(...) (deprecated) and the SchedulerConfig field each one sets.
_LEGACY_SETUP = {"max_seqs": "max_seqs", "scheduler": "kv_policy", "block_size": "block_size",
                 "watermark": "watermark", "prefix_caching": "enable_prefix_caching",
                 "max_num_partial_prefills": "max_num_partial_prefills",
                 "max_long_partial_prefills": "max_long_partial_prefills",
                 "long_prefill_token_threshold": "long_prefill_token_threshold", "cpu_kv_tokens": "cpu_kv_tokens"}

#: SchedulerConfig fields that the simulator applies under kv_policy "paged" only (a reservation
#: scheduler in the simulator reserves exact token counts and does not align chunks).
_PAGED_ONLY = ("block_size", "watermark", "enable_prefix_caching", "cpu_kv_tokens")


@dataclass(slots=True, init=False)
class Setup:
    """The workload, the cost model and the KV capacity of a run, and the scheduler config on them.

    Args:
        workload_options: which requests, how fast.
        hardware_options: the replica.
        scheduler: the scheduler's options as stallfree.SchedulerConfig fields by name (token_budget,
            max_seqs, kv_policy, block_size, watermark, enable_prefix_caching, the partial-prefill
            limits, cpu_kv_tokens, ...), or a SchedulerConfig whose fields are taken so. The Setup fills
            in kv_tokens (the replica's KV capacity) and max_model_len (the context length, from which a
            missing long_prefill_token_threshold is 4%) and keeps the result as `scheduler_config`; the
            simulator's defaults apply to what is not given (budget 2,048, 256 sequences, 16-token blocks
            under "paged"). Under "reserve" the block size, watermark, caching and CPU tier do not apply.
            kv_policy, block_size, watermark and enable_prefix_caching left out (or None) take the
            defaults of the engine whose kernel tables price the run (stallfree.sim.inputs.engine_behaviour:
            vLLM >= 0.14.0 pages its KV in 16-token blocks without a watermark and caches prefixes), or
            the contract's under other pricing; `engine_behaviour` records which the engine set.
        kv_offloading_gib: instead of cpu_kv_tokens, the CPU tier's size as vLLM's --kv-offloading-size:
            GiB of host memory summed over the tensor-parallel ranks, converted with the model's KV bytes
            per token; its copies are priced over the GPU's host link (KVTransferCost).
        lora_rank: with max_loras in `scheduler`: the adapters' rank (stallfree.costmodel.lora).
        max_cpu_loras: with max_loras: adapters kept in host memory per replica, >= max_loras; None:
            max_loras (vLLM's default). Steps are priced with LoRA (stallfree.sim.run.lora.LoraCost); a
            workload that names adapters without max_loras in `scheduler` runs on the base model.
        async_scheduling: vLLM's asynchronous scheduling for every run (ReplicaConfig.async_scheduling);
            None: the pricing engine's default (on for vLLM >= 0.14.0, SGLang and TensorRT-LLM; off
            under other pricing). Not modelled under disaggregation (its sides run synchronously).
        **legacy: the former keyword forms (max_seqs, scheduler="paged", block_size, watermark,
            prefix_caching, the partial-prefill limits, cpu_kv_tokens): deprecated, one warning.

    Raises:
        SetupError, TraceError, ValueError: as build_workload and build_cost_model; SetupError for
            prefix caching without the paged scheduler, a CPU tier without caching, two tier sizes.
        InvalidConfig: a scheduler field out of range (named).
    """
    workload_options: WorkloadOptions
    hardware_options: HardwareOptions
    kv_offloading_gib: float | None
    async_scheduling: bool
    engine_behaviour: dict[str, dict[str, Any]]
    scheduler_config: SchedulerConfig
    base_workload: Workload
    rate_scale: float
    workload: Workload
    cost_model: StepCostModel
    kv_tokens: int
    hardware: str
    pricing: dict[str, Any]
    context_length: int | None
    context_length_source: str
    kv_bytes_per_token: int
    lora: dict[str, Any] | None
    #: Seconds a request may wait for admission before it is shed (ReplicaConfig.max_queue_time_s); None.
    max_queue_time_s: float | None
    #: False: the runs keep no per-step or per-request records (simulate(records=False), `--no-records`).
    keep_records: bool

    def __init__(self, workload_options: WorkloadOptions | None = None,
                 hardware_options: HardwareOptions | None = None,
                 scheduler: SchedulerConfig | dict[str, Any] | str | None = None, *,
                 kv_offloading_gib: float | None = None, async_scheduling: bool | None = None,
                 lora_rank: int = DEFAULT_LORA_RANK, max_cpu_loras: int | None = None,
                 **legacy: Any) -> None:
        self.workload_options = workload_options or WorkloadOptions()
        self.hardware_options = hardware_options or HardwareOptions()
        self.max_queue_time_s = None
        self.keep_records = True
        self.kv_offloading_gib = kv_offloading_gib
        if isinstance(scheduler, str):  # the former Setup(scheduler="paged"), the KV policy
            legacy["scheduler"], scheduler = scheduler, None
        opts = dict(scheduler.as_dict() if isinstance(scheduler, SchedulerConfig) else scheduler or {})
        for name, value in legacy.items():
            if name not in _LEGACY_SETUP:
                raise TypeError(f"Setup() got an unexpected keyword argument {name!r}")
            warn_deprecated(f"Setup({name}=...)", "Setup(scheduler={...SchedulerConfig fields...})")
            opts[_LEGACY_SETUP[name]] = value
        opts = {k: v for k, v in opts.items() if v is not None or k not in BEHAVIOUR_FIELDS}
        opts.setdefault("token_budget", DEFAULT_TOKEN_BUDGET)
        opts.setdefault("max_seqs", DEFAULT_MAX_SEQS)
        self.base_workload, self.rate_scale = build_workload(self.workload_options)
        self.workload = scaled_workload(self.base_workload, self.rate_scale, self.workload_options)
        self.cost_model, self.kv_tokens, self.hardware, self.pricing = build_priced(self.hardware_options)
        # What the user left open takes the pricing engine's default (stallfree.sim.inputs.engine_behaviour).
        self.engine_behaviour = self._engine_defaults(opts, async_scheduling)
        paged = opts.get("kv_policy", "reserve") == "paged"
        if paged:
            opts.setdefault("block_size", DEFAULT_BLOCK_SIZE)
        if opts.get("enable_prefix_caching") and not paged:
            raise SetupError("`enable_prefix_caching` needs `kv_policy`='paged' (cached blocks are paged KV blocks)",
                             usage=True)
        if (opts.get("cpu_kv_tokens") or self.kv_offloading_gib) and not opts.get("enable_prefix_caching"):
            name = "kv_offloading_gib" if self.kv_offloading_gib else "cpu_kv_tokens"
            raise SetupError(f"`{name}`: a CPU KV tier keeps prefix-cache blocks: add `enable_prefix_caching` "
                             "(and `kv_policy`='paged')", usage=True)
        if not paged:
            for name in _PAGED_ONLY:
                opts.pop(name, None)
        self.context_length, self.context_length_source = context_length(self.hardware_options)
        self.kv_bytes_per_token = 0
        if opts.get("max_model_len") is None:
            opts["max_model_len"] = self.context_length
        if opts.get("max_num_partial_prefills", 1) > 1 and opts.get("long_prefill_token_threshold") is None \
                and self.context_length is None:
            raise SetupError("`max_num_partial_prefills` > 1 needs `long_prefill_token_threshold` "
                             "(the model's context length is unknown)", usage=True)
        if opts.get("cpu_kv_tokens") or self.kv_offloading_gib:
            opts["cpu_kv_tokens"] = self._add_cpu_tier(opts)
        self.scheduler_config = SchedulerConfig(**{**opts, "kv_tokens": self.kv_tokens})
        if self.scheduler_config.enable_prefix_caching:
            self.check_prefix_block()
        self.lora = None
        if self.scheduler_config.max_loras is not None:
            self._add_lora(self.scheduler_config.max_loras, lora_rank, max_cpu_loras)
        elif max_cpu_loras is not None:
            raise SetupError("`max_cpu_loras` keeps LoRA adapters in host memory: add `max_loras`", usage=True)
        elif self.workload.loras is not None:
            # Adapters without a limit are not modelled: the run is the base model's, and says so.
            self.base_workload = replace(self.base_workload, loras=None)
            self.workload = replace(self.workload, loras=None,
                                    notes=(*self.workload.notes, "LoRA adapters named by the workload are "
                                           "ignored without max_loras (--max-loras)"))

    def _add_lora(self, max_loras: int, rank: int, max_cpu_loras: int | None) -> None:
        """Price steps with LoRA (LoraCost over the cost model): adapter loads over the host link and the
        LoRA GEMMs, for adapters of rank `rank`; record the figures in self.lora."""
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if cpu < max_loras:
            raise SetupError(f"`max_cpu_loras`={cpu} must be >= `max_loras`={max_loras} (adapters in GPU slots "
                             "are kept in host memory too, as vLLM requires)", usage=True)
        if self.workload.loras is None:
            raise SetupError("`max_loras` limits LoRA adapters, but the workload names none: add `loras` N "
                             "(--loras N) or a trace with a `lora` column", usage=True)
        hw = self.hardware_options
        try:
            gpu = get_gpu(hw.gpu)
            shape = lora_shape(get_model(hw.model), gpu, hw.tp, rank)
            link = host_link(gpu)
        except (CostModelError, ValueError) as exc:
            raise SetupError(option_words(exc), usage=True) from None
        self.cost_model = LoraCost(self.cost_model, shape, link, max_loras, cpu)
        self.lora = {"max_loras": max_loras, "max_cpu_loras": cpu, "lora_rank": rank,
                     "max_lora_passes": self.scheduler_config.max_lora_passes,
                     "target_modules": list(shape.modules), "adapter_bytes": shape.bytes_total,
                     "adapter_bytes_per_gpu": shape.bytes_per_gpu}
        self.hardware += (f"; LoRA rank {rank} ({shape.bytes_total / 1e6:,.0f} MB an adapter, "
                          f"{shape.bytes_per_gpu / 1e6:,.0f} MB per GPU), {max_loras} GPU slots, {cpu} in host "
                          f"memory")

    def _engine_defaults(self, opts: dict[str, Any], async_scheduling: bool | None) -> dict[str, dict[str, Any]]:
        """Fill the behaviour fields the caller left open (absent from `opts`, async_scheduling None) with
        the defaults of the engine whose kernels price the run (engine_behaviour.engine_defaults; none
        under other pricing), set self.async_scheduling, and return the fields the engine set as
        {field: {"value", "source"}}. The paged-only fields are taken only where the run pages."""
        source = self.pricing.get("cost_model_source") or {}
        if self.pricing.get("cost_model") == "linear":
            source = {}
        engine = engine_defaults(source)
        taken: dict[str, dict[str, Any]] = {}
        if async_scheduling is None and "async_scheduling" in engine:
            async_scheduling = bool(engine["async_scheduling"]["value"])
            taken["async_scheduling"] = engine["async_scheduling"]
        self.async_scheduling = bool(async_scheduling)
        if "kv_policy" not in opts and "kv_policy" in engine:
            opts["kv_policy"] = engine["kv_policy"]["value"]
            taken["kv_policy"] = engine["kv_policy"]
        paged = opts.get("kv_policy", "reserve") == "paged"
        for name in ("block_size", "watermark", "enable_prefix_caching"):
            if name not in opts and name in engine and (paged or name == "enable_prefix_caching"):
                if name == "enable_prefix_caching" and engine[name]["value"] and not paged:
                    continue
                opts[name] = engine[name]["value"]
                taken[name] = engine[name]
        return taken

    def behaviour(self) -> str:
        """The header's words on how the run schedules (engine_behaviour.behaviour_line)."""
        resolved = {"async_scheduling": self.async_scheduling, **self.scheduler_config.as_dict()}
        if not self.paged:
            resolved["block_size"] = resolved["watermark"] = None
        source = {} if self.pricing.get("cost_model") == "linear" else self.pricing.get("cost_model_source") or {}
        return behaviour_line(resolved, self.engine_behaviour, source)

    @property
    def max_seqs(self) -> int:
        """The scheduler's most running requests (scheduler_config.max_seqs)."""
        return self.scheduler_config.max_seqs

    @property
    def paged(self) -> bool:
        """Whether the scheduler pages its KV (scheduler_config.kv_policy == "paged")."""
        return self.scheduler_config.kv_policy == "paged"

    @property
    def block_size(self) -> int:
        """Tokens per KV block under "paged"; the simulator's default (16) otherwise (shared-prefix blocks)."""
        return self.scheduler_config.block_size or DEFAULT_BLOCK_SIZE

    @property
    def prefix_caching(self) -> bool:
        """scheduler_config.enable_prefix_caching."""
        return self.scheduler_config.enable_prefix_caching

    @property
    def cpu_kv_tokens(self) -> int:
        """scheduler_config.cpu_kv_tokens: the CPU KV tier, tokens (whole blocks; 0: none)."""
        return self.scheduler_config.cpu_kv_tokens

    def with_scheduler(self, **changes: Any) -> Setup:
        """A copy on the same workload and pricing whose scheduler_config has `changes` applied
        (SchedulerConfig fields), e.g. enable_prefix_caching=False for the caching-off side of a comparison.

        Raises:
            InvalidConfig: the result is not a valid configuration.
        """
        new = copy.copy(self)
        new.scheduler_config = self.scheduler_config.replace(**changes)
        return new

    def check_prefix_block(self) -> None:
        """Refuse a `block_size` that does not divide the trace's prefix-id block (Mooncake's 512
        tokens), which prefix caching needs to split each id into KV blocks; a trace without prefix
        ids passes.

        Raises:
            SetupError: the block size does not divide it (usage: a flag at odds with the trace).
        """
        wl = self.base_workload
        if wl.prefix_ids is not None and wl.prefix_block % self.block_size:
            raise SetupError(f"`block_size`={self.block_size} must divide the trace's prefix block of "
                             f"{wl.prefix_block} tokens (its hash_ids; a power of two up to "
                             f"{wl.prefix_block})", usage=True)

    def _add_cpu_tier(self, opts: dict[str, Any]) -> int:
        """Size the CPU KV tier (tokens, or GiB summed over the ranks) and price its copies; its tokens."""
        tokens = int(opts.get("cpu_kv_tokens") or 0)
        if tokens and self.kv_offloading_gib:
            raise SetupError("`cpu_kv_tokens` and `kv_offloading_gib` both size the CPU KV tier: give one",
                             usage=True)
        block_size = int(opts["block_size"])
        opts_hw = self.hardware_options
        try:
            gpu = get_gpu(opts_hw.gpu)
            roof = CostModel(get_model(opts_hw.model), gpu, tp=opts_hw.tp, dtype=opts_hw.dtype,
                             kv_dtype=opts_hw.kv_dtype)
            per_gpu = float(roof.kv_bytes_per_token_per_gpu)
            if self.kv_offloading_gib:
                tokens = kv_offloading_tokens(self.kv_offloading_gib, per_gpu, opts_hw.tp)
            link = host_link(gpu)
        except (CostModelError, ValueError) as exc:
            raise SetupError(option_words(exc), usage=True) from None
        if tokens < block_size:
            raise SetupError(f"the CPU KV tier holds {tokens:,} tokens, not one block of "
                             f"{block_size}: make it larger", usage=True)
        tokens -= tokens % block_size
        self.kv_bytes_per_token = int(per_gpu) * opts_hw.tp
        self.cost_model = KVTransferCost(self.cost_model, link, block_size * per_gpu)
        gib = tokens * self.kv_bytes_per_token / 2**30
        self.hardware += (f"; CPU KV tier {tokens:,} tokens ({gib:,.1f} GiB host memory over "
                          f"{opts_hw.tp} ranks), host link {link.bandwidth_bytes_per_s / 1e9:g} GB/s, "
                          f"{link.latency_s * 1e6:g} us")
        return tokens

    def config(self, batching: str, budget: int) -> ReplicaConfig:
        """The replica config of one run at token budget `budget`: scheduler_config with that budget;
        the baselines (batching other than "chunked") reserve KV, with the same budget, sequences and
        capacity."""
        core = self.scheduler_config.replace(token_budget=budget)
        if batching != "chunked" and self.paged:
            core = core.replace(kv_policy="reserve", **{n: SchedulerConfig.__dataclass_fields__[n].default
                                                       for n in _PAGED_ONLY})
        return ReplicaConfig(core, batching, self.async_scheduling,
                             self.max_queue_time_s if batching == "chunked" else None)

    def header(self) -> dict[str, Any]:
        """Return the facts of the report's header (workload, rate, hardware, capacities, notes)."""
        wl = self.workload
        return {
            "workload": wl.name,
            "requests": len(wl),
            "rate_scale": self.rate_scale,
            "offered_rate": wl.mean_rate,
            "hardware": self.hardware,
            "behaviour": self.behaviour(),
            "engine_behaviour": self.engine_behaviour,
            "async_scheduling": self.async_scheduling,
            "cost_model": self.pricing["cost_model"],
            "cost_model_source": self.pricing["cost_model_source"],
            "engine_profile": self.pricing.get("engine_profile"),
            "kv_tokens": self.kv_tokens,
            "max_seqs": self.max_seqs,
            "max_tokens": self.workload_options.max_tokens,
            "max_model_len": self.context_length,
            "max_model_len_source": self.context_length_source,
            "notes": list(wl.notes) + self._context_notes(),
            "scheduler_config": self.scheduler_config.resolved(),
        } | self._load_header() | self._tier_header() | ({"lora": self.lora} if self.lora else {})

    def _tier_header(self) -> dict[str, Any]:
        """A CPU KV tier: its tokens, the KV bytes per token (all ranks) and the host memory it takes."""
        if not self.cpu_kv_tokens:
            return {}
        return {"cpu_kv_tokens": self.cpu_kv_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "cpu_kv_bytes": self.cpu_kv_tokens * self.kv_bytes_per_token}

    @property
    def closed_loop(self) -> ClosedLoop | None:
        """The run's closed-loop load (WorkloadOptions.closed_loop), or None for open-loop load."""
        return self.workload_options.closed_loop

    @property
    def engine_closed_loop(self) -> ClosedLoop | None:
        """The closed loop as the engine sees it: the clients' think time plus the engine profile's front
        end (a client's next request reaches the engine that much after the last one ended); None for
        open-loop load."""
        closed = self.closed_loop
        frontend = float(getattr(self.cost_model, "frontend_s", 0.0))
        if closed is None or not frontend:
            return closed
        return replace(closed, think_time=closed.think_time + frontend)

    def _load_header(self) -> dict[str, Any]:
        """Closed loop: no offered rate (arrivals follow finishes), the concurrency and think time; sessions:
        no offered rate either, the number of sessions and their start rate (sessions/s)."""
        closed = self.closed_loop
        wl = self.workload
        if isinstance(wl, SessionWorkload):
            # A turn is sent after the last one's answer: the request rate follows the replica, as in a
            # closed loop; what is fixed in advance is the rate of session starts.
            starts = [wl.arrivals[i] for i in range(len(wl)) if wl.turn[i] == 0]
            span = starts[-1] - starts[0]
            return {"offered_rate": None, "sessions": len(starts),
                    "session_rate": (len(starts) - 1) / span if span > 0 else None}
        if closed is None:
            return {}
        return {"offered_rate": None, "concurrency": closed.concurrency, "think_time_s": closed.think_time}

    def _context_notes(self) -> list[str]:
        opts = self.hardware_options
        if opts.max_model_len is None:
            return []
        own, _ = context_length(HardwareOptions(model=opts.model))
        if own is not None and opts.max_model_len > own:
            return [
                f"--max-model-len {opts.max_model_len:,} is above {opts.model}'s context length {own:,} "
                "(a vLLM server refuses that unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set)"
            ]
        return []
