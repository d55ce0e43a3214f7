"""What a simulation is run on, built from typed options: the workload, the cost model, the KV
capacity and the scheduler configs. The commands (stallfree.sim.commands) fill these options from
the command line; a Python caller fills them directly.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim.

Example (the default replica on the first 500 requests of the bundled trace)::

    from stallfree.sim.setup import HardwareOptions, Setup, WorkloadOptions

    setup = Setup(WorkloadOptions(num_requests=500), HardwareOptions())
    config = setup.config("chunked", 2048)       # a ReplicaConfig for simulate()
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stallfree._files import read_json
from stallfree.core.config import SchedulerConfig
from stallfree.core.errors import StallfreeError
from stallfree.costmodel import CostModelError
from stallfree.costmodel.choice import choose_cost_model
from stallfree.costmodel.hardware import get_gpu
from stallfree.costmodel.host_link import KVTransferCost, host_link, kv_offloading_tokens
from stallfree.costmodel.lora import lora_shape
from stallfree.costmodel.model import get_model
from stallfree.costmodel.names import gpu_match, resolve_model
from stallfree.costmodel.roofline import CostModel
from stallfree.sim.costs import LinearCostModel, StepCostModel
from stallfree.sim.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_SEQS, DEFAULT_RATE_SCALE, DEFAULT_TOKEN_BUDGET
from stallfree.sim.engine_behaviour import BEHAVIOUR_FIELDS, behaviour_line, engine_defaults
from stallfree.sim.engine_profile import EngineProfileError, ProfiledCostModel, default_profile, load_profile
from stallfree.sim.load import ClosedLoop
from stallfree.sim.lora import DEFAULT_LORA_RANK, LoraCost, assign_loras, parse_popularity
from stallfree.sim.sessions import (
    SessionWorkload,
    is_session_trace,
    load_sessions,
    parse_system_prompt,
    parse_think_spec,
    synthetic_sessions,
)
from stallfree.sim.simulator import ReplicaConfig, warn_deprecated
from stallfree.sim.workload import (
    LengthSpec,
    Workload,
    load_bundled,
    load_mooncake,
    load_trace,
    parse_length_spec,
    parse_shared_prefix,
    shared_prefix,
    synthetic,
)

__all__ = [
    "DEFAULTS",
    "DEFAULT_RATE_SCALE",
    "MAX_OFFERED_RATE",
    "MAX_SYNTHETIC_REQUESTS",
    "TIME_BUDGET_CAP",
    "HardwareOptions",
    "SetupError",
    "Setup",
    "WorkloadOptions",
    "build_cost_model",
    "build_priced",
    "build_workload",
    "context_length",
    "default_cost_model",
    "parse_linear_cost",
]


#: The default replica: model, GPU, tensor-parallel GPUs and weight dtype.
DEFAULTS: dict[str, Any] = {"model": "llama-3.3-70b", "gpu": "h100-sxm", "tp": 4, "dtype": "fp8"}

#: The default cap of a step's budget in time budget mode, tokens: far above what a step within a
#: TPOT-sized target holds, so that the target is what limits it.
TIME_BUDGET_CAP = 65536

#: The most requests a synthetic workload draws: each costs a few hundred bytes here and a step or
#: more of simulation, so more would take minutes and GiBs without telling anything new.
MAX_SYNTHETIC_REQUESTS = 5_000_000
#: The most requests per second a run may offer (mean arrival rate, after the rate scale): past any fleet one
#: simulation prices (a large deployment serves thousands per second); beyond it a run is a typo
#: (`--rate-scale 1e9`), whose arrivals collapse into microseconds and whose figures mean nothing.
MAX_OFFERED_RATE = 100_000.0


class SetupError(StallfreeError, ValueError):
    """Options that cannot describe a run (conflicting, out of range, or naming nothing known).

    The message names each option by its field in backticks (`token_budget`, `scheduler`='paged'),
    never by a command-line flag: the commands word those as flags (stallfree.sim.commands.common).

    Attributes:
        usage: True when the options contradict each other or are malformed (a command exits 2),
            False when they are well-formed but name something that does not work (exit 1).
        fields: the fields the message names, in order of first mention.
    """
    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage
        self.fields = tuple(dict.fromkeys(re.findall(r"`(\w+)`", message)))


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """Which requests to replay, and how fast.

    Attributes:
        trace: a trace file (Azure 2023 CSV, BurstGPT CSV, or CSV/JSONL with arrival_time,
            prompt_len, output_len), or None for the bundled Azure conversation trace.
        trace_format: "auto", "azure", "burstgpt", "csv" or "jsonl".
        skip_bad_rows: skip and count malformed rows instead of stopping.
        synthetic: "poisson" or "gamma" to draw synthetic arrivals instead of a trace, or "shared-prefix"
            for the shared-prefix workload (workload.shared_prefix; Poisson arrivals at `rate`).
        shared_prefix: "G,P,S,Q" of the shared-prefix workload: groups, prompts per group, system prompt
            tokens, question tokens; outputs follow `output_len`.
        shared_prefix_block: tokens per prefix block of the shared-prefix workload (the paged scheduler's
            block_size or a multiple of it).
        rate: synthetic mean arrival rate, requests/s.
        burstiness: synthetic gamma shape of the gaps (1 = Poisson).
        prompt_len: synthetic prompt length spec (see workload.parse_length_spec).
        output_len: synthetic output length spec.
        seed: synthetic random seed.
        num_requests: only the first N requests (synthetic: how many to draw, default 1000).
        start: time window start, s of trace time.
        end: time window end, s of trace time.
        rate_scale: replay speed-up, or None for DEFAULT_RATE_SCALE on the bundled trace and 1
            otherwise.
        max_tokens: every request's max_new (its KV reservation), or None for its output length.
        cut_output_to_fit: a request whose prompt plus max_new exceeds the context length gets its
            max_new cut to fit (vLLM's behaviour when a client sets no max_tokens) instead of being
            refused (the default: vLLM's answer, a 400, when the client's max_tokens does not fit).
        concurrency: None for open-loop load (the arrival times above), or closed-loop load: this
            many requests in flight, the next sent when one ends (stallfree.sim.load.ClosedLoop).
            The requests keep their order and lengths (a trace's, or drawn from prompt_len and
            output_len: a length spec other than "trace" draws synthetic lengths without
            `synthetic` set); their arrival times are ignored, so rate_scale must stay None.
        think_time: closed loop: seconds from a request's end to its client's next request, >= 0;
            synthetic sessions: the think time before each later turn, seconds or a distribution
            (stallfree.sim.sessions.parse_think_spec).
        turns: synthetic sessions: turns per session, a length spec.
        system_prompt: synthetic sessions: "TOKENS[,COUNT]" shared system prompts, or None.
        loras: None, or N: each request names one of N LoRA adapters, drawn with `lora_popularity`
            (stallfree.sim.lora.assign_loras; seeded by `seed`), in place of a trace's own `lora` column.
        lora_popularity: "zipf:S": adapter k drawn with probability proportional to 1 / (k + 1)^S.
        peak_ratio, peak_hour: synthetic "diurnal": the busiest rate over the quietest, and its hour
            (stallfree.sim.diurnal; None: its defaults).
        rate_profile: a CSV file `t_s,rate` whose rate, linear between points, the arrivals follow
            (stallfree.sim.diurnal), or None.
    """
    trace: str | None = None
    trace_format: str = "auto"
    skip_bad_rows: bool = False
    synthetic: str | None = None
    rate: float = 5.0
    burstiness: float = 1.0
    prompt_len: str = "trace"
    output_len: str = "trace"
    seed: int = 0
    num_requests: int | None = None
    start: float = 0.0
    end: float = math.inf
    rate_scale: float | None = None
    max_tokens: int | None = None
    cut_output_to_fit: bool = False
    shared_prefix: str | None = None
    shared_prefix_block: int = 16
    concurrency: int | None = None
    think_time: float | str = 0.0
    turns: str = "fixed:4"
    system_prompt: str | None = None
    loras: int | None = None
    lora_popularity: str = "zipf:1"
    peak_ratio: float | None = None
    peak_hour: float | None = None
    rate_profile: str | None = None

    @property
    def closed_loop(self) -> ClosedLoop | None:
        """The closed-loop load of concurrency and think_time, or None for open-loop load.

        Raises:
            SetupError: concurrency or think_time out of range, think_time without concurrency,
                or rate_scale given with concurrency (closed-loop arrivals have no rate to scale).
        """
        if self.concurrency is None:
            if self.think_time and self.synthetic != "sessions":
                raise SetupError(f"think_time {self.think_time!r} s applies to closed-loop load: set concurrency",
                                 usage=True)
            return None
        if self.rate_scale is not None:
            raise SetupError(f"rate_scale {self.rate_scale!r} scales open-loop arrivals; with concurrency "
                             f"{self.concurrency!r} the arrivals follow the finishes: leave rate_scale None",
                             usage=True)
        if self.synthetic == "sessions" or not isinstance(self.think_time, int | float):
            raise SetupError(f"concurrency {self.concurrency!r} is closed-loop load on single requests; sessions "
                             f"and a think_time distribution ({self.think_time!r}) do not go with it", usage=True)
        try:
            return ClosedLoop(self.concurrency, self.think_time)
        except ValueError as exc:
            raise SetupError(str(exc), usage=True) from None


@dataclass(frozen=True, slots=True)
class HardwareOptions:
    """The replica a run is priced on: the cost model and its KV capacity.

    Attributes:
        model: a model preset name or a Hugging Face config.json path.
        gpu: a GPU preset name.
        tp: tensor-parallel GPUs.
        dtype: weight dtype.
        kv_dtype: KV cache dtype, or None for the cost model's.
        ep: expert parallelism of an MoE model (GPUs the routed experts are split over; CostModel's).
        dp_attention: data-parallel attention ranks of an MoE model, each of tp GPUs (CostModel's):
            one scheduler holds the replica's whole batch, priced as ranks in lockstep with the
            sequences split evenly (docs/costmodel.md).
        gpu_memory_utilization: fraction of GPU memory for weights plus KV, in (0, 1].
        kv_tokens: KV capacity override, tokens, or None to derive it.
        linear_cost: "BASE_MS,PER_TOKEN_US[,PER_CTX_NS]" to price steps linearly instead.
        max_model_len: the context length override, tokens (vLLM's --max-model-len), or None for
            the model's own.
        kernels: what prices the steps: 'none' (today's pricing: calibrated where the GPU has a
            calibration, else the floor; the library's default), 'vllm', 'sglang' or 'trtllm' with
            an optional ':VERSION' (measured kernel tables, stallfree.costmodel.kernels), or None for
            the commands' default (vLLM's `current` tables where the optional package is installed and
            has the GPU, else today's pricing, with the reason in the header).
        engine_profile: an engine profile's name (stallfree.sim.engine_profile: its step terms are
            added to every step, its front-end term to every request's TTFT and E2E), or None for the
            profile fitted on the engine whose kernel tables priced the steps (given by `kernels` or
            chosen by the default; none under today's pricing).
    """
    model: str = DEFAULTS["model"]
    gpu: str = DEFAULTS["gpu"]
    tp: int = DEFAULTS["tp"]
    dtype: str = DEFAULTS["dtype"]
    kv_dtype: str | None = None
    ep: int = 1
    dp_attention: int = 1
    gpu_memory_utilization: float = 0.9
    kv_tokens: int | None = None
    linear_cost: str | None = None
    max_model_len: int | None = None
    kernels: str | None = "none"
    engine_profile: str | None = "none"


def _length_spec(text: str, field: str) -> LengthSpec:
    """parse_length_spec, with a bad spec a usage error naming its option (`field`) and the text.

    Raises:
        SetupError (usage): the spec is malformed.
    """
    try:
        return parse_length_spec(text)
    except ValueError as exc:
        raise SetupError(f"`{field}`: {exc}", usage=True) from None


def build_workload(opts: WorkloadOptions) -> tuple[Workload, float]:
    """Return the workload the options describe (at its own rate) and the rate scale to apply; with
    `loras`, each request names an adapter drawn with `lora_popularity`.

    Raises:
        SetupError: conflicting options, too many synthetic requests, or an empty time window.
        TraceError: an unreadable trace.
        ValueError: a bad length spec, rate or adapter popularity.
    """
    wl, scale = _build_workload(opts)
    if opts.loras is not None:
        if isinstance(wl, SessionWorkload):
            raise SetupError("`loras`: LoRA adapters are not modelled with sessions", usage=True)
        wl = assign_loras(wl, opts.loras, parse_popularity(opts.lora_popularity), opts.seed)
    return wl, scale


def _build_workload(opts: WorkloadOptions) -> tuple[Workload, float]:
    if opts.synthetic and opts.trace:
        raise SetupError("`trace` and `synthetic` are exclusive", usage=True)
    if (opts.synthetic == "shared-prefix") != (opts.shared_prefix is not None):
        raise SetupError("`synthetic`='shared-prefix' and `shared_prefix` G,P,S,Q go together", usage=True)
    if opts.synthetic == "shared-prefix":
        g, p, s, q = parse_shared_prefix(opts.shared_prefix or "")
        wl = shared_prefix(g, p, s, q, _length_spec(opts.output_len, "output_len"), opts.rate,
                           block=opts.shared_prefix_block, seed=opts.seed)
        if opts.num_requests:
            wl = wl.head(opts.num_requests)
        return wl, opts.rate_scale or 1.0
    if opts.synthetic == "diurnal" or opts.rate_profile is not None:
        from stallfree.sim.diurnal import options_workload

        try:
            return options_workload(opts, _length_spec(opts.prompt_len, "prompt_len"),
                                    _length_spec(opts.output_len, "output_len"), MAX_SYNTHETIC_REQUESTS)
        except OSError as exc:
            raise SetupError(f"--rate-profile {opts.rate_profile}: cannot read it ({exc.strerror or exc})",
                             usage=True) from None
        except ValueError as exc:  # a bad profile or figure: the user's input, named as its flag
            raise SetupError(str(exc), usage=True) from None
    if opts.synthetic == "sessions" or (opts.trace and (opts.trace_format == "sessions" or (
            opts.trace_format == "auto" and is_session_trace(opts.trace)))):
        return _session_workload(opts)
    closed = opts.closed_loop
    drawn = closed is not None and not opts.trace and (opts.prompt_len != "trace" or opts.output_len != "trace")
    if opts.synthetic or drawn:
        if (opts.num_requests or 0) > MAX_SYNTHETIC_REQUESTS:
            raise SetupError(
                f"`num_requests`={opts.num_requests:,} is more than a synthetic run draws "
                f"(at most {MAX_SYNTHETIC_REQUESTS:,}, about a GiB of memory)",
                usage=True,
            )
        wl = synthetic(
            opts.num_requests or 1000,
            opts.rate,
            _length_spec(opts.prompt_len, "prompt_len"),
            _length_spec(opts.output_len, "output_len"),
            opts.synthetic or "poisson",  # closed loop: the arrival process is unused
            opts.burstiness,
            opts.seed,
        )
        if closed is not None:
            # The arrival process drawn above is unused: name the load the run offers.
            wl = replace(wl, name=f"closed-loop(concurrency={closed.concurrency}, think={closed.think_time:g}s; "
                         f"prompt {opts.prompt_len}; output {opts.output_len}; seed {opts.seed})")
            return wl, 1.0
        return wl, opts.rate_scale or 1.0
    if opts.trace == "mooncake" and not Path("mooncake").exists():
        wl = load_mooncake()
    else:
        wl = load_trace(opts.trace, opts.trace_format, opts.skip_bad_rows) if opts.trace else load_bundled()
    if opts.start or opts.end != math.inf:
        wl = wl.window(opts.start, opts.end)
        if not len(wl):
            raise SetupError(f"no request arrives in the window [{opts.start:g}, {opts.end:g}) s")
    if opts.num_requests:
        wl = wl.head(opts.num_requests)
    if closed is not None:
        return replace(wl, name=f"{wl.name}, closed loop x{closed.concurrency}"), 1.0
    return wl, opts.rate_scale or (1.0 if opts.trace else DEFAULT_RATE_SCALE)


def _session_workload(opts: WorkloadOptions) -> tuple[Workload, float]:
    """build_workload for sessions: a session trace (`trace`) or synthetic conversations; `num_requests`
    keeps the first N sessions, `start`/`end` the sessions starting in the window.

    Raises:
        SetupError: closed-loop load with sessions, too many sessions, a bad spec, an empty window.
        TraceError: an unreadable session trace.
    """
    if opts.concurrency is not None:
        opts.closed_loop  # noqa: B018 (raises the SetupError that names both)
    if opts.trace:
        wl: Workload = load_sessions(opts.trace, opts.skip_bad_rows)
    else:
        if (opts.num_requests or 0) > MAX_SYNTHETIC_REQUESTS:
            raise SetupError(f"`num_requests`={opts.num_requests:,} sessions is more than a synthetic run draws "
                             f"(at most {MAX_SYNTHETIC_REQUESTS:,})", usage=True)
        try:
            think = parse_think_spec(opts.think_time)
            tokens, count = parse_system_prompt(opts.system_prompt) if opts.system_prompt else (0, 1)
        except ValueError as exc:
            raise SetupError(str(exc), usage=True) from None
        wl = synthetic_sessions(opts.num_requests or 200, opts.rate, _length_spec(opts.turns, "turns"),
                                _length_spec(opts.prompt_len if opts.prompt_len != "trace" else "fixed:200",
                                             "prompt_len"),
                                _length_spec(opts.output_len if opts.output_len != "trace" else "fixed:200",
                                             "output_len"),
                                think, tokens, count, opts.seed)
    if opts.start or opts.end != math.inf:
        wl = wl.window(opts.start, opts.end)
        if not len(wl):
            raise SetupError(f"no session starts in the window [{opts.start:g}, {opts.end:g}) s")
    if opts.num_requests and opts.trace:
        wl = wl.head(opts.num_requests)
    return wl, opts.rate_scale or 1.0


def parse_linear_cost(text: str) -> LinearCostModel:
    """Return the linear cost model of "BASE_MS,PER_TOKEN_US[,PER_CTX_NS]".

    Raises:
        SetupError: not two or three finite numbers (usage).
    """
    try:
        nums = [float(x) for x in text.split(",")]
        if len(nums) not in (2, 3) or not all(math.isfinite(x) for x in nums):
            raise ValueError("each must be a finite number" if len(nums) in (2, 3) else "")
        return LinearCostModel(nums[0] * 1e-3, nums[1] * 1e-6, (nums[2] if len(nums) == 3 else 0.0) * 1e-9)
    except ValueError as exc:
        detail = f": {exc}" if str(exc) else ""
        raise SetupError(
            f"`linear_cost` wants BASE_MS,PER_TOKEN_US[,PER_CTX_NS], got {text!r}{detail}", usage=True
        ) from None


def build_cost_model(opts: HardwareOptions) -> tuple[StepCostModel, int, str]:
    """Return the cost model, the KV capacity (tokens) and a one-line description of the hardware.

    The KV capacity comes from stallfree.costmodel (model, GPU, TP, dtypes and
    gpu_memory_utilization) unless kv_tokens overrides it; linear_cost replaces the step pricing only.

    Raises:
        SetupError: an unknown model, GPU or dtype, a bad linear_cost, linear_cost with kernels (usage),
            or kernels that cannot be honoured (the message says why).
    """
    cost, kv, hw, _ = build_priced(opts)
    return cost, kv, hw


def build_priced(opts: HardwareOptions) -> tuple[StepCostModel, int, str, dict[str, Any]]:
    """Return build_cost_model's three values and what priced the steps: a dict with `cost_model`
    (a short name: 'kernels', 'calibrated', 'floor' or 'linear') and `cost_model_source` (structured:
    stallfree.costmodel.choice.ChosenCostModel.source).

    Raises:
        SetupError: as build_cost_model.
    """
    if opts.linear_cost and opts.kernels not in (None, "none"):
        raise SetupError(f"`linear_cost` and `kernels`={opts.kernels!r} are exclusive (both price the steps)",
                         usage=True)
    model, gpu, named = _preset_names(opts)
    try:
        # A linear cost replaces the pricing; the KV capacity still comes from today's cost model.
        kernels = "none" if opts.linear_cost else opts.kernels
        chosen = choose_cost_model(
            model, gpu, tp=opts.tp, dtype=opts.dtype, kv_dtype=opts.kv_dtype, kernels=kernels,
            config=_user_config(model), ep=opts.ep, dp_attention=opts.dp_attention,
        )
        real = chosen.cost_model
        kv = opts.kv_tokens or real.kv_capacity_tokens(gpu_memory_utilization=opts.gpu_memory_utilization)
    except (CostModelError, ValueError) as exc:
        # An unknown model, GPU, dtype or kernel engine/version, or a pricing the tables cannot give:
        # each is an option's value (exit 2, as `stallfree budget` answers the same values); so is a
        # malformed or oversized spec file named by --model or --gpu (docs/install.md, "Exit codes").
        raise SetupError(str(exc), usage=True) from None
    hw = f"{opts.model}, {opts.tp} x {opts.gpu}, {opts.dtype}" + (f", KV {opts.kv_dtype}" if opts.kv_dtype else "")
    hw += "".join(f" ({n})" for n in named)
    if opts.ep > 1 or opts.dp_attention > 1:
        hw += f", ep {opts.ep}, dp-attention {opts.dp_attention} ({opts.tp * opts.dp_attention} GPUs)"
    hw += f"; {chosen.line}"
    real, hw, profile = _with_profile(real, hw, opts, chosen.source)
    if opts.linear_cost:
        linear = {"kind": "linear", "chosen_by": "--linear-cost", "formula": opts.linear_cost}
        return (
            parse_linear_cost(opts.linear_cost),
            int(kv),
            f"linear cost {opts.linear_cost} (ms, us/token, ns/context token)",
            {"cost_model": "linear", "cost_model_source": linear,
             "engine_profile": {"name": "none", "chosen_by": "--linear-cost"}},
        )
    return real, int(kv), hw, {"cost_model": chosen.name, "cost_model_source": chosen.source,
                               "engine_profile": profile}


def _with_profile(
    cost: Any, hw: str, opts: HardwareOptions, source: dict[str, Any]
) -> tuple[Any, str, dict[str, Any]]:
    """Wrap `cost` in the options' engine profile, with a note for the header and the profile's record
    for --json (`engine_profile`: name, chosen_by, and the terms in ms / us).

    Without --engine-profile the profile is the one fitted on the engine whose kernel tables priced the
    steps, whether --kernels named it or the default chose it (`source`: the cost model's
    cost_model_source); none under today's pricing.

    Raises:
        SetupError: an unknown profile name.
    """
    try:
        if opts.engine_profile:
            prof, chosen_by = load_profile(opts.engine_profile), "--engine-profile"
        else:
            engine = source.get("engine") if source.get("kind") == "kernels" else None
            prof, chosen_by = default_profile(engine), "default"
    except EngineProfileError as exc:
        raise SetupError(str(exc), usage=True) from None
    record: dict[str, Any] = {"name": prof.name, "chosen_by": chosen_by} | prof.to_json()
    if prof.is_empty:
        if chosen_by == "default" and source.get("kind") == "kernels":
            # Said, so that runs priced by two engines' tables are not compared as if both had one.
            hw += f"; no engine profile fitted for {source.get('engine')} (kernel time only)"
        return cost, hw, record
    note = prof.describe() + (" (the front end added to TTFT and E2E)" if prof.frontend_s else "")
    return ProfiledCostModel(cost, prof), f"{hw}; {note}", record


def _preset_names(opts: HardwareOptions) -> tuple[str, str, list[str]]:
    """The options' model and GPU as our presets (stallfree.costmodel.names: a Hugging Face id such as
    meta-llama/Llama-3.1-8B-Instruct, a device name such as "NVIDIA H100 80GB HBM3"), and a note for each
    name that was mapped ("model meta-llama/... as llama-3.1-8b", with the GPU's nearest-preset note)."""
    model, _ = resolve_model(str(opts.model))
    gpu, gpu_note = gpu_match(str(opts.gpu))
    named = []
    if model != opts.model:
        shown = Path(model).parent.name if model.endswith(".json") else model
        named.append(f"model {opts.model} as {shown}")
    if gpu != opts.gpu:
        named.append(f"GPU {opts.gpu} as {gpu}" + (f": {gpu_note}" if gpu_note else ""))
    return model, gpu, named


def _user_config(model: str) -> dict[str, Any] | None:
    """The user's config.json (a Hugging Face config) to hand to the kernel tables, or None for a
    preset (or a file in our own format, which the tables get written from the ModelSpec)."""
    if not str(model).endswith(".json"):
        return None
    try:
        data = read_json(model)
    except (OSError, ValueError):  # FileLimitError is a ValueError
        return None  # get_model reports the unreadable file with its own message
    if isinstance(data, dict) and "num_hidden_layers" in data and "architectures" in data:
        return data
    return None


def context_length(opts: HardwareOptions) -> tuple[int | None, str]:
    """Return the context length that requests are checked against, tokens, and where it comes from.

    max_model_len when given (as vLLM's --max-model-len), else the model's own (its preset's or its
    config.json's max_position_embeddings); None when the model does not say.

    Raises:
        SetupError: max_model_len < 1, or an unknown model.
    """
    if opts.max_model_len is not None:
        if isinstance(opts.max_model_len, bool) or opts.max_model_len < 1:
            raise SetupError(f"`max_model_len` must be >= 1 token, got {opts.max_model_len!r}", usage=True)
        return opts.max_model_len, "--max-model-len"
    try:
        spec = get_model(_preset_names(opts)[0])
    except CostModelError as exc:
        raise SetupError(str(exc), usage=True) from None  # an unknown model name, as build_priced's
    return spec.context_length, spec.context_length_source


def default_cost_model() -> tuple[StepCostModel, int]:
    """Return the default replica's cost model and KV capacity (tokens): Llama 3.3 70B, 4 x H100 SXM, FP8."""
    cost, kv, _ = build_cost_model(HardwareOptions())
    return cost, kv


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
            defaults of the engine whose kernel tables price the run (stallfree.sim.engine_behaviour:
            vLLM >= 0.14.0 pages its KV in 16-token blocks without a watermark and caches prefixes), or
            the contract's under other pricing; `engine_behaviour` records which the engine set.
        kv_offloading_gib: instead of cpu_kv_tokens, the CPU tier's size as vLLM's --kv-offloading-size:
            GiB of host memory summed over the tensor-parallel ranks, converted with the model's KV bytes
            per token; its copies are priced over the GPU's host link (KVTransferCost).
        lora_rank: with max_loras in `scheduler`: the adapters' rank (stallfree.costmodel.lora).
        max_cpu_loras: with max_loras: adapters kept in host memory per replica, >= max_loras; None:
            max_loras (vLLM's default). Steps are priced with LoRA (stallfree.sim.lora.LoraCost); a
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

    def __init__(self, workload_options: WorkloadOptions | None = None,
                 hardware_options: HardwareOptions | None = None,
                 scheduler: SchedulerConfig | dict[str, Any] | str | None = None, *,
                 kv_offloading_gib: float | None = None, async_scheduling: bool | None = None,
                 lora_rank: int = DEFAULT_LORA_RANK, max_cpu_loras: int | None = None,
                 **legacy: Any) -> None:
        self.workload_options = workload_options or WorkloadOptions()
        self.hardware_options = hardware_options or HardwareOptions()
        self.max_queue_time_s = None
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
        self.workload = self.base_workload.scale_rate(self.rate_scale)
        rate = self.workload.mean_rate
        if math.isfinite(rate) and rate > MAX_OFFERED_RATE:
            wo = self.workload_options
            what = (f"`rate`={wo.rate:g}" if wo.synthetic and not wo.rate_scale
                    else f"`rate_scale`={self.rate_scale:g} on {self.base_workload.mean_rate:,.3g} requests/s")
            raise SetupError(f"{what} offers {rate:,.0f} requests/s, past the bound of {MAX_OFFERED_RATE:,.0f} "
                             "requests/s of one simulation", usage=True)
        self.cost_model, self.kv_tokens, self.hardware, self.pricing = build_priced(self.hardware_options)
        # What the user left open takes the pricing engine's default (stallfree.sim.engine_behaviour).
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
            raise SetupError(str(exc), usage=True) from None
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
            raise SetupError(str(exc), usage=True) from None
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
