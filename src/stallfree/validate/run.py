"""`stallfree validate` on this machine: replay a workload through the real engine, calibrate a cost
model for this machine from the engine's own steps, simulate the same requests with the same scheduler
configuration, and compare them request by request.

Imports allowed: the standard library, torch (through stallfree.engine, only inside functions),
stallfree.core, stallfree.costmodel, stallfree.sim, stallfree.engine, stallfree.validate.

Calibration is on the first half of the workload (the steps that end before the first request of the
second half arrives); the errors are reported on the second half's requests, which the fit never saw.
The cost model of the machine is a "local" GPUSpec whose peaks are measured here by a short matmul and
copy test (float32; the cost model counts 2 bytes per weight, so the spec's bandwidth is half the
measured one); the fit of costmodel.fit (PROFILE_FIT: mfu, mbu, per kernel launch, per token, per
sequence) scales it to the engine's real steps.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stallfree.core.metrics import RequestTimeline
from stallfree.costmodel import CostModel, GPUSpec, ModelSpec
from stallfree.costmodel.calibrate import PROFILE_FIT, MeasuredStep, fit_steps
from stallfree.costmodel.hardware import GPUCalibration
from stallfree.sim.inputs.traces import load_bundled
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.simulator import simulate
from stallfree.validate.compare import compare, latencies, summary

__all__ = ["DRIFT_NOTE_PCT", "EngineRun", "ValidateConfig", "engine_replay", "local_gpu", "machine_drifted",
           "model_spec", "run_validate"]

#: How far steps of equal shape may move between the run's halves (percent, either way) before a note says the
#: machine's speed changed and the errors include that drift (and the command does not exit 3 on its verdict).
DRIFT_NOTE_PCT = 20.0


def machine_drifted(drift_pct: float | None) -> bool:
    """Whether the engine's speed drift between the halves (config's engine_speed_drift_pct) is past
    DRIFT_NOTE_PCT: the run's errors then include the machine's own change."""
    return drift_pct is not None and abs(drift_pct) > DRIFT_NOTE_PCT


@dataclass(frozen=True, slots=True)
class ValidateConfig:
    """What `stallfree validate` replays and how.

    Attributes:
        num_requests: requests taken from the start of the bundled Azure conversation trace (>= 4).
        prompt_scale, output_scale: their prompt and output lengths are multiplied by these (the trace's
            ~1,000-token prompts take seconds each on a CPU), then clipped to [1, max_prompt] and
            [2, max_output] tokens.
        load: the offered work over the engine's speed (measured by a warm-up), which sets the rate.
        token_budget, max_seqs, kv_tokens: the scheduler configuration, the same for engine and simulator.
        threads: torch CPU threads (1 keeps a shared machine usable; OpenMP threads on contended cores
            are much slower than one).
        seed: prompt token ids and the split.
        engine_model: the engine's checkpoint (None: the bundled SmolLM2-135M-Instruct).
        device: "cpu" (default) or "cuda"; dtype: the engine's weights ("float32", "bf16", "fp16").
    """

    num_requests: int = 24
    prompt_scale: float = 1 / 16
    output_scale: float = 1 / 8
    max_prompt: int = 192
    max_output: int = 40
    load: float = 0.7
    token_budget: int = 128
    max_seqs: int = 16
    kv_tokens: int = 16384
    threads: int = 1
    seed: int = 0
    engine_model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_prompt", "max_output", "token_budget", "max_seqs", "kv_tokens", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_requests < 4:
            raise ValueError(f"num_requests must be >= 4 (two halves of two), got {self.num_requests}")
        for name in ("prompt_scale", "output_scale", "load"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not 0 < v <= 100:
                raise ValueError(f"{name} must be in (0, 100], got {v!r}")


@dataclass(slots=True)
class EngineRun:
    """What the engine did: per-request timelines (s from the start) and per-step records.

    Attributes:
        timelines: one RequestTimeline per finished request (rid = workload index).
        steps: (start s, end s, MeasuredStep) per non-empty step.
        wall_s: the replay's wall time, s.
    """

    timelines: list[RequestTimeline] = field(default_factory=list)
    steps: list[tuple[float, float, MeasuredStep]] = field(default_factory=list)
    wall_s: float = 0.0


def _step_record(plan: Any, seconds: float) -> MeasuredStep:
    prefill = sum(c.num_tokens for c in plan.prefills)
    return MeasuredStep(
        num_tokens=plan.num_tokens,
        num_decodes=plan.num_decodes,
        decode_context_sum=plan.decode_context_sum,
        seconds=seconds,
        num_prefill_tokens=prefill,
        prefill_context_sum=sum(c.start for c in plan.prefills),
        num_sampled=plan.num_decodes + sum(1 for c in plan.prefills if c.is_last),
    )


def engine_replay(engine: Any, workload: Workload, seed: int = 0) -> EngineRun:
    """Replay `workload` through `engine` (an LLMEngine) in real time: each request is added at its
    arrival (greedy, EOS ignored, exactly its output length), and every step is timed.

    A request's arrival in its timeline is its scheduled arrival, so the time it waits for the running
    step to end counts, as it does in the simulator.
    """
    from stallfree.engine import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(300, 40000) for _ in range(p)] for p in workload.prompt_lens]
    n = len(workload)
    tokens: dict[Hashable, list[float]] = {i: [] for i in range(n)}
    finish: dict[Hashable, float] = {}
    run = EngineRun()
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and workload.arrivals[nxt] <= now:
            params = SamplingParams(max_tokens=workload.output_lens[nxt], temperature=0.0, ignore_eos=True)
            engine.add_request(nxt, prompts[nxt], params)
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(workload.arrivals[nxt] - now, 0.05)))
            continue
        s0 = time.perf_counter()
        outs = engine.step()
        s1 = time.perf_counter()
        plan = engine.last_plan
        if plan is not None and plan.num_tokens:
            run.steps.append((s0 - t0, s1 - t0, _step_record(plan, s1 - s0)))
        for o in outs:
            tokens[o.rid].extend([s1 - t0] * len(o.new_token_ids))
            if o.finished:
                finish[o.rid] = s1 - t0
    run.wall_s = time.perf_counter() - t0
    run.timelines = [
        RequestTimeline(i, workload.arrivals[i], tuple(tokens[i]), workload.prompt_lens[i], finish=finish[i])
        for i in range(n)
        if i in finish and tokens[i]
    ]
    return run


def local_gpu(threads: int, device: str = "cpu", dtype: str = "float32") -> GPUSpec:
    """Measure this machine's matmul rate and copy bandwidth with torch (on `device`, in `dtype`) and
    return them as a 'local' GPUSpec (memory: the machine's RAM, or the GPU's; one device, no link).
    Measured on `threads` torch threads; the process's thread count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure_local_gpu(threads, device, dtype)
    finally:
        torch.set_num_threads(before)


def _measure_local_gpu(threads: int, device: str, dtype: str) -> GPUSpec:
    import torch

    from stallfree.engine.engine import resolve_dtype

    dev, dt = torch.device(device), resolve_dtype(dtype)
    size = 512 if dev.type == "cpu" else 8192
    a, b = torch.randn(size, size, device=dev, dtype=dt), torch.randn(size, size, device=dev, dtype=dt)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    a @ b
    sync()
    t = time.perf_counter()
    reps = 8
    for _ in range(reps):
        a @ b
    sync()
    flops = reps * 2 * size**3 / (time.perf_counter() - t)
    x = torch.empty((8 if dev.type == "cpu" else 256) * 1024 * 1024, device=dev, dtype=dt)
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(4):
        y.copy_(x)
    sync()
    elem = x.element_size()
    bw = 4 * 2 * x.numel() * elem / (time.perf_counter() - t)  # read and write
    bw = bw * 2 / elem  # the cost model counts 2 B per weight: scale so that its times come out right
    if dev.type == "cuda":
        ram = float(torch.cuda.get_device_properties(dev).total_memory)
    else:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 16e9
    return GPUSpec(
        key="local-cpu",
        name=f"this machine's {device}, {threads} torch thread(s), {dtype}",
        bf16_flops_per_s=flops,
        fp16_flops_per_s=flops,
        fp8_flops_per_s=None,
        int8_ops_per_s=None,
        mem_bw_bytes_per_s=bw,
        mem_bytes=ram,
        link_bw_bytes_per_s=1e9,
        sources=(
            f"measured by stallfree validate: {size} x {size} {dtype} matmul {flops / 1e9:.1f} GFLOP/s, "
            f"copy {bw * elem / 2 / 1e9:.1f} GB/s (scaled by 2 / {elem} B: the cost model counts 2 B per weight)",
        ),
        link_source="one device: no link",
    )


def model_spec(engine: Any) -> ModelSpec:
    """Return the ModelSpec of an LLMEngine's model, from its config."""
    c = engine.model.config
    return ModelSpec(
        key="engine-model",
        name=str(engine.model_name),
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        tie_word_embeddings=bool(c.tie_embeddings),
        qkv_bias=bool(getattr(c, "attention_bias", False)),
        sources=("the engine's checkpoint config",),
    )


def _workload(cfg: ValidateConfig, seconds_per_token: float, max_len: int) -> Workload:
    """The first num_requests of the bundled trace, lengths scaled, arrivals scaled to `load`."""
    wl = load_bundled().head(cfg.num_requests)
    prompts = tuple(max(1, min(cfg.max_prompt, round(p * cfg.prompt_scale))) for p in wl.prompt_lens)
    outs = tuple(max(2, min(cfg.max_output, round(o * cfg.output_scale))) for o in wl.output_lens)
    outs = tuple(min(o, max_len - p) for p, o in zip(prompts, outs, strict=True))
    work_s = seconds_per_token * (sum(prompts) + 2 * sum(outs))  # a CPU decode costs ~2 prefill tokens
    span = wl.arrivals[-1] - wl.arrivals[0]
    scaled = replace(wl, prompt_lens=prompts, output_lens=outs, name="azure-conv-2023 (scaled)")
    if span <= 0:
        return scaled
    return scaled.scale_rate(span / (work_s / cfg.load))


#: Parameter sets tried on the engine's steps; the one with the smallest error on its fitting rows wins.
#: (On a CPU the weights' read, a fixed cost and the per-token cost are close to collinear, so the
#: larger sets can be singular on a few dozen steps.)
FIT_CANDIDATES = (
    PROFILE_FIT,
    ("mfu", "mbu", "overhead_s", "per_seq_s"),
    ("mbu", "per_token_s", "per_seq_s"),
    ("mfu", "mbu", "overhead_s"),
)


def _best_fit(base: CostModel, steps: list[MeasuredStep], seed: int) -> Any:
    """Fit each of FIT_CANDIDATES that the rows allow; return the calibration with the least error on
    its fitting rows (the held-out rows stay out of the choice)."""
    best = None
    for fit in FIT_CANDIDATES:
        if len(steps) < len(fit) + 3:
            continue
        cal = fit_steps(base, steps, fit, holdout=0.2, seed=seed)
        if any("singular" in n for n in cal.notes):
            continue
        if best is None or cal.train.mean < best.train.mean:
            best = cal
    if best is None:
        raise ValueError(f"cannot calibrate on {len(steps)} engine steps: run more requests (--num-requests)")
    return best


def _shape_ratios(run: EngineRun, split_t: float) -> list[float]:
    """Per step shape (decode count, prefill chunk tokens) that ran in both halves: the median seconds of
    its second-half steps over its first-half steps."""
    import statistics

    by_shape: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    for _start, end, s in run.steps:
        by_shape.setdefault((s.num_decodes, s.num_prefill_tokens), ([], []))[end > split_t].append(s.seconds)
    return [statistics.median(b) / statistics.median(a) for a, b in by_shape.values() if a and b]


def _speed_drift(run: EngineRun, split_t: float) -> float | None:
    """How much the machine itself sped up or slowed down between the halves, percent: the median over step
    shapes (decode count and prefill chunk tokens) run in both halves of the change in their median time,
    second half over first. Steps of one shape do the same work, so only the machine moves them; steps that
    grew because the batches grew are not drift. None when no shape ran in both halves."""
    import statistics

    ratios = _shape_ratios(run, split_t)
    return (statistics.median(ratios) - 1.0) * 100.0 if ratios else None


def _step_growth(run: EngineRun, split_t: float) -> float | None:
    """Percent change of the median step time, second half over first, whatever the steps' shapes (None
    when a half has no step): the growth the drift is told apart from."""
    import statistics

    halves: tuple[list[float], list[float]] = ([], [])
    for _start, end, s in run.steps:
        halves[end > split_t].append(s.seconds)
    if not halves[0] or not halves[1]:
        return None
    return (statistics.median(halves[1]) / statistics.median(halves[0]) - 1.0) * 100.0


def _warm_up(make: Any) -> float:
    """Run a few steps (the first ones are slow), return seconds per prefill token."""
    from stallfree.engine import SamplingParams

    eng = make()
    rng = random.Random(99)
    for i in range(2):
        ids = [rng.randrange(300, 40000) for _ in range(48)]
        eng.add_request(i, ids, SamplingParams(max_tokens=4, temperature=0.0))
    tokens, total = 0, 0.0
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        total += time.perf_counter() - t
        tokens += eng.last_plan.num_tokens if eng.last_plan is not None else 0
    return total / max(tokens, 1)


def run_validate(cfg: ValidateConfig, out: Path | None = None, save_gpu: Path | None = None) -> dict[str, Any]:
    """Run the engine, calibrate on the first half, simulate, and compare on the second half.

    Returns:
        {"engine": summary, "simulator": summary, "error": errors (compare), "calibration": ...,
         "config": ..., "notes": [...]}; summaries and errors are over the second half's requests.

    Runs on `cfg.threads` torch threads; the process's thread count is restored afterwards, so a caller
    (a test session, a notebook) keeps its own.

    Raises:
        ValueError: a bad configuration; EngineError / ModelLoadError from the engine.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run_validate(cfg, out, save_gpu)
    finally:
        torch.set_num_threads(before)


def _run_validate(cfg: ValidateConfig, out: Path | None, save_gpu: Path | None) -> dict[str, Any]:
    from stallfree.engine import LLMEngine, engine_config

    t_start = time.perf_counter()
    base = LLMEngine.from_pretrained(cfg.engine_model, token_budget=cfg.token_budget, max_seqs=cfg.max_seqs,
                                     kv_tokens=cfg.kv_tokens, device=cfg.device, dtype=cfg.dtype)

    def make() -> Any:
        return LLMEngine(base.model, base.tokenizer, base.model_name,
                         scheduler=engine_config(cfg.token_budget, cfg.max_seqs, cfg.kv_tokens))

    per_token = _warm_up(make)
    workload = _workload(cfg, per_token, base.max_model_len)
    run = engine_replay(make(), workload, cfg.seed)
    half = len(workload) // 2
    split_t = workload.arrivals[half]
    first = [s for (_, end, s) in run.steps if end <= split_t]
    notes = [f"calibrated on the {len(first)} engine steps that ended before request {half} arrived "
             f"({split_t:.1f} s); errors on requests {half}-{len(workload) - 1}, which the fit never saw"]
    if len(first) < len(PROFILE_FIT) + 3:
        first = [s for (_, _, s) in run.steps]
        notes = [f"too few steps in the first half: calibrated on all {len(first)} steps, so the errors "
                 "below are NOT on held-out data"]
    drift, growth = _speed_drift(run, split_t), _step_growth(run, split_t)
    shapes = len(_shape_ratios(run, split_t))
    if machine_drifted(drift):
        notes.append(f"the engine's steps of equal shape (decode count and chunk sizes; {shapes} shapes) took "
                     f"{drift:+.0f}% longer in the second half than in the first: the machine's speed changed "
                     "(other jobs), and the errors below include that drift")
    elif growth is not None and abs(growth) > DRIFT_NOTE_PCT:
        notes.append(f"the engine's steps took {growth:+.0f}% longer at the median in the second half, but steps "
                     f"of equal shape only {drift or 0:+.0f}% ({shapes} shapes): the batches changed, not the "
                     "machine, so a miss here is the model's, not drift")
    gpu = local_gpu(cfg.threads, cfg.device, cfg.dtype)
    spec = model_spec(base)
    cm0 = CostModel(spec, gpu, 1, "bf16")
    cal = _best_fit(cm0, first, cfg.seed)
    notes.append("fitted " + ", ".join(k for k, v in cal.kwargs().items() if v != getattr(cm0, k)) + "; "
                 + "; ".join(cal.notes))
    cm = cm0.replace(**cal.kwargs())
    sched = ReplicaConfig.of(cfg.kv_tokens, cfg.token_budget, cfg.max_seqs)
    sim = simulate(workload, sched, cm)
    eng_lat, sim_lat = latencies(run.timelines), latencies(sim.timelines())
    held = list(range(half, len(workload)))
    result: dict[str, Any] = {
        "engine": summary(eng_lat, held),
        "simulator": summary(sim_lat, held),
        "error": compare(eng_lat, sim_lat, held),
        "scheduler_config": sched.scheduler.resolved(),
        "calibration": {**cal.kwargs(), "fit_steps": len(first),
                        "step_test_median_pct": cal.test.median * 100, "step_test_p90_pct": cal.test.p90 * 100},
        "config": {"requests": len(workload), "token_budget": cfg.token_budget, "max_seqs": cfg.max_seqs,
                   "kv_tokens": cfg.kv_tokens, "scheduler": "reserve (chunked prefill)", "threads": cfg.threads,
                   "device": cfg.device, "dtype": cfg.dtype,
                   "model": str(base.model_name), "offered_rate": workload.mean_rate, "load": cfg.load,
                   "engine_steps": len(run.steps), "engine_wall_s": run.wall_s,
                   "engine_speed_drift_pct": drift, "engine_step_growth_pct": growth,
                   "engine_drift_shapes": shapes},
        "notes": notes,
    }
    gpu_cal = replace(gpu, calibration=GPUCalibration(
        kwargs=tuple(cal.kwargs().items()),
        source=f"stallfree validate: {len(first)} engine steps of {base.model_name} on this CPU",
        model=spec.key, tp=1, linear_flops_per_token_per_gpu=2.0 * spec.active_layer_params,
    ))
    if out is not None:
        from stallfree.validate.output import write_outputs

        write_outputs(out, workload, run, sim, eng_lat, sim_lat, half, gpu_cal)
    if save_gpu is not None:
        from stallfree.validate.output import write_gpu

        write_gpu(save_gpu, gpu_cal)
    result["config"]["total_wall_s"] = time.perf_counter() - t_start
    return result
