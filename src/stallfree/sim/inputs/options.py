"""The typed options a simulation is built from (the workload's and the hardware's), their checks, and the
workload they build.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stallfree.core.errors import StallfreeError
from stallfree.sim.defaults import DEFAULT_RATE_SCALE, DEFAULT_REPLICA
from stallfree.sim.inputs.session_traces import is_session_trace, load_sessions
from stallfree.sim.inputs.sessions import (
    SessionWorkload,
    parse_system_prompt,
    parse_think_spec,
    synthetic_sessions,
)
from stallfree.sim.inputs.synthetic import (
    LengthSpec,
    parse_length_spec,
    parse_shared_prefix,
    shared_prefix,
    synthetic,
)
from stallfree.sim.inputs.traces import load_bundled, load_mooncake, load_trace
from stallfree.sim.inputs.workload import MAX_ARRIVAL_SPAN_S, TraceError, Workload
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.lora import assign_loras, parse_popularity

__all__ = [
    "DEFAULTS",
    "HardwareOptions",
    "MAX_OFFERED_RATE",
    "MAX_SYNTHETIC_REQUESTS",
    "SetupError",
    "WorkloadOptions",
    "build_workload",
    "scaled_workload",
]


#: The default replica: model, GPU, tensor-parallel GPUs and weight dtype (stallfree.sim.defaults.DEFAULT_REPLICA).
DEFAULTS: dict[str, Any] = DEFAULT_REPLICA


#: The most requests a synthetic workload draws: a day of a fleet's traffic at 230 requests/s (8.64 M at
#: 100/s). Drawn into C arrays (16 bytes a request) and run with --no-records, about 70 bytes a request in
#: all; more would take hours without telling anything new.
MAX_SYNTHETIC_REQUESTS = 20_000_000
#: The most sessions a synthetic session workload draws (each holds its turns' histories and ids).
MAX_SYNTHETIC_SESSIONS = 5_000_000


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
            many requests in flight, the next sent when one ends (stallfree.sim.run.load.ClosedLoop).
            The requests keep their order and lengths (a trace's, or drawn from prompt_len and
            output_len: a length spec other than "trace" draws synthetic lengths without
            `synthetic` set); their arrival times are ignored, so rate_scale must stay None.
        think_time: closed loop: seconds from a request's end to its client's next request, >= 0;
            synthetic sessions: the think time before each later turn, seconds or a distribution
            (stallfree.sim.inputs.sessions.parse_think_spec).
        turns: synthetic sessions: turns per session, a length spec.
        system_prompt: synthetic sessions: "TOKENS[,COUNT]" shared system prompts, or None.
        loras: None, or N: each request names one of N LoRA adapters, drawn with `lora_popularity`
            (stallfree.sim.run.lora.assign_loras; seeded by `seed`), in place of a trace's own `lora` column.
        lora_popularity: "zipf:S": adapter k drawn with probability proportional to 1 / (k + 1)^S.
        peak_ratio, peak_hour: synthetic "diurnal": the busiest rate over the quietest, and its hour
            (stallfree.sim.inputs.diurnal; None: its defaults).
        rate_profile: a CSV file `t_s,rate` whose rate, linear between points, the arrivals follow
            (stallfree.sim.inputs.diurnal), or None.
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
        gpu: a GPU preset or device name, or a path to the user's GPU file (.json), read as that file.
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
        engine_profile: an engine profile's name (stallfree.sim.inputs.engine_profile: its step terms are
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
    if opts.trace is not None and not opts.trace.strip():
        raise SetupError("`trace` '': give a trace file, or leave it out for the bundled Azure 2023 conversation "
                         "trace", usage=True)
    if opts.synthetic and opts.trace:
        raise SetupError("`trace` and `synthetic` are exclusive", usage=True)
    if (opts.synthetic == "shared-prefix") != (opts.shared_prefix is not None):
        raise SetupError("`synthetic`='shared-prefix' and `shared_prefix` G,P,S,Q go together", usage=True)
    if opts.start or opts.end != math.inf:
        if not 0 <= opts.start < opts.end:  # NaN fails too
            raise SetupError(f"`start` {opts.start:g} and `end` {opts.end:g}: a time window needs 0 <= start < end "
                             "(seconds of trace time)", usage=True)
        if opts.synthetic:
            raise SetupError(f"`start` and `end` cut a trace's time window; `synthetic`='{opts.synthetic}' draws "
                             "its own arrivals (give `num_requests` for fewer)", usage=True)
    if opts.synthetic == "shared-prefix":
        try:
            g, p, s, q = parse_shared_prefix(opts.shared_prefix or "")
        except ValueError as exc:
            raise SetupError(str(exc), usage=True) from None
        wl = shared_prefix(g, p, s, q, _length_spec(opts.output_len, "output_len"), opts.rate,
                           block=opts.shared_prefix_block, seed=opts.seed)
        if opts.num_requests:
            wl = wl.head(opts.num_requests)
        return wl, opts.rate_scale or 1.0
    if opts.synthetic == "diurnal" or opts.rate_profile is not None:
        from stallfree.sim.inputs.diurnal import options_workload

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
                f"(at most {MAX_SYNTHETIC_REQUESTS:,}: a day at 230 requests/s)",
                usage=True,
            )
        try:
            wl = synthetic(
                opts.num_requests or 1000,
                opts.rate,
                _length_spec(opts.prompt_len, "prompt_len"),
                _length_spec(opts.output_len, "output_len"),
                opts.synthetic or "poisson",  # closed loop: the arrival process is unused
                opts.burstiness,
                opts.seed,
            )
        except TraceError as exc:  # the trace:PATH the lengths are drawn from: named as its option, not `trace`
            given = [f"`{f}` {t}" for f, t in (("prompt_len", opts.prompt_len), ("output_len", opts.output_len))
                     if t.startswith("trace:")]
            raise SetupError(f"{' and '.join(given) or '`prompt_len` trace'}: {exc}", usage=True) from None
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
        wl_all, wl = wl, wl.window(opts.start, opts.end)
        if not len(wl):
            raise SetupError(f"no request arrives in the window `start` {opts.start:g} to `end` {opts.end:g} s "
                             f"(the trace's arrivals: {_span(wl_all)})", usage=True)
    if opts.num_requests:
        wl = wl.head(opts.num_requests)
    if closed is not None:
        return replace(wl, name=f"{wl.name}, closed loop x{closed.concurrency}"), 1.0
    return wl, opts.rate_scale or (1.0 if opts.trace else DEFAULT_RATE_SCALE)


def scaled_workload(base: Workload, scale: float, opts: WorkloadOptions, field: str = "rate_scale") -> Workload:
    """`base` (build_workload's workload) replayed `scale` times faster, refused when the options make a run
    the simulator cannot price: more than MAX_OFFERED_RATE requests/s, or arrivals spread over more than
    MAX_ARRIVAL_SPAN_S (the trace readers' bound: past it the simulated clock loses the steps' milliseconds,
    and a tiny rate gives latencies that are wrong without a word). Every command's workload passes here
    (Setup, and each of a sweep's rate scales with `field` "rate_scales").

    Raises:
        SetupError (usage): naming the option that spread or packed the arrivals (`rate`, `rate_profile` or
            `field`) and its value.
    """
    closed = opts.concurrency is not None  # closed loop: the arrival times are not used
    if not closed:
        _check_span(base, _source(opts), opts.rate)
    wl = base.scale_rate(scale)
    rate = wl.mean_rate
    if math.isfinite(rate) and rate > MAX_OFFERED_RATE:
        what = (f"`rate`={opts.rate:g}" if opts.synthetic and not opts.rate_scale and field == "rate_scale"
                else f"`{field}`={scale:g} on {base.mean_rate:,.3g} requests/s")
        raise SetupError(f"{what} offers {rate:,.0f} requests/s, past the bound of {MAX_OFFERED_RATE:,.0f} "
                         "requests/s of one simulation", usage=True)
    if not closed:
        _check_span(wl, f"`{field}`={scale:g}", scale)
    return wl


def _source(opts: WorkloadOptions) -> str:
    """The option whose value sets how far apart the arrivals of build_workload's workload lie."""
    if opts.rate_profile is not None:
        return f"`rate_profile` {opts.rate_profile}"
    if opts.synthetic:
        return f"`rate`={opts.rate:g}"
    return f"`trace` {opts.trace or 'azure-conv-2023'}"


def _check_span(wl: Workload, what: str, value: float) -> None:
    """Raise SetupError (usage) when `wl`'s arrivals span more than MAX_ARRIVAL_SPAN_S, naming `what` (the
    option and its value) and, when its value stretches the span in inverse proportion (`rate`, a rate
    scale), the least value that keeps it within."""
    span = wl.duration
    if span <= MAX_ARRIVAL_SPAN_S:  # NaN (arrivals at infinity) fails too
        return
    need = value * span / MAX_ARRIVAL_SPAN_S
    hint = ""
    if "`rate_profile`" not in what and "`trace`" not in what and math.isfinite(need) and need > 0:
        step = 10.0 ** (math.floor(math.log10(need)) - 2)
        hint = f" ({math.ceil(need / step) * step:.3g} or more keeps them within it)"
    raise SetupError(f"{what} spreads the {len(wl):,} arrivals over {span:.3g} s; arrival times must lie within "
                     f"{MAX_ARRIVAL_SPAN_S:g} s (about 3.2 years) of the first{hint}", usage=True)


def _span(wl: Workload) -> str:
    """The arrivals of `wl` as "FIRST to LAST s" (or "nothing" when it has none), for an error message."""
    times = wl.arrivals  # non-decreasing
    return f"{times[0]:g} to {times[-1]:g} s" if len(times) else "nothing"


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
        if (opts.num_requests or 0) > MAX_SYNTHETIC_SESSIONS:
            raise SetupError(f"`num_requests`={opts.num_requests:,} sessions is more than a synthetic run draws "
                             f"(at most {MAX_SYNTHETIC_SESSIONS:,})", usage=True)
        try:
            think = parse_think_spec(opts.think_time)
            tokens, count = parse_system_prompt(opts.system_prompt) if opts.system_prompt else (0, 1)
        except ValueError as exc:
            raise SetupError(str(exc), usage=True) from None
        try:
            wl = synthetic_sessions(opts.num_requests or 200, opts.rate, _length_spec(opts.turns, "turns"),
                                    _length_spec(opts.prompt_len if opts.prompt_len != "trace" else "fixed:200",
                                                 "prompt_len"),
                                    _length_spec(opts.output_len if opts.output_len != "trace" else "fixed:200",
                                                 "output_len"),
                                    think, tokens, count, opts.seed, max_total_turns=MAX_SYNTHETIC_REQUESTS)
        except TraceError:
            raise
        except ValueError as exc:  # the turns drawn, past a session's or a run's bound: named as `turns`
            raise SetupError(str(exc), usage=True) from None
    if opts.start or opts.end != math.inf:
        wl_all, wl = wl, wl.window(opts.start, opts.end)
        if not len(wl):
            raise SetupError(f"no session starts in the window `start` {opts.start:g} to `end` {opts.end:g} s "
                             f"(the trace's turns: {_span(wl_all)})", usage=True)
    if opts.num_requests and opts.trace:
        wl = wl.head(opts.num_requests)
    return wl, opts.rate_scale or 1.0
