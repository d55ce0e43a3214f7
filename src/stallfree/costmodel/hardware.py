"""GPU specifications (GPUSpec), the dtypes the cost model knows, and the named presets in data/gpus.json.

Imports allowed: the standard library and stallfree.costmodel.errors.

Every number of a preset carries its source in data/gpus.json (and, gathered, in data/SOURCES.md).
Names treat '-' and '_' alike and ignore case: `h100-sxm` = `H100_SXM`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, cast

from stallfree._files import FileLimitError, read_json
from stallfree.costmodel.errors import CostModelDataError, CostModelError, CostModelFileError

__all__ = [
    "CALIBRATION_KEYWORDS",
    "DTYPE_BYTES",
    "FOUR_BIT_DTYPES",
    "GPUCalibration",
    "GPUSpec",
    "alias_index",
    "did_you_mean",
    "canonical_dtype",
    "get_gpu",
    "gpu_from_dict",
    "gpu_to_dict",
    "json_bool",
    "json_int",
    "json_number",
    "json_object",
    "json_optional_number",
    "json_str",
    "json_strings",
    "json_value",
    "list_gpus",
    "load_gpu_file",
    "normalize_name",
    "read_json_object",
]

#: Bytes per element of each dtype the cost model prices, block scales included for the 4-bit ones:
#:   mxfp4: 32 FP4 (E2M1) elements share one 8-bit E8M0 scale, 4 + 8/32 = 4.25 bits (OCP Microscaling
#:          Formats (MX) Specification v1.0, 2023; gpt-oss's experts);
#:   nvfp4: 16 FP4 (E2M1) elements share one FP8 (E4M3) scale, 4 + 8/16 = 4.5 bits; the one FP32 scale
#:          per tensor is left out (NVIDIA, "Introducing NVFP4", 2025);
#:   int4:  weight-only INT4 in groups of 128 with one 16-bit scale each, 4 + 16/128 = 4.125 bits (AWQ,
#:          arXiv 2306.00978, and GPTQ, arXiv 2210.17323, at their usual group size; an asymmetric
#:          zero point's 4/128 bits more are left out).
DTYPE_BYTES: dict[str, float] = {
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "mxfp4": 4.25 / 8,
    "nvfp4": 4.5 / 8,
    "int4": 4.125 / 8,
}

#: The 4-bit weight dtypes: weights only (never the KV cache); activations stay 16-bit unless the GPU
#: has FP4 units (then mxfp4 and nvfp4 GEMMs run at its FP4 peak).
FOUR_BIT_DTYPES = ("int4", "mxfp4", "nvfp4")

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8-e4m3": "fp8",
    "fp8-e5m2": "fp8",
    "float8": "fp8",
    "w4a16": "int4",
    "awq": "int4",
    "gptq": "int4",
    "fp4": "nvfp4",
    "auto": "auto",
}


def normalize_name(name: str) -> str:
    """Return the lookup key of a model or GPU name: lower case, '_' and spaces read as '-'."""
    return "-".join(name.strip().lower().replace("_", "-").split())


def canonical_dtype(field_name: str, dtype: str) -> str:
    """Return the canonical dtype name ('bf16', 'fp16', 'fp8', 'int8', 'int4', 'mxfp4' or 'nvfp4') of `dtype`.

    Raises:
        CostModelError: `dtype` is not one of the known dtypes or their aliases; the message lists them.
    """
    key = normalize_name(str(dtype))
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise CostModelError(f"{field_name} {dtype!r} is not a known dtype; known: {known}")
    return key


def _positive(field_name: str, value: float | None, owner: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CostModelError(f"{owner}: {field_name} must be a positive number, got {value!r}")


#: The keys of a calibration block (a GPU entry's "calibration"): CostModel keywords, in their units.
CALIBRATION_KEYWORDS = (
    "mfu",
    "mbu",
    "link_util",
    "overhead_s",
    "allreduce_latency_s",
    "kernel_launch_s",
    "per_token_s",
    "per_seq_s",
)


@dataclass(frozen=True, slots=True)
class GPUCalibration:
    """A calibration that travels with a GPU: the fitted CostModel keywords and what they were fitted on.

    Attributes:
        kwargs: (keyword, value) pairs of CALIBRATION_KEYWORDS (fractions; seconds for the *_s ones).
        source: what data the fit used, in words (printed in reports as the cost model's provenance).
        model: the model the data was measured on (a name, or a file's name).
        tp: its tensor-parallel degree.
        linear_flops_per_token_per_gpu: 2 x active layer parameters / tp of that model, FLOP: per_token_s
            is moved to another model in proportion to this.
    """

    kwargs: tuple[tuple[str, float], ...]
    source: str
    model: str
    tp: int
    linear_flops_per_token_per_gpu: float

    @staticmethod
    def from_dict(owner: str, data: dict[str, Any]) -> GPUCalibration:
        """Read a calibration block.

        Raises:
            CostModelError: a missing key or a value of the wrong type; the message names it.
        """
        where = f"{owner}: calibration"
        kwargs = tuple((k, json_number(data, k, where, inclusive=True)) for k in CALIBRATION_KEYWORDS if k in data)
        return GPUCalibration(
            kwargs=kwargs,
            source=json_str(data, "source", where),
            model=json_str(data, "model", where),
            tp=json_int(data, "tp", where, minimum=1),
            linear_flops_per_token_per_gpu=json_number(data, "linear_flops_per_token_per_gpu", where),
        )

    def as_dict(self) -> dict[str, Any]:
        """Return the calibration block as written in a GPU file."""
        return {
            "source": self.source,
            "model": self.model,
            "tp": self.tp,
            "linear_flops_per_token_per_gpu": self.linear_flops_per_token_per_gpu,
            **dict(self.kwargs),
        }


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One GPU's peak rates and memory, as the roofline needs them. All values are per GPU.

    Attributes:
        key: the lookup name (e.g. 'h100-sxm').
        name: the product name.
        bf16_flops_per_s, fp16_flops_per_s: dense Tensor-core peak, FLOP/s.
        fp8_flops_per_s: dense FP8 peak, FLOP/s; None when the GPU has no FP8 units (A100).
        int8_ops_per_s: dense INT8 peak, OP/s; None when unknown.
        fp4_flops_per_s: dense FP4 peak, FLOP/s (Blackwell's FP4 Tensor cores); None when the GPU has
            no FP4 units, so that NVFP4 weights are refused on it and MXFP4 weights run weight-only.
        w4a16_kernels: the GPU runs 4-bit weight-only GEMMs (weights dequantized to 16 bits in the
            kernel, e.g. Marlin, which needs NVIDIA compute capability 8.0 or later); False refuses
            int4 and (without FP4 units) mxfp4 weights.
        mem_bw_bytes_per_s: memory bandwidth, B/s.
        mem_bytes: memory capacity, bytes (marketed GB read as 10^9 B).
        link_bw_bytes_per_s: effective all-reduce bandwidth per GPU, per direction, B/s: the B of the
            ring formula t = 2(n-1)/n x S / B (NVIDIA nccl-tests doc/PERFORMANCE.md).
        link_bw_per_peer_bytes_per_s: for a switchless full mesh (MI300X), the per-direction bandwidth to
            one peer; a group of n GPUs then gets min(link_bw, (n-1) x this). None for switched fabrics.
        gpus_per_node: GPUs in one node; a parallel group of more GPUs spans nodes (default 8).
        internode_bw_bytes_per_s: per-GPU network bandwidth between nodes, per direction, B/s (default
            50e9: 400 Gb/s InfiniBand NDR or RoCE with one NIC per GPU, as in NVIDIA's DGX H100).
        aliases: other names this preset answers to.
        calibration: fitted efficiency and overhead terms for this GPU with their provenance, or None
            (costmodel.defaults.default_cost_model uses it).
        sources: where the numbers come from.
        link_source: how link_bw_bytes_per_s was derived.
        host_link_bw_bytes_per_s: the GPU's link to host (CPU) memory, per direction, B/s (PCIe, or a
            chip-to-chip link): what copies KV blocks to and from a CPU tier; None when not given.
        host_link_latency_s: the fixed cost of one batch of such copies, s; None when not given.
        host_link_source: where the host link figures come from.
    """

    key: str
    name: str
    bf16_flops_per_s: float
    fp16_flops_per_s: float
    fp8_flops_per_s: float | None
    int8_ops_per_s: float | None
    mem_bw_bytes_per_s: float
    mem_bytes: float
    link_bw_bytes_per_s: float
    link_bw_per_peer_bytes_per_s: float | None = None
    fp4_flops_per_s: float | None = None
    w4a16_kernels: bool = True
    gpus_per_node: int = 8
    internode_bw_bytes_per_s: float = 50e9
    aliases: tuple[str, ...] = ()
    calibration: GPUCalibration | None = field(default=None, compare=False)
    sources: tuple[str, ...] = field(default=(), compare=False)
    link_source: str = field(default="", compare=False)
    host_link_bw_bytes_per_s: float | None = None
    host_link_latency_s: float | None = None
    host_link_source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        owner = f"GPU {self.key!r}"
        for name in ("bf16_flops_per_s", "fp16_flops_per_s", "mem_bw_bytes_per_s", "mem_bytes"):
            _positive(name, getattr(self, name), owner)
        _positive("link_bw_bytes_per_s", self.link_bw_bytes_per_s, owner)
        for name in ("fp8_flops_per_s", "int8_ops_per_s", "fp4_flops_per_s", "link_bw_per_peer_bytes_per_s"):
            _positive(name, getattr(self, name), owner, allow_none=True)
        _positive("internode_bw_bytes_per_s", self.internode_bw_bytes_per_s, owner)
        _positive("host_link_bw_bytes_per_s", self.host_link_bw_bytes_per_s, owner, allow_none=True)
        lat = self.host_link_latency_s
        if lat is not None and (isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat < math.inf):
            raise CostModelError(f"{owner}: host_link_latency_s must be a number >= 0, got {lat!r}")
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise CostModelError(f"{owner}: gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")

    def peak_flops(self, dtype: str) -> float | None:
        """Return the dense GEMM peak in `dtype` ('bf16', 'fp16', 'fp8', 'int8'; 'mxfp4' and 'nvfp4' at
        the FP4 peak; 'int4', weight-only, None), FLOP/s; None if absent."""
        return {
            "bf16": self.bf16_flops_per_s,
            "fp16": self.fp16_flops_per_s,
            "fp8": self.fp8_flops_per_s,
            "int8": self.int8_ops_per_s,
            "mxfp4": self.fp4_flops_per_s,
            "nvfp4": self.fp4_flops_per_s,
            "int4": None,
        }[dtype]

    def check_weight_dtype(self, dtype: str) -> None:
        """Refuse 4-bit weights this GPU cannot run.

        Raises:
            CostModelError: nvfp4 on a GPU without FP4 units (fp4_flops_per_s None), or int4 or mxfp4
                (without FP4 units) on a GPU without 4-bit weight-only kernels; names dtype and GPU.
        """
        if dtype == "nvfp4" and self.fp4_flops_per_s is None:
            raise CostModelError(
                f"dtype nvfp4 needs FP4 Tensor cores (NVIDIA Blackwell), which {self.key} does not have; "
                "use mxfp4 or int4 (weight-only) or fp8"
            )
        if dtype in ("int4", "mxfp4") and self.fp4_flops_per_s is None and not self.w4a16_kernels:
            raise CostModelError(
                f"dtype {dtype} needs 4-bit weight-only GEMM kernels, which are not known to run on "
                f"{self.key} (w4a16_kernels false); use fp8 or bf16"
            )

    def allreduce_bw(self, tp: int) -> float:
        """Return the effective per-direction all-reduce bandwidth of a group of `tp` GPUs, B/s.

        Within a node it is the GPU link's; a group larger than gpus_per_node spans nodes, and every
        ring (or the inter-node stage of a hierarchical all-reduce) then crosses the network, so the
        bandwidth is the smaller of the link's and internode_bw_bytes_per_s.
        """
        local = min(tp, self.gpus_per_node)
        if self.link_bw_per_peer_bytes_per_s is None or local < 2:
            bw = self.link_bw_bytes_per_s
        else:
            bw = min(self.link_bw_bytes_per_s, (local - 1) * self.link_bw_per_peer_bytes_per_s)
        return bw if tp <= self.gpus_per_node else min(bw, self.internode_bw_bytes_per_s)

    def p2p_bw(self, crosses_nodes: bool) -> float:
        """Return the per-direction bandwidth of one GPU-to-GPU send (a pipeline stage's activations), B/s:
        the network's when the two GPUs are in different nodes, else the GPU link's."""
        if crosses_nodes:
            return min(self.link_bw_bytes_per_s, self.internode_bw_bytes_per_s)
        return self.link_bw_bytes_per_s


#: Marks a key of a JSON spec that has no default (json_value refuses its absence).
REQUIRED: Any = object()


def json_value(data: Mapping[str, Any], key: str, owner: str, default: Any = REQUIRED, label: str = "") -> Any:
    """Return data[key], or `default` when the key is absent.

    Raises:
        CostModelError: the key is absent and has no default; the message names it (as `label` when
            given, e.g. "peak_tflops['bf16']").
    """
    if key in data:
        return data[key]
    if default is REQUIRED:
        raise CostModelError(f"{owner}: missing key {label or key!r}")
    return default


def json_number(
    data: Mapping[str, Any],
    key: str,
    owner: str,
    default: Any = REQUIRED,
    *,
    inclusive: bool = False,
    label: str = "",
) -> float:
    """Return data[key] as a float: a JSON number (not a string, not true or false), finite and > 0
    (>= 0 when `inclusive`).

    Raises:
        CostModelError: the key is missing or the value is not such a number; the message names the key
            (or `label`) and the value as the file gives it.
    """
    value = json_value(data, key, owner, default, label)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not inclusive)
    ):
        what = "a number >= 0" if inclusive else "a positive number"
        raise CostModelError(f"{owner}: {label or key} must be {what}, got {value!r}")
    return float(value)


def json_optional_number(
    data: Mapping[str, Any], key: str, owner: str, *, inclusive: bool = False, label: str = ""
) -> float | None:
    """Return data[key] as json_number does, or None when the key is absent or null."""
    if data.get(key) is None:
        return None
    return json_number(data, key, owner, inclusive=inclusive, label=label)


def json_int(data: Mapping[str, Any], key: str, owner: str, default: Any = REQUIRED, *, minimum: int = 0) -> int:
    """Return data[key]: a JSON integer (not 2.0, not a string, not true or false) >= minimum.

    Raises:
        CostModelError: the key is missing or the value is not such an integer; names key and value.
    """
    value = json_value(data, key, owner, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CostModelError(f"{owner}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _json_typed(data: Mapping[str, Any], key: str, owner: str, default: Any, kind: type, what: str) -> Any:
    """Return data[key] when it is a `kind` (the JSON type the key must have, said as `what`).

    Raises:
        CostModelError: the key is missing or the value is of another type; names key and value.
    """
    value = json_value(data, key, owner, default)
    if not isinstance(value, kind):
        raise CostModelError(f"{owner}: {key} must be {what}, got {value!r}")
    return value


def json_bool(data: Mapping[str, Any], key: str, owner: str, default: bool) -> bool:
    """Return data[key]: JSON true or false (a string such as "false" is refused, not read as true).

    Raises:
        CostModelError: the value is not a JSON boolean; names key and value.
    """
    return cast(bool, _json_typed(data, key, owner, default, bool, "true or false"))


def json_str(data: Mapping[str, Any], key: str, owner: str, default: Any = REQUIRED) -> str:
    """Return data[key]: a JSON string.

    Raises:
        CostModelError: the key is missing or the value is not a string; names key and value.
    """
    return cast(str, _json_typed(data, key, owner, default, str, "a string"))


def json_strings(data: Mapping[str, Any], key: str, owner: str) -> tuple[str, ...]:
    """Return data[key]: a JSON list of strings (absent: empty).

    Raises:
        CostModelError: the value is not a list of strings; names key and value.
    """
    value = json_value(data, key, owner, ())
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise CostModelError(f"{owner}: {key} must be a list of strings, got {value!r}")
    return tuple(value)


def json_object(data: Mapping[str, Any], key: str, owner: str, default: Any = REQUIRED) -> dict[str, Any]:
    """Return data[key]: a JSON object.

    Raises:
        CostModelError: the key is missing or the value is not an object; names key and value.
    """
    return cast("dict[str, Any]", _json_typed(data, key, owner, default, dict, "an object"))


#: The dtypes of a GPU entry's peak_tflops object.
PEAK_KEYS = ("bf16", "fp16", "fp8", "int8", "fp4")


def gpu_from_dict(key: str, data: dict[str, Any]) -> GPUSpec:
    """Build a GPUSpec from one entry of the gpus.json format (units as in that file).

    Required keys: peak_tflops (an object with bf16; fp16 defaults to bf16; fp8, int8 and fp4 may be
    null or absent), mem_bw_GBps, mem_GB, link_GBps. Optional: w4a16_kernels (true or false, default
    true), name, link_per_peer_GBps, gpus_per_node (default 8), internode_GBps (default 50), aliases,
    sources, link_source, calibration (GPUCalibration.from_dict), host_link_GBps and
    host_link_latency_us (the link to host memory; absent: unknown), host_link_source. Numbers must be
    JSON numbers and booleans JSON booleans.

    Raises:
        CostModelError: a key is missing, or a value is of the wrong type or out of range; the message
            names the key as the file spells it and the value as the file gives it.
    """
    owner = f"GPU {key!r}"
    peaks = json_object(data, "peak_tflops", owner)
    unknown = sorted(set(peaks) - set(PEAK_KEYS))
    if unknown:
        raise CostModelError(
            f"{owner}: peak_tflops has unknown key {unknown[0]!r}; known: {', '.join(PEAK_KEYS)}"
        )

    def peak(dtype: str) -> float | None:
        value = json_optional_number(peaks, dtype, owner, label=f"peak_tflops[{dtype!r}]")
        return None if value is None else value * 1e12

    def gbps(name: str) -> float | None:
        value = json_optional_number(data, name, owner)
        return None if value is None else value * 1e9

    bf16 = json_number(peaks, "bf16", owner, label="peak_tflops['bf16']") * 1e12
    fp16 = json_number(peaks, "fp16", owner, label="peak_tflops['fp16']") * 1e12 if "fp16" in peaks else bf16
    host_lat = json_optional_number(data, "host_link_latency_us", owner, inclusive=True)
    calibration = json_value(data, "calibration", owner, None)
    return GPUSpec(
        key=key,
        name=json_str(data, "name", owner, key),
        bf16_flops_per_s=bf16,
        fp16_flops_per_s=fp16,
        fp8_flops_per_s=peak("fp8"),
        int8_ops_per_s=peak("int8"),
        fp4_flops_per_s=peak("fp4"),
        w4a16_kernels=json_bool(data, "w4a16_kernels", owner, True),
        mem_bw_bytes_per_s=json_number(data, "mem_bw_GBps", owner) * 1e9,
        mem_bytes=json_number(data, "mem_GB", owner) * 1e9,
        link_bw_bytes_per_s=json_number(data, "link_GBps", owner) * 1e9,
        link_bw_per_peer_bytes_per_s=gbps("link_per_peer_GBps"),
        gpus_per_node=json_int(data, "gpus_per_node", owner, 8, minimum=1),
        internode_bw_bytes_per_s=json_number(data, "internode_GBps", owner, 50) * 1e9,
        aliases=tuple(normalize_name(a) for a in json_strings(data, "aliases", owner)),
        sources=json_strings(data, "sources", owner),
        link_source=json_str(data, "link_source", owner, ""),
        host_link_bw_bytes_per_s=gbps("host_link_GBps"),
        host_link_latency_s=None if host_lat is None else host_lat * 1e-6,
        host_link_source=json_str(data, "host_link_source", owner, ""),
        calibration=None if not calibration else GPUCalibration.from_dict(
            owner, json_object(data, "calibration", owner)
        ),
    )


@cache
def _presets() -> dict[str, GPUSpec]:
    text = resources.files("stallfree.costmodel").joinpath("data/gpus.json").read_text(encoding="utf-8")
    return {
        normalize_name(k): gpu_from_dict(normalize_name(k), v) for k, v in json.loads(text)["gpus"].items()
    }


def gpu_to_dict(gpu: GPUSpec) -> dict[str, Any]:
    """Return a GPU as one entry of the gpus.json format (gpu_from_dict reads it back)."""

    def tf(value: float | None) -> float | None:
        return None if value is None else value / 1e12

    out: dict[str, Any] = {
        "key": gpu.key,
        "name": gpu.name,
        "aliases": list(gpu.aliases),
        "peak_tflops": {
            "bf16": tf(gpu.bf16_flops_per_s),
            "fp16": tf(gpu.fp16_flops_per_s),
            "fp8": tf(gpu.fp8_flops_per_s),
            "int8": tf(gpu.int8_ops_per_s),
            "fp4": tf(gpu.fp4_flops_per_s),
        },
        "w4a16_kernels": gpu.w4a16_kernels,
        "mem_bw_GBps": gpu.mem_bw_bytes_per_s / 1e9,
        "mem_GB": gpu.mem_bytes / 1e9,
        "link_GBps": gpu.link_bw_bytes_per_s / 1e9,
        "gpus_per_node": gpu.gpus_per_node,
        "internode_GBps": gpu.internode_bw_bytes_per_s / 1e9,
        "link_source": gpu.link_source,
        "sources": list(gpu.sources),
    }
    if gpu.link_bw_per_peer_bytes_per_s is not None:
        out["link_per_peer_GBps"] = gpu.link_bw_per_peer_bytes_per_s / 1e9
    if gpu.host_link_bw_bytes_per_s is not None:
        out["host_link_GBps"] = gpu.host_link_bw_bytes_per_s / 1e9
        out["host_link_source"] = gpu.host_link_source
    if gpu.host_link_latency_s is not None:
        out["host_link_latency_us"] = gpu.host_link_latency_s * 1e6
    if gpu.calibration is not None:
        out["calibration"] = gpu.calibration.as_dict()
    return out


def alias_index(presets: Mapping[str, GPUSpec | Any]) -> dict[str, str]:
    """Map each preset's key and each of its (normalized) aliases to the key; for GPUs and models alike."""
    index = {}
    for key, spec in presets.items():
        index[key] = key
        for alias in spec.aliases:
            index[alias] = key
    return index


def did_you_mean(name: str, index: Mapping[str, str]) -> str:
    """Return ' (did you mean 'x'?)' for the preset key closest to `name` among the keys and aliases of
    `index` (alias_index's map), or '' when none is close (difflib, ratio >= 0.6)."""
    from difflib import get_close_matches

    close = get_close_matches(normalize_name(name), list(index), n=1, cutoff=0.6)
    return f" (did you mean {index[close[0]]!r}?)" if close else ""


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON file that must hold one object (a user's GPU or model spec).

    Raises:
        CostModelFileError: the file is missing or cannot be opened.
        CostModelDataError: it is not UTF-8 JSON, does not hold a JSON object, is longer than
            stallfree._files.MAX_JSON_CHARS (256 MiB; /dev/zero is read only that far) or nested
            deeper than about 1,000 levels.
        (Both are CostModelError; the message names `what` and the path.)
    """
    p = Path(path)
    try:
        data = read_json(p)
    except FileLimitError as exc:
        raise CostModelDataError(f"cannot read {what} file: {exc}") from None
    except OSError as exc:
        raise CostModelFileError(f"cannot read {what} file {str(p)!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CostModelDataError(f"cannot read {what} file {str(p)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise CostModelDataError(f"{what} file {str(p)!r} must hold a JSON object")
    return data


@cache
def _alias_index() -> dict[str, str]:
    return alias_index(_presets())


def list_gpus() -> list[str]:
    """Return the preset GPU names, sorted."""
    return sorted(_presets())


def load_gpu_file(path: str | Path) -> GPUSpec:
    """Load a user GPU from a JSON file holding one entry of the gpus.json format.

    Raises:
        CostModelError: the file cannot be read or parsed, or an entry is bad (see gpu_from_dict).
    """
    p = Path(path)
    data = read_json_object(p, "GPU")
    return gpu_from_dict(normalize_name(str(data.get("key", p.stem))), data)


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """Return the GPU preset called `name`, or load it from `name` when that is a path to a .json file.

    Raises:
        CostModelError: the name is unknown (the message lists the known names) or the file is bad.
    """
    if isinstance(name, GPUSpec):
        return name
    if str(name).endswith(".json"):
        return load_gpu_file(name)
    key = _alias_index().get(normalize_name(str(name)))
    if key is None:
        raise CostModelError(
            f"unknown GPU {name!r}{did_you_mean(str(name), _alias_index())}; known GPUs: "
            f"{', '.join(list_gpus())} (or a path to a .json file)"
        )
    return _presets()[key]
