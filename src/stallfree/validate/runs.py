"""Per-request run folders of a real vLLM engine (`meta.json` + `requests.jsonl`, the format of
data/validation/llmservingsim_vllm/), read into the requests to replay and what was measured.

Imports allowed: the standard library, stallfree.validate.compare.

The format (one folder per run):
- ``meta.json``: ``model`` (Hugging Face name), ``vllm_version``, ``engine_kwargs`` (tensor_parallel_size,
  data_parallel_size, enable_expert_parallel, max_num_seqs, max_num_batched_tokens, max_model_len, dtype,
  kv_cache_dtype), optionally ``kv_cache`` (num_gpu_blocks, block_size, gpu_memory_utilization,
  enable_prefix_caching), ``hardware`` (device_name, device_total_memory_bytes) and ``resolved_config``
  (vLLM's resolved configuration: its scheduler_config, cache_config, parallel_config and model_config
  give a field the engine arguments leave out, and scheduler_config.async_scheduling).
- ``requests.jsonl``: one request per line: ``input_toks``, ``output_toks``, ``queued_ts``,
  ``first_token_ts``, ``last_token_ts`` (the engine's monotonic clock, s; ``arrival_time`` is wall clock
  and is not used). Arrival = queued_ts; TTFT = first_token_ts - queued_ts; E2E = last_token_ts - queued_ts;
  TPOT = (last_token_ts - first_token_ts) / (output_toks - 1).
- ``config.json`` (optional): a simulator's hardware description; its first instance's ``hardware`` names
  the GPU when meta.json has no ``hardware`` section.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree._files import READ_ERRORS, FileLimitError, bounded_lines, loads_line, open_text, read_json
from stallfree.sim.inputs.workload import MAX_ARRIVAL_S, MAX_ARRIVAL_SPAN_S
from stallfree.validate.compare import Latencies
from stallfree.validate.errors import ValidateDataError

__all__ = ["RunFolder", "is_run_folder", "read_run_folder"]


@dataclass(frozen=True, slots=True)
class RunFolder:
    """One measured run: the engine's configuration, the requests and their measured latencies.

    Attributes:
        path: the folder.
        model: the Hugging Face model name of meta.json.
        vllm_version: the engine's version ("" when not given).
        tp, dp: tensor- and data-parallel sizes; expert_parallel: enable_expert_parallel.
        max_num_seqs, max_num_batched_tokens: the scheduler's limits (vLLM's defaults 256 and 2,048 when
            not given); max_model_len: tokens or None.
        dtype: the weights' dtype as meta.json spells it ("bfloat16", ...).
        kv_cache_dtype: engine_kwargs.kv_cache_dtype as spelt there ("auto": the weights' dtype; "fp8",
            "fp8_e4m3", "fp8_e5m2": 8-bit KV).
        block_size: KV block, tokens (16 when not given); num_gpu_blocks: KV blocks or None when not given;
        gpu_memory_utilization: fraction (0.9 when not given); prefix_caching: enable_prefix_caching.
        device_name: the GPU's name (meta.json hardware, else config.json), or "" when neither says.
        device_memory_bytes: the GPU's total memory as torch reported it, or None.
        arrivals: per request, s from the first queued_ts (sorted by it).
        prompt_lens, output_lens: per request, tokens.
        measured: per request (index in arrival order), the measured latencies (no ITL gaps: the files
            give the first and last token times only).
        request_ids: per request, its request_id (or its line number).
        async_scheduling: resolved_config.scheduler_config.async_scheduling, or None when meta.json has
            no resolved configuration.
    """

    path: Path
    model: str
    vllm_version: str
    tp: int
    dp: int
    expert_parallel: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    dtype: str
    block_size: int
    num_gpu_blocks: int | None
    gpu_memory_utilization: float
    prefix_caching: bool
    device_name: str
    device_memory_bytes: int | None
    arrivals: tuple[float, ...]
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    measured: tuple[Latencies, ...]
    request_ids: tuple[str, ...]
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"


def is_run_folder(path: Path) -> bool:
    """True when `path` is a folder holding meta.json and requests.jsonl."""
    return path.is_dir() and (path / "meta.json").is_file() and (path / "requests.jsonl").is_file()


def _int(where: str, name: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v or v < minimum:
        raise ValidateDataError(f"{where}: field {name!r} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _num(where: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValidateDataError(f"{where}: field {name!r} must be a number, got {v!r}")
    try:
        f = float(v)
    except OverflowError:  # an integer past 1.8e308
        f = math.inf
    if not math.isfinite(f):  # JSON's 1e309, NaN, Infinity
        raise ValidateDataError(f"{where}: field {name!r} must be a finite number, got {v!r}")
    return f


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
    except FileLimitError as exc:
        raise ValidateDataError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValidateDataError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise ValidateDataError(f"{path}: must hold a JSON object")
    return data


def _device_from_config(folder: Path) -> str:
    p = folder / "config.json"
    if not p.is_file():
        return ""
    try:
        data = _read_json(p)
        inst = data["nodes"][0]["instances"][0]
        return str(inst.get("hardware", ""))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return ""


def _request(where: str, line: str) -> tuple[str, int, int, float, float, float]:
    try:
        r = loads_line(line)
    except json.JSONDecodeError as exc:
        raise ValidateDataError(f"{where}: not JSON ({exc.msg})") from None
    except ValueError as exc:  # nested too deeply
        raise ValidateDataError(f"{where}: {exc}") from None
    if not isinstance(r, dict):
        raise ValidateDataError(f"{where}: must be a JSON object")
    for key in ("input_toks", "output_toks", "queued_ts", "first_token_ts", "last_token_ts"):
        if key not in r:
            raise ValidateDataError(f"{where}: no field {key!r}")
    plen = _int(where, "input_toks", r["input_toks"])
    olen = _int(where, "output_toks", r["output_toks"])
    q = _num(where, "queued_ts", r["queued_ts"])
    first = _num(where, "first_token_ts", r["first_token_ts"])
    last = _num(where, "last_token_ts", r["last_token_ts"])
    for name, t in (("queued_ts", q), ("first_token_ts", first), ("last_token_ts", last)):
        if abs(t) > MAX_ARRIVAL_S:  # the traces' bound: past any wall clock (Unix time is ~1.8e9 s)
            raise ValidateDataError(f"{where}: field {name!r} {t!r} is past {MAX_ARRIVAL_S:g} s: not a time")
    if last - q > MAX_ARRIVAL_SPAN_S:
        raise ValidateDataError(f"{where}: the request spans {last - q:g} s from queued_ts to last_token_ts, "
                                f"more than {MAX_ARRIVAL_SPAN_S:g} s (about 3.2 years)")
    if first < q:
        raise ValidateDataError(f"{where}: first_token_ts {first!r} is before queued_ts {q!r}")
    if last < first:
        raise ValidateDataError(f"{where}: last_token_ts {last!r} is before first_token_ts {first!r}")
    return str(r.get("request_id", "")), plen, olen, q, first, last


def read_run_folder(path: str | Path) -> RunFolder:
    """Read a run folder (module docstring).

    Raises:
        ValueError: a missing or unreadable file, or a malformed field: the message names the file (and
            the line of requests.jsonl) and the field with its value.
    """
    folder = Path(path)
    if not is_run_folder(folder):
        raise ValueError(f"--against {str(folder)!r}: not a run folder (needs meta.json and requests.jsonl)")
    meta_path = folder / "meta.json"
    meta = _read_json(meta_path)
    where = str(meta_path)
    kw = meta.get("engine_kwargs", {})
    kv = meta.get("kv_cache") or {}
    hw = meta.get("hardware") or {}
    if not isinstance(kw, dict) or not isinstance(kv, dict) or not isinstance(hw, dict):
        raise ValidateDataError(f"{where}: engine_kwargs, kv_cache and hardware must be objects")
    model = meta.get("model", kw.get("model"))
    if not isinstance(model, str) or not model:
        raise ValidateDataError(f"{where}: field 'model' must name the model, got {model!r}")
    resolved = meta.get("resolved_config")
    resolved = resolved if isinstance(resolved, dict) else {}

    def part(name: str) -> dict[str, Any]:
        got = resolved.get(name)
        return got if isinstance(got, dict) else {}

    # What vLLM resolved stands in for what the engine arguments leave at their defaults (which differ
    # by version and GPU); where neither says, the defaults documented on RunFolder.
    sched_r, cache_r, par_r, model_r = part("scheduler_config"), part("cache_config"), part("parallel_config"), \
        part("model_config")

    def pick(default: Any, *found: tuple[str, dict[str, Any], str]) -> tuple[str, Any]:
        for where_name, src, key in found:
            if src.get(key) is not None:
                return where_name, src[key]
        return found[0][0], default

    mml = pick(None, ("engine_kwargs.max_model_len", kw, "max_model_len"),
               ("resolved_config.model_config.max_model_len", model_r, "max_model_len"))[1]
    blocks = pick(None, ("kv_cache.num_gpu_blocks", kv, "num_gpu_blocks"),
                  ("resolved_config.cache_config.num_gpu_blocks", cache_r, "num_gpu_blocks"))[1]
    mem = hw.get("device_total_memory_bytes")
    tp_f = pick(1, ("engine_kwargs.tensor_parallel_size", kw, "tensor_parallel_size"),
                ("resolved_config.parallel_config.tensor_parallel_size", par_r, "tensor_parallel_size"))
    dp_f = pick(1, ("engine_kwargs.data_parallel_size", kw, "data_parallel_size"),
                ("resolved_config.parallel_config.data_parallel_size", par_r, "data_parallel_size"))
    ep_f = pick(False, ("engine_kwargs.enable_expert_parallel", kw, "enable_expert_parallel"),
                ("resolved_config.parallel_config.enable_expert_parallel", par_r, "enable_expert_parallel"))
    seqs_f = pick(256, ("engine_kwargs.max_num_seqs", kw, "max_num_seqs"),
                  ("resolved_config.scheduler_config.max_num_seqs", sched_r, "max_num_seqs"))
    budget_f = pick(2048, ("engine_kwargs.max_num_batched_tokens", kw, "max_num_batched_tokens"),
                    ("resolved_config.scheduler_config.max_num_batched_tokens", sched_r, "max_num_batched_tokens"))
    block_f = pick(16, ("kv_cache.block_size", kv, "block_size"),
                   ("resolved_config.cache_config.block_size", cache_r, "block_size"))
    util_f = pick(0.9, ("kv_cache.gpu_memory_utilization", kv, "gpu_memory_utilization"),
                  ("engine_kwargs.gpu_memory_utilization", kw, "gpu_memory_utilization"),
                  ("resolved_config.cache_config.gpu_memory_utilization", cache_r, "gpu_memory_utilization"))
    pc_f = pick(True, ("kv_cache.enable_prefix_caching", kv, "enable_prefix_caching"),
                ("engine_kwargs.enable_prefix_caching", kw, "enable_prefix_caching"),
                ("resolved_config.cache_config.enable_prefix_caching", cache_r, "enable_prefix_caching"))
    kvd_f = pick("auto", ("engine_kwargs.kv_cache_dtype", kw, "kv_cache_dtype"),
                 ("resolved_config.cache_config.cache_dtype", cache_r, "cache_dtype"))
    rows = []
    req_path = folder / "requests.jsonl"
    try:
        with open_text(req_path, encoding="utf-8") as fh:
            for i, line in enumerate(bounded_lines(fh, req_path), start=1):
                if line.strip():
                    rid, plen, olen, q, first, last = _request(f"{req_path}:{i}", line)
                    rows.append((q, rid or f"line {i}", plen, olen, first, last))
    except FileLimitError as exc:
        raise ValidateDataError(str(exc)) from None
    except (UnicodeDecodeError, EOFError) as exc:
        raise ValidateDataError(f"{req_path}: cannot read: {exc}") from None
    except READ_ERRORS as exc:
        raise ValueError(f"{req_path}: cannot read: {exc}") from None
    if not rows:
        raise ValidateDataError(f"{req_path}: no request")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    measured = tuple(
        Latencies(ttft=first - q, tpot=(last - first) / (olen - 1) if olen > 1 else None, e2e=last - q,
                  itl_mean=(last - first) / (olen - 1) if olen > 1 else None, itls=())
        for q, _rid, _p, olen, first, last in rows
    )
    async_sched = sched_r.get("async_scheduling")
    return RunFolder(
        path=folder,
        model=model,
        vllm_version=str(meta.get("vllm_version", "")),
        tp=_int(where, *tp_f),
        dp=_int(where, *dp_f),
        expert_parallel=bool(ep_f[1]),
        max_num_seqs=_int(where, *seqs_f),
        max_num_batched_tokens=_int(where, *budget_f),
        max_model_len=None if mml is None else _int(where, "max_model_len", mml),
        dtype=str(kw.get("dtype", "bfloat16")),
        block_size=_int(where, *block_f),
        num_gpu_blocks=None if blocks is None else _int(where, "num_gpu_blocks", blocks),
        gpu_memory_utilization=_num(where, *util_f),
        prefix_caching=bool(pc_f[1]),
        device_name=str(hw.get("device_name") or _device_from_config(folder)),
        device_memory_bytes=None if mem is None else _int(where, "hardware.device_total_memory_bytes", mem),
        arrivals=tuple(r[0] - t0 for r in rows),
        prompt_lens=tuple(r[2] for r in rows),
        output_lens=tuple(r[3] for r in rows),
        measured=measured,
        request_ids=tuple(r[1] for r in rows),
        async_scheduling=async_sched if isinstance(async_sched, bool) else None,
        kv_cache_dtype=str(kvd_f[1] or "auto"),
    )
