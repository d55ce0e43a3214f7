"""Closed-loop benchmark rows (the format of aiconfigurator-core's systems/silicon_sample.csv) against the
simulator: each row is replayed closed-loop at its concurrency and its measured TTFT and TPOT compared.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim,
stallfree.validate; matplotlib for the plot.

A row gives: backend and backend_version, model_path, system (a GPU), precision, mode (agg: one engine;
disagg: prefill and decode workers), isl and osl (tokens; every request of the row has exactly these),
batch_size, tp_size, pp_size, attention_dp_size, and silicon_ttft_ms / silicon_tpot_ms (the measured
means, ms). The concurrency is the ``silicon_concurrency=N`` inside silicon_data_source, else batch_size x
attention_dp_size (batch_size is one attention-DP rank's; below).

A disaggregated row gives each side's prefill_* / decode_* columns instead (num_workers, tp_size, pp_size,
attention_dp_size, moe_tp_size, moe_ep_size, batch_size; WorkerGroup). Its concurrency is the requests in
flight over the whole deployment: silicon_concurrency=N, else decode_batch_size x decode_attention_dp_size x
decode_num_workers. Why: aiconfigurator-core's batch_size is one attention-DP rank's batch of one worker
(sdk/backends/base_backend.py: ``global_bs = bs * model.config.attention_dp_size``, ``concurrency =
global_bs``), its disaggregated summary lists (d)bs, (d)global_bs and (d)workers apart (sdk/common.py,
ColumnsDisagg), and on every one of the 267 disaggregated rows of the bundled CSV that give all three
figures silicon_concurrency equals decode_batch_size x decode_attention_dp_size x decode_num_workers.

Replay: ``requests_per_row`` x concurrency requests (REQUESTS_PER_ROW by default) under the simulator's
closed-loop load (stallfree.sim.run.load.ClosedLoop), the first `concurrency` sent together at 0 and each later
one when one finishes (plus the engine profile's front-end time, which the engine sees as a think time).
The first wave's outputs are staggered (closed_loop's `spread`) so that the later waves arrive spread out,
as real clients drift apart, instead of in lock-step. TTFT is the mean over every request, the first wave
included (its prompts all queue at once, as a benchmark's first wave does); TPOT the mean over the requests
after the first wave (whose outputs the stagger shortened). Why (docs/fidelity.md): on the Llama-3.1-70B
fit rows alone, means over 10 waves with the first one included leave no TTFT residual that grows with
the prompt or the concurrency (median 2 ms at ISL 1,024 and concurrency <= 8, 15 ms at >= 32, -1 ms at
ISL 8,192), while dropping the first wave leaves 24, 135 and 119 ms.
Scheduler: paged, token budget BUDGET (vLLM's default
max_num_batched_tokens for its API server on a GPU of >= 70 GiB: vllm/engine/arg_utils.py,
_set_default_args), max_num_seqs the larger of the concurrency and 1,024, KV from the cost model at
gpu_memory_utilization 0.9 less the activation reserve (validate.hardware).

Disaggregated replay (stallfree.sim.run.disagg.simulate_disaggregated): prefill_num_workers prefill replicas of
prefill_tp_size GPUs (ep: prefill_moe_ep_size) and decode_num_workers decode replicas of decode_tp_size, each
side priced and its KV sized at its own tp and ep as an aggregated row is, under the same closed loop, waves
rule and token budget. A request's KV crosses the system's intra-node GPU link (the GPU preset's
link_bw_bytes_per_s, which is aiconfigurator-core's systems/*.yaml intra_node_bw for the systems it has;
latency that of INTERCONNECTS["nvlink"]): every prefill GPU sends its own shard in parallel, so a transfer
moves the prefill side's KV bytes per token per GPU (with attention data parallel, one rank's GPU's: a
request's KV lives on one rank). Rows without worker counts, or with pipeline parallel on either side, are
skipped with the reason.

Attention data parallel (attention_dp_size D > 1, aggregated or either side of a disaggregated row): a replica
(or worker) is D attention ranks of tp_size GPUs, priced by the cost model's dp_attention D with ep from
moe_ep_size (one rank's even share of each step: KernelCostModel's module docstring), its KV capacity
D ranks' worth, and its token budget D x BUDGET: vLLM and TensorRT-LLM run one scheduler per attention rank,
each with its own token budget (vLLM's data-parallel engines, TensorRT-LLM's attention-DP ranks). A row whose
experts span more GPUs than tp_size x attention_dp_size (implied attention data parallel) is still skipped.

Errors, percent: per row, the absolute percentage error |sim - measured| / measured x 100 of TTFT and of
TPOT; summarised by (model, GPU, engine, mode) as median and p90.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import util as import_util
from pathlib import Path
from typing import Any

from stallfree._files import READ_ERRORS, FileLimitError, bounded_lines, duplicated_column, open_text
from stallfree.core.metrics import percentile
from stallfree.core.plan import ScheduledChunk, StepPlan
from stallfree.costmodel import CostModelError
from stallfree.costmodel.choice import DEFAULT_ENGINE
from stallfree.costmodel.kernel_maps import parse_kernels
from stallfree.sim.inputs.engine_profile import EngineProfile, EngineProfileError, fit_rows, load_profile
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.config import ReplicaConfig
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.disagg import simulate_disaggregated
from stallfree.sim.run.disagg_link import INTERCONNECTS, Interconnect
from stallfree.sim.run.load import ClosedLoop
from stallfree.sim.run.simulator import simulate
from stallfree.validate.errors import ValidateDataError
from stallfree.validate.hardware import derived_kv_tokens, describe_profile, gpu_preset, model_preset, pricing

__all__ = [
    "BUDGET",
    "NOT_STEADY",
    "NO_WORKERS",
    "REQUESTS_PER_ROW",
    "ClosedLoopRow",
    "WorkerGroup",
    "bundled_csv",
    "closed_loop",
    "disagg_closed_loop",
    "prefill_load",
    "read_rows",
    "replay_row",
    "row_weights",
    "validate_silicon",
]

#: Requests replayed per row, as a multiple of its concurrency: ten waves, the first included in TTFT.
#: The CSV does not give the count; 10 waves is what the fit rows' TTFT agrees with (module docstring).
REQUESTS_PER_ROW = 10
#: The token budget of a replayed row (module docstring).
BUDGET = 8192
_CONC = re.compile(r"silicon_concurrency=(\d+)")


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    """One side of a disaggregated row (its prefill_* or decode_* columns).

    Attributes:
        workers: replicas on this side (num_workers); 0 when the row does not give it.
        tp, pp, attention_dp: GPUs per replica are tp x pp x attention_dp.
        moe_tp, moe_ep: the experts' tensor and expert parallelism (0: not given).
        batch_size: requests in flight per attention-DP rank of one replica (module docstring); 0: not given.
    """

    workers: int
    tp: int
    pp: int = 1
    attention_dp: int = 1
    moe_tp: int = 0
    moe_ep: int = 1
    batch_size: int = 0

    def layout(self) -> str:
        """E.g. "9 x tp8 ep8" (workers x GPUs per replica)."""
        ep = f" ep{self.moe_ep}" if self.moe_ep > 1 else ""
        dp = f" dp{self.attention_dp}" if self.attention_dp > 1 else ""
        return f"{self.workers or '?'} x tp{self.tp}{ep}{dp}"


@dataclass(frozen=True, slots=True)
class ClosedLoopRow:
    """One benchmark row (module docstring); line is its line in the CSV (the header is line 1); prefill and
    decode: a disaggregated row's two sides (None for an aggregated row)."""

    line: int
    row_id: str
    backend: str
    backend_version: str
    model: str
    system: str
    precision: str
    mode: str
    isl: int
    osl: int
    concurrency: int
    tp: int
    pp: int
    attention_dp: int
    ttft_ms: float
    tpot_ms: float
    moe_ep: int = 1
    moe_tp: int = 0
    prefill: WorkerGroup | None = None
    decode: WorkerGroup | None = None


def bundled_csv() -> Path:
    """The silicon_sample.csv inside the installed aiconfigurator-core.

    Raises:
        ValueError: the package is not installed (the message says how to install it).
    """
    spec = import_util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--against aiconfigurator needs aiconfigurator-core: pip install aiconfigurator-core "
                         "(or give the path of a silicon_sample.csv)")
    return Path(list(spec.submodule_search_locations)[0]) / "systems" / "silicon_sample.csv"


def _int(where: str, name: str, text: str, default: int | None = None, minimum: int = 1) -> int:
    t = (text or "").strip()
    if not t and default is not None:
        return default
    try:
        v = float(t)
    except ValueError:
        raise ValidateDataError(f"{where}: field {name!r} must be a number, got {text!r}") from None
    if not math.isfinite(v) or v != int(v) or v < minimum:
        raise ValidateDataError(f"{where}: field {name!r} must be an integer >= {minimum}, got {text!r}")
    return int(v)


def _ms(where: str, name: str, text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ValidateDataError(f"{where}: field {name!r} must be a number of ms, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValidateDataError(f"{where}: field {name!r} must be > 0 ms, got {text!r}")
    return v


_NEEDED = ("backend", "model_path", "system", "mode", "isl", "osl", "batch_size", "tp_size", "silicon_ttft_ms",
           "silicon_tpot_ms")


def read_rows(path: str | Path) -> list[ClosedLoopRow]:
    """Read every row of a silicon_sample.csv-style file.

    A disaggregated row (mode disagg) has no batch_size or tp_size of its own: tp is 1 and its sides are read
    from the prefill_* / decode_* columns (WorkerGroup; empty fields as 0, pp, attention_dp and moe_ep at
    least 1); its concurrency is silicon_concurrency=N, else decode_batch_size x decode_attention_dp_size x
    decode_num_workers (module docstring), else 0 (not replayed); an aggregated row's is silicon_concurrency=N,
    else batch_size x attention_dp_size.

    Raises:
        ValueError: the file cannot be read, a column is missing, or a field is malformed (file, line, field
            and value named).
    """
    p = Path(path)
    try:
        fh = open_text(p, encoding="utf-8")
    except FileLimitError as exc:
        raise ValidateDataError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{p}: cannot read: {exc}") from None
    try:
        with fh:
            return _read_rows(p, csv.DictReader(bounded_lines(fh, p)))
    except (FileLimitError, csv.Error, UnicodeDecodeError, EOFError) as exc:
        raise ValidateDataError(f"{p}: cannot read: {exc}" if not isinstance(exc, FileLimitError) else str(exc)) \
            from None
    except READ_ERRORS as exc:
        raise ValueError(f"{p}: cannot read: {exc}") from None


def _read_rows(p: Path, reader: csv.DictReader[str]) -> list[ClosedLoopRow]:
    """The rows of read_rows(), from its open reader."""
    twice = duplicated_column(reader.fieldnames)
    if twice is not None:
        raise ValidateDataError(f"{p}: column {twice!r} appears twice in the header; give each column once")
    missing = [c for c in _NEEDED if c not in (reader.fieldnames or [])]
    if missing:
        raise ValidateDataError(f"{p}: no column {', '.join(repr(c) for c in missing)}")
    rows = []
    for i, r in enumerate(reader, start=2):
        where = f"{p}:{i}"
        m = _CONC.search(r.get("silicon_data_source") or "")
        agg = (r["mode"] or "agg") == "agg"
        sides = None if agg else (_side(where, r, "prefill"), _side(where, r, "decode"))
        if m:
            conc = int(m.group(1))
        elif agg:  # batch_size is one attention-DP rank's (module docstring)
            conc = _int(where, "batch_size", r["batch_size"]) * max(
                1, _int(where, "attention_dp_size", r.get("attention_dp_size", ""), 1, 0))
        else:
            dec = sides[1]  # type: ignore[index]
            conc = dec.batch_size * dec.attention_dp * dec.workers
        rows.append(ClosedLoopRow(
            line=i, row_id=r.get("id", "") or f"line {i}", backend=r["backend"],
            backend_version=r.get("backend_version", "") or "", model=r["model_path"], system=r["system"],
            precision=r.get("precision", "") or "", mode=r["mode"] or "agg",
            isl=_int(where, "isl", r["isl"]), osl=_int(where, "osl", r["osl"]), concurrency=conc,
            tp=_int(where, "tp_size", r["tp_size"], 1) if agg else 1,
            pp=max(1, _int(where, "pp_size", r.get("pp_size", ""), 1, 0)) if agg else 1,
            attention_dp=max(1, _int(where, "attention_dp_size", r.get("attention_dp_size", ""), 1, 0))
            if agg else 1,
            ttft_ms=_ms(where, "silicon_ttft_ms", r["silicon_ttft_ms"]),
            tpot_ms=_ms(where, "silicon_tpot_ms", r["silicon_tpot_ms"]),
            moe_ep=max(1, _int(where, "moe_ep_size", r.get("moe_ep_size", ""), 1, 0)) if agg else 1,
            moe_tp=_int(where, "moe_tp_size", r.get("moe_tp_size", ""), 0, 0) if agg else 0,
            prefill=None if sides is None else sides[0], decode=None if sides is None else sides[1],
        ))
    return rows


def _side(where: str, r: dict[str, str], side: str) -> WorkerGroup:
    """A disaggregated row's `side` ("prefill" or "decode") from its {side}_* columns (absent or empty: 0)."""

    def field(name: str, floor: int = 0) -> int:
        key = f"{side}_{name}"
        return max(floor, _int(where, key, r.get(key) or "", 0, 0))

    return WorkerGroup(workers=field("num_workers"), tp=field("tp_size", 1), pp=field("pp_size", 1),
                       attention_dp=field("attention_dp_size", 1), moe_tp=field("moe_tp_size"),
                       moe_ep=field("moe_ep_size", 1), batch_size=field("batch_size"))


def _norm(s: str) -> str:
    return s.lower().replace("_", "-")


def _listed(names: Iterable[str], most: int = 8) -> str:
    """The distinct names, sorted, comma-separated; past `most`, the first ones and how many in all."""
    found = sorted(set(names))
    if len(found) <= most:
        return ", ".join(found)
    return ", ".join(found[:most]) + f", ... ({len(found)} in all)"


def select(rows: Iterable[ClosedLoopRow], model: str | None = None, gpu: str | None = None,
           engine: str | None = None, mode: str | None = None) -> list[ClosedLoopRow]:
    """The rows whose model contains `model`, whose system maps to the same preset as `gpu`, of backend
    `engine` and of `mode` ('-' and '_' alike, any case); None (and mode "all") selects all; `model` and `gpu`
    may be comma-separated lists (any of them)."""
    models = [_norm(m) for m in model.split(",")] if model else None
    gpus = {gpu_preset(_norm(g)) for g in gpu.split(",")} if gpu else None
    out = []
    for r in rows:
        if models is not None and not any(m in _norm(r.model) for m in models):
            continue
        if gpus is not None and gpu_preset(_norm(r.system)) not in gpus:
            continue
        if engine is not None and _norm(engine) != _norm(r.backend):
            continue
        if mode is not None and _norm(mode) != "all" and _norm(mode) != _norm(r.mode):
            continue
        out.append(r)
    return out


def _closed_loop_workload(concurrency: int, num_requests: int, isl: int, osl: int, spread: bool) -> Workload:
    """The closed loop's requests: `num_requests` prompts of `isl` tokens and `osl` outputs, all ready at 0 s;
    with `spread`, the first wave's outputs staggered (the i-th of `concurrency` gets ceil(osl (i + 1) /
    concurrency)) so that the waves do not finish in lock-step.

    Raises:
        ValueError: a count < 1.
    """
    if concurrency < 1 or num_requests < 1 or isl < 1 or osl < 1:
        raise ValueError(f"closed loop needs counts >= 1, got concurrency={concurrency}, "
                         f"num_requests={num_requests}, isl={isl}, osl={osl}")
    outs = [osl] * num_requests
    if spread:
        for i in range(min(concurrency, num_requests)):
            outs[i] = max(1, -(-osl * (i + 1) // concurrency))
    return Workload((0.0,) * num_requests, (isl,) * num_requests, tuple(outs), name="closed loop")


def closed_loop(sched: ReplicaConfig, cost: Any, concurrency: int, num_requests: int, isl: int, osl: int,
                think_s: float = 0.0, spread: bool = False) -> list[tuple[float, float, float]]:
    """Run a closed loop through the simulator (stallfree.sim.run.load.ClosedLoop): `concurrency` requests of
    `isl` prompt and `osl` output tokens sent at 0, and each later one `think_s` after one ends, until
    `num_requests` were sent and all finished. Step times come from `cost.step_time(plan)`, s.

    spread: the first wave's request i (of N = concurrency) generates ceil(osl x (i + 1) / N) tokens
    instead of osl, so that the first wave ends spread over one request's lifetime and the later waves
    (all of osl tokens) arrive spread out as real clients' requests drift apart; without it, equal
    requests sent together stay in lock-step wave after wave, every wave's prompts queueing at once.

    Returns:
        Per request in sending order: (arrival s, first token s, finish s), engine-side times.

    Raises:
        ValueError: a count < 1 or think_s < 0.
    """
    wl = _closed_loop_workload(concurrency, num_requests, isl, osl, spread)
    res = simulate(wl, sched, cost, closed_loop=ClosedLoop(concurrency, think_s))
    out = []
    for tl in sorted(res.timelines(), key=lambda t: int(t.rid)):
        if not tl.token_times or tl.finish_time is None:
            raise ValueError(f"closed loop: request {tl.rid} did not finish ({res.rejected[:1]})")
        out.append((tl.arrival, tl.token_times[0], tl.finish_time))
    return out


def disagg_closed_loop(prefill: tuple[ReplicaConfig, StepCostModel, int],
                       decode: tuple[ReplicaConfig, StepCostModel, int], kv_bytes_per_token: int,
                       link: Interconnect, concurrency: int, num_requests: int, isl: int, osl: int,
                       think_s: float = 0.0, spread: bool = False) -> list[tuple[float, float, float]]:
    """closed_loop on disaggregated replicas (stallfree.sim.run.disagg.simulate_disaggregated): each side given as
    (scheduler config, step pricing, replicas); a request's prompt KV, `kv_bytes_per_token` bytes per token,
    crosses `link` from its prefill replica to a decode replica. Other arguments and `spread` as closed_loop.

    Returns:
        Per request in sending order: (arrival s, first token s, finish s), engine-side times; the first token
        is the prefill side's, the finish the decode side's last token.

    Raises:
        ValueError: a count < 1, think_s < 0, or a request that did not finish (refused).
        stallfree.sim.run.result.ClusterError: a replica count < 1 or kv_bytes_per_token < 0.
    """
    wl = _closed_loop_workload(concurrency, num_requests, isl, osl, spread)
    res = simulate_disaggregated(wl, prefill[0], decode[0], prefill[1], decode[1], prefill[2], decode[2],
                                 kv_bytes_per_token, link, closed_loop=ClosedLoop(concurrency, think_s))
    timelines = {int(t.rid): t for t in res.timelines}
    out = []
    for rid in range(num_requests):
        tl = timelines.get(rid)
        if tl is None or not tl.token_times:
            raise ValueError(f"closed loop: request {rid} did not finish ({res.rejected[:1]})")
        out.append((res.arrival[rid], tl.token_times[0], tl.token_times[-1]))
    return out


#: The skip reason of a row whose measured figures need more prefill time per second than there is.
NOT_STEADY = ("not a steady state of distinct prompts: at its measured TTFT and TPOT its clients send more prompt "
              "tokens per second than the step pricing can prefill (prefill load > 1; shared prefixes or a partial "
              "mean)")


def _prefill_s(cost: Any, num_tokens: int, start: int) -> float:
    """Time of one chunk of a prompt's prefill, s: cost.prefill_step_time; with D > 1 attention ranks
    (cost.dp_attention) the step of D such chunks at once, one per rank, over D (the ranks prefill side by
    side and every chunk's tokens reach the experts)."""
    ranks = int(getattr(cost, "dp_attention", 1))
    if ranks <= 1:
        return float(cost.prefill_step_time(num_tokens, start))
    chunks = tuple(ScheduledChunk(i, num_tokens, True, start, True) for i in range(ranks))
    return float(cost.step_time(StepPlan(0, (), (), chunks, num_tokens * ranks, 0, num_tokens * ranks))) / ranks


def prefill_load(row: ClosedLoopRow, cost: Any, workers: int = 1) -> float:
    """The prefill time per second of wall time that a row's measured figures need, by `cost` (its
    `prefill_step_time(num_tokens, start)`, s): the rate concurrency / (TTFT + (OSL - 1) x TPOT) requests
    per second a closed loop runs at, times the time of one prompt's prefill in BUDGET-token chunks with
    no decodes beside them. Above 1 the GPUs would have to prefill faster than their measured kernels do,
    before any decode: the row is not a steady state of distinct prompts (prefix-cache hits on shared
    prompts, or a mean over a partial run). Kernel time is a mean, not a bound, so the rule refuses only
    such rows: on the Llama-3.1-70B fit rows it is at most 0.55, on Qwen3-32B 0.83 (docs/fidelity.md).
    workers: the replicas that share the prefills (a disaggregated row's prefill_num_workers), >= 1: the load
    is per replica. With attention data parallel a prompt's chunk is priced as one of D side by side
    (_prefill_s).
    """
    life_s = (row.ttft_ms + (row.osl - 1) * row.tpot_ms) * 1e-3
    prefill_s = sum(_prefill_s(cost, min(BUDGET, row.isl - start), start) for start in range(0, row.isl, BUDGET))
    return row.concurrency / life_s * prefill_s / max(workers, 1) if life_s > 0 else math.inf


def row_weights(row: ClosedLoopRow) -> tuple[str, str]:
    """Return (our model name or config path, weight dtype) for a row: model_preset of its model_path with its
    precision column (fp8 as fp8, anything else as bf16 unless the name fixes the checkpoint's format), except
    that precision fp4 is priced in nvfp4 (the NVFP4 checkpoints these rows serve, e.g. DeepSeek-R1's: GEMMs
    and experts in NVFP4) wherever the name does not fix MXFP4 (gpt-oss, whose own FP4 is MXFP4 experts), and
    precision int4 in int4 (Kimi-K2.5's INT4 checkpoint; which layers are 4-bit its config.json says:
    kernel_maps.quant_modes).

    Raises:
        ValueError: as model_preset.
    """
    precision = row.precision.lower()
    name, dtype = model_preset(row.model, "fp8" if precision == "fp8" else "bf16")
    if precision in ("fp4", "nvfp4") and dtype != "mxfp4":
        dtype = "nvfp4"
    elif precision == "int4" and dtype == "bf16":
        dtype = "int4"
    return name, dtype


def replay_row(row: ClosedLoopRow, profile: EngineProfile | None, kernels: str | None = "none",
               requests_per_row: int = REQUESTS_PER_ROW) -> dict[str, Any]:
    """Replay one row closed-loop (module docstring) and compare its TTFT and TPOT.

    Raises:
        ValueError: a row we do not replay (a mode other than agg and disagg, pipeline parallel, experts
            over more GPUs than tp x attention_dp (implied attention data parallel), a disaggregated row
            without worker counts or concurrency, a model or GPU the cost model cannot price, a prefill load
            above 1: prefill_load): the message says why.
    """
    where = f"line {row.line}"
    if row.mode == "disagg":
        return _replay_disagg(row, profile, kernels, requests_per_row)
    if row.mode != "agg":
        raise ValueError(f"{where}: mode {row.mode!r}: only agg and disagg rows are replayed")
    if row.pp > 1:
        raise ValueError(f"{where}: pp_size {row.pp}: pipeline parallel, not replayed")
    moe_gpus = row.moe_tp * row.moe_ep
    if row.moe_tp and moe_gpus > row.tp * row.attention_dp:
        # The experts span more GPUs than the attention's tp: data-parallel attention the row leaves implied.
        # Fewer is not that: a dense model's rows carry moe_tp_size 1 x moe_ep_size 1 at every tp.
        raise ValueError(f"{where}: moe_tp_size {row.moe_tp} x moe_ep_size {row.moe_ep} = {moe_gpus} GPUs against "
                         f"tp_size {row.tp}: implied attention data parallel, not replayed")
    name, dtype = row_weights(row)
    try:
        engine = parse_kernels(kernels)[0] if kernels is not None else DEFAULT_ENGINE
        price = pricing(name, gpu_preset(_norm(row.system)), row.tp, dtype, profile, kernels,
                        engine_version=row.backend_version if row.backend.lower() == engine else None,
                        ep=row.moe_ep, dp_attention=row.attention_dp)
        kv = derived_kv_tokens(price.base, getattr(price.base, "roofline", price.base).gpu.mem_bytes, 0.9, 16)
    except CostModelError as exc:
        raise ValueError(f"{where}: {exc}") from None
    load = prefill_load(row, price.base)
    if load > 1.0:
        raise ValueError(f"{where}: {NOT_STEADY}")
    sched = ReplicaConfig.of(kv, BUDGET * row.attention_dp, max(row.concurrency, 1024), kv_policy="paged",
                             block_size=16)
    n = requests_per_row * row.concurrency
    frontend = price.profile.frontend_s
    done = closed_loop(sched, price.cost_model, row.concurrency, n, row.isl, row.osl, frontend,
                       spread=True)
    steady = done[row.concurrency:] or done
    ttft = sum(f - a for a, f, _ in done) / len(done) + frontend
    tpot = sum((e - f) / (row.osl - 1) for _a, f, e in steady) / len(steady) if row.osl > 1 else float("nan")
    sim_ttft, sim_tpot = ttft * 1e3, tpot * 1e3
    return {
        "line": row.line, "id": row.row_id, "model": row.model, "system": row.system,
        "gpu": gpu_preset(_norm(row.system)), "engine": row.backend,
        "version": row.backend_version, "precision": row.precision, "isl": row.isl, "osl": row.osl,
        "concurrency": row.concurrency, "tp": row.tp, "ep": row.moe_ep, "dp_attention": row.attention_dp,
        "requests": n, "kv_tokens": kv, "cost_model": price.provenance, "engine_profile": price.profile.name,
        "mode": "agg",
        "layout": f"tp{row.tp}" + (f" ep{row.moe_ep}" if row.moe_ep > 1 else "")
        + (f" dp{row.attention_dp}" if row.attention_dp > 1 else ""),
        **_figures(row, sim_ttft, sim_tpot),
    }


def _figures(row: ClosedLoopRow, sim_ttft: float, sim_tpot: float) -> dict[str, Any]:
    return {
        "measured_ttft_ms": row.ttft_ms, "measured_tpot_ms": row.tpot_ms,
        "sim_ttft_ms": sim_ttft, "sim_tpot_ms": sim_tpot,
        "ttft_ape_pct": abs(sim_ttft - row.ttft_ms) / row.ttft_ms * 100.0,
        "tpot_ape_pct": abs(sim_tpot - row.tpot_ms) / row.tpot_ms * 100.0 if row.osl > 1 else None,
        "ttft_err_pct": (sim_ttft - row.ttft_ms) / row.ttft_ms * 100.0,
        "tpot_err_pct": (sim_tpot - row.tpot_ms) / row.tpot_ms * 100.0 if row.osl > 1 else None,
    }


#: The skip reason of a disaggregated row without its worker counts.
NO_WORKERS = ("prefill_num_workers / decode_num_workers not given: a disaggregated row is replayed only with "
              "its worker counts")


def _replay_disagg(row: ClosedLoopRow, profile: EngineProfile | None, kernels: str | None,
                   requests_per_row: int) -> dict[str, Any]:
    """replay_row for a disaggregated row (module docstring)."""
    where = f"line {row.line}"
    p, d = row.prefill, row.decode
    if p is None or d is None or not p.workers or not d.workers:
        raise ValueError(f"{where}: {NO_WORKERS}")
    for side, g in (("prefill", p), ("decode", d)):
        if g.pp > 1:
            raise ValueError(f"{where}: {side}_pp_size {g.pp}: pipeline parallel, not replayed")
        if g.moe_tp and g.moe_tp * g.moe_ep > g.tp * g.attention_dp:
            # Experts over more GPUs than the attention's tp: data-parallel attention left implied. Fewer is a
            # dense model's placeholder figures (Qwen3-32B rows give moe_tp_size 1, moe_ep_size 1 at tp 4).
            raise ValueError(f"{where}: {side}_moe_tp_size {g.moe_tp} x {side}_moe_ep_size {g.moe_ep} = "
                             f"{g.moe_tp * g.moe_ep} GPUs against {side}_tp_size {g.tp} x "
                             f"{side}_attention_dp_size {g.attention_dp}: implied attention data parallel, "
                             "not replayed")
    if row.concurrency < 1:
        raise ValueError(f"{where}: no concurrency: neither silicon_concurrency=N nor decode_batch_size x "
                         "decode_num_workers")
    name, dtype = row_weights(row)
    gpu = gpu_preset(_norm(row.system))
    sides = []
    try:
        engine = parse_kernels(kernels)[0] if kernels is not None else DEFAULT_ENGINE
        for g in (p, d):
            price = pricing(name, gpu, g.tp, dtype, profile, kernels,
                            engine_version=row.backend_version if row.backend.lower() == engine else None,
                            ep=g.moe_ep, dp_attention=g.attention_dp)
            roof = getattr(price.base, "roofline", price.base)
            kv = derived_kv_tokens(price.base, roof.gpu.mem_bytes, 0.9, 16)
            sched = ReplicaConfig.of(kv, BUDGET * g.attention_dp, max(row.concurrency, 1024), kv_policy="paged",
                                     block_size=16)
            sides.append((price, roof, kv, sched, g.workers))
    except CostModelError as exc:
        raise ValueError(f"{where}: {exc}") from None
    (pre, pre_roof, kv_p, sched_p, _), (dec, _, kv_d, sched_d, _) = sides
    if prefill_load(row, pre.base, p.workers) > 1.0:
        raise ValueError(f"{where}: {NOT_STEADY}")
    link = Interconnect(f"{gpu} GPU link", pre_roof.gpu.link_bw_bytes_per_s, INTERCONNECTS["nvlink"].latency_s)
    # A request's KV is on one attention rank: its GPUs' bytes, not the mean over the ranks' GPUs.
    kvb = math.ceil(pre_roof.kv_bytes_per_token_per_gpu * p.attention_dp)
    n = requests_per_row * row.concurrency
    frontend = pre.profile.frontend_s
    done = disagg_closed_loop((sched_p, pre.cost_model, p.workers), (sched_d, dec.cost_model, d.workers), kvb,
                              link, row.concurrency, n, row.isl, row.osl, frontend, spread=True)
    steady = done[row.concurrency:] or done
    ttft = sum(f - a for a, f, _ in done) / len(done) + frontend
    tpot = sum((e - f) / (row.osl - 1) for _a, f, e in steady) / len(steady) if row.osl > 1 else float("nan")
    return {
        "line": row.line, "id": row.row_id, "model": row.model, "system": row.system, "gpu": gpu,
        "engine": row.backend, "version": row.backend_version, "precision": row.precision, "isl": row.isl,
        "osl": row.osl, "concurrency": row.concurrency, "tp": d.tp, "ep": d.moe_ep, "requests": n,
        "kv_tokens": kv_d, "prefill_kv_tokens": kv_p, "mode": "disagg",
        "layout": f"P {p.layout()} : D {d.layout()}",
        "prefill_workers": p.workers, "prefill_tp": p.tp, "prefill_ep": p.moe_ep,
        "prefill_dp_attention": p.attention_dp, "decode_workers": d.workers, "decode_tp": d.tp, "decode_ep": d.moe_ep,
        "decode_dp_attention": d.attention_dp, "dp_attention": d.attention_dp,
        "link": link.name, "link_bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "kv_bytes_per_token": kvb,
        "cost_model": pre.provenance if pre.provenance == dec.provenance
        else f"prefill: {pre.provenance}; decode: {dec.provenance}",
        "engine_profile": pre.profile.name,
        **_figures(row, ttft * 1e3, tpot * 1e3),
    }


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["system"], r["engine"], r.get("mode", "agg")), []).append(r)
    out = []
    for (model, system, engine, mode), rs in sorted(groups.items()):
        entry: dict[str, Any] = {"model": model, "system": system, "gpu": rs[0]["gpu"], "engine": engine,
                                 "mode": mode, "rows": len(rs)}
        entry.update(_errors(rs))
        entry["fitted_rows"] = sum(bool(r.get("fitted")) for r in rs)
        out.append(entry)
    return out


def _errors(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and p90 APE and the signed bias (mean signed error) of TTFT and TPOT over rows, percent."""
    out: dict[str, Any] = {}
    for m in ("ttft", "tpot"):
        apes = [r[f"{m}_ape_pct"] for r in rs if r[f"{m}_ape_pct"] is not None]
        signed = [r[f"{m}_err_pct"] for r in rs if r.get(f"{m}_err_pct") is not None]
        out[f"{m}_median_ape_pct"] = percentile(apes, 50.0) if apes else None
        out[f"{m}_p90_ape_pct"] = percentile(apes, 90.0) if apes else None
        out[f"{m}_bias_pct"] = sum(signed) / len(signed) if signed else None
    return out


def is_fitted(row: dict[str, Any], fit: dict[str, Any] | None) -> bool:
    """Whether a replayed row is one the engine profile was fitted on (fit: engine_profile.fit_rows)."""
    if not fit:
        return False
    return (row["engine"] == fit.get("engine") and row.get("mode", "agg") == fit.get("mode", "agg")
            and str(fit.get("model_contains", "")).lower() in _norm(row["model"])
            and row["gpu"] in fit.get("gpu", ()))


def _shipped_profile(name: str) -> EngineProfile | None:
    """The shipped engine profile `name` (a replayed row's `engine_profile`), or None where none is."""
    try:
        return load_profile(name)
    except EngineProfileError:
        return None


def held_out_verdict(done: list[dict[str, Any]], profile: EngineProfile | None) -> tuple[dict[str, Any], str]:
    """The fitted and held-out rows' errors apart, and the verdict on the held-out rows (median APE of TTFT
    <= 20% and TPOT <= 10%), each median beside its signed bias. `profile` None: the default, each row's
    profile the one its pricing chose (its `engine_profile`)."""
    fitted = [r for r in done if r.get("fitted")]
    held = [r for r in done if not r.get("fitted")]
    split = {"held_out": {"rows": len(held), **(_errors(held) if held else {})},
             "fitted": {"rows": len(fitted), **(_errors(fitted) if fitted else {})}}
    name = (profile.name if profile is not None
            else " and ".join(sorted({str(r.get("engine_profile", "none")) for r in fitted})) or "none")
    apart = (f"; the {len(fitted)} rows engine profile {name} was fitted on, reported apart: median APE TTFT "
             f"{split['fitted']['ttft_median_ape_pct']:.1f}%, TPOT {split['fitted']['tpot_median_ape_pct'] or 0:.1f}%"
             if fitted else " (no row was fitted on)")
    if not held:
        return split, f"verdict: not judged: every one of the {len(fitted)} rows was fitted on{apart}"
    h = split["held_out"]
    good = h["ttft_median_ape_pct"] <= 20.0 and (h["tpot_median_ape_pct"] or 0.0) <= 10.0
    tpot = ("-" if h["tpot_median_ape_pct"] is None
            else f"{h['tpot_median_ape_pct']:.1f}% (bias {h['tpot_bias_pct']:+.1f}%)")
    line = (f"verdict: {'within' if good else 'outside'} the goals on {len(held)} held-out rows: median APE TTFT "
            f"{h['ttft_median_ape_pct']:.1f}% (bias {h['ttft_bias_pct']:+.1f}%; goal 20%), TPOT {tpot} (goal 10%)"
            + apart)
    return split, line


def validate_silicon(path: str, profile: EngineProfile | None, kernels: str | None = "none", model: str | None = None,
                     gpu: str | None = None, engine: str | None = None, mode: str | None = None,
                     requests_per_row: int | None = None, limit: int | None = None) -> dict[str, Any]:
    """Replay the selected rows of a benchmark CSV ("aiconfigurator": the installed package's copy).

    Returns:
        {"format": "silicon", "csv", "requests_per_row", "rows": [replay_row results],
        "skipped": {reason: count}, "summary": [per (model, GPU, engine, mode): rows, median and p90 APE],
        "overall": {...}, "verdict": line, "engine_profile": line}.

    Raises:
        ValueError: an unreadable or malformed CSV, a bad selection, or no row that can be replayed.
    """
    csv_path = bundled_csv() if path == "aiconfigurator" else Path(path)
    k = REQUESTS_PER_ROW if requests_per_row is None else requests_per_row
    if k < 1:
        raise ValueError(f"--requests-per-row must be >= 1 (1: one wave, all of it measured), got {k}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit-rows must be >= 1 (the first N selected rows), got {limit}")
    every = read_rows(csv_path)
    rows = select(every, model, gpu, engine, mode)
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        given = " ".join(f"{flag} {value!r}" for flag, value in
                         (("--model", model), ("--gpu", gpu), ("--engine", engine), ("--mode", mode))
                         if value is not None)
        raise ValueError(f"{csv_path}: no row matches {given}; its rows have models "
                         f"{_listed(r.model for r in every)} and GPUs {_listed(r.system for r in every)}")
    done: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    for r in rows:
        try:
            done.append(replay_row(r, profile, kernels, k))
        except ValueError as exc:
            reason = str(exc).split(": ", 1)[-1][:300]  # as raised: its figures are what the user needs
            skipped[reason] = skipped.get(reason, 0) + 1
    if not done:
        raise ValueError(f"{csv_path}: none of the {len(rows)} selected rows can be replayed: "
                         + "; ".join(skipped))
    for replayed in done:
        # Without a profile given, each row's is the one its pricing chose (the default: the profile fitted
        # on the engine whose tables priced it), and the rows that profile was fitted on are fitted here.
        used = profile if profile is not None else _shipped_profile(replayed["engine_profile"])
        replayed["fitted"] = is_fitted(replayed, fit_rows(used))
    summary = _summary(done)
    overall: dict[str, Any] = {"rows": len(done)}
    for m in ("ttft", "tpot"):
        apes = [r[f"{m}_ape_pct"] for r in done if r[f"{m}_ape_pct"] is not None]
        overall[f"{m}_median_ape_pct"] = percentile(apes, 50.0)
        overall[f"{m}_p90_ape_pct"] = percentile(apes, 90.0)
    split, line = held_out_verdict(done, profile)
    overall.update(split)
    return {"format": "silicon", "csv": str(csv_path), "requests_per_row": k, "rows": done, "skipped": skipped,
            "summary": summary, "overall": overall, "verdict": line, "engine_profile": describe_profile(profile),
            "kernels": kernels}


def print_silicon(res: dict[str, Any]) -> None:
    """Print every row (measured and simulated TTFT and TPOT with their APE), the summary and the verdict."""
    print(res["engine_profile"])
    print(f"{res['csv']}: {len(res['rows'])} rows replayed closed-loop, {res['requests_per_row']} x concurrency "
          "requests each (TTFT over all, TPOT after the first wave)")
    print(f"{'line':>5} {'model':<34} {'gpu':<9} {'isl':>5} {'osl':>5} {'conc':>4} {'tp':>2} "
          f"{'TTFT ms':>8} {'sim':>8} {'APE':>6} {'TPOT ms':>8} {'sim':>7} {'APE':>6}")
    for r in res["rows"]:
        tpe = "-" if r["tpot_ape_pct"] is None else f"{r['tpot_ape_pct']:.0f}%"
        print(f"{r['line']:>5} {r['model'][:34]:<34} {r['gpu'][:9]:<9} {r['isl']:>5} {r['osl']:>5} "
              f"{r['concurrency']:>4} {r['tp']:>2} {r['measured_ttft_ms']:>8.1f} {r['sim_ttft_ms']:>8.1f} "
              f"{r['ttft_ape_pct']:>5.0f}% {r['measured_tpot_ms']:>8.2f} {r['sim_tpot_ms']:>7.2f} {tpe:>6}"
              + (f"  {r['layout']}" if r.get("mode") == "disagg" else ""))
    print("\nabsolute percentage error by model, GPU, engine and mode (median / p90, signed bias):")
    for s in res["summary"]:
        fitted = " (fitted on)" if s.get("fitted_rows") else ""
        print(f"  {s['model']:<34} {s['gpu']:<9} {s['engine']:<7} {s.get('mode', 'agg'):<6} {s['rows']:>4} rows: TTFT "
              f"{s['ttft_median_ape_pct']:.1f}% / {s['ttft_p90_ape_pct']:.1f}% ({s.get('ttft_bias_pct') or 0:+.1f}%), "
              f"TPOT {s['tpot_median_ape_pct']:.1f}% / {s['tpot_p90_ape_pct']:.1f}% "
              f"({s.get('tpot_bias_pct') or 0:+.1f}%){fitted}")
    for reason, count in sorted(res["skipped"].items(), key=lambda kv: -kv[1]):
        print(f"skipped {count} rows: {reason}")
    print(res["verdict"])


def _plain_tick(value: float, _pos: object = None) -> str:
    """A log axis's tick as a plain number (20, 0.5, 1000), not in powers of ten."""
    return f"{value:g}"


def _minor_tick(value: float, _pos: object = None) -> str:
    """A minor tick of a log axis: labelled (plainly) at 2 and 5 times a power of ten, else blank."""
    lead = round(value / 10 ** math.floor(math.log10(value)), 6) if value > 0 else 0
    return f"{value:g}" if lead in (2, 5) else ""


def plot_silicon(path: Path, res: dict[str, Any]) -> None:
    """Scatter simulated against measured TTFT and TPOT per row (log axes), one colour per model, y = x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    models = sorted({r["model"] for r in res["rows"]})
    for ax, m in zip(axes, ("ttft", "tpot"), strict=True):
        for name in models:
            rs = [r for r in res["rows"] if r["model"] == name and r[f"sim_{m}_ms"] == r[f"sim_{m}_ms"]]
            ax.scatter([r[f"measured_{m}_ms"] for r in rs], [r[f"sim_{m}_ms"] for r in rs], s=10, alpha=0.7,
                       label=name)
        vals = [v for r in res["rows"] for v in (r[f"measured_{m}_ms"], r[f"sim_{m}_ms"]) if v == v and v > 0]
        lo, hi = min(vals) / 1.2, max(vals) * 1.2
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers: a sub-decade range would read "2x10^1"
            axis.set_major_formatter(FuncFormatter(_plain_tick))
            axis.set_minor_formatter(FuncFormatter(_minor_tick))
        ax.set_xlabel(f"measured {m.upper()} (ms)")
        ax.set_ylabel(f"simulated {m.upper()} (ms)")
        ax.legend(fontsize=7)
    fig.suptitle("stallfree validate --against: closed-loop rows, simulated against measured")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

