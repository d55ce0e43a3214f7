"""LoRA adapters in the simulator: which adapter each request names (a trace's `lora` column, or drawn
with Zipf popularity), where each replica keeps its adapters (GPU slots and a CPU cache), what loading
one costs, and the report's figures.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim (result, costs,
workload).

Residency, per replica (as vLLM's LRU adapter managers: `max_loras` GPU slots, `max_cpu_loras`
adapters in host memory, the GPU ones among them):

- before a step runs, every adapter of its plan that is not in a GPU slot is loaded: from host memory
  when the CPU cache holds it (bytes_per_gpu over each GPU's host link, all GPUs in parallel:
  latency + bytes_per_gpu / bandwidth), else first read from storage (bytes_total / STORAGE_READ_BPS)
  into the CPU cache, then copied. The loads are sequential and the step waits for them (vLLM
  activates a step's adapters before its forward pass), so they add to the step's time;
- the least recently used adapter not in the plan leaves its slot (and, in the CPU cache, the least
  recently used one not in a GPU slot or the plan). The scheduler's max_loras keeps the running
  requests' adapters within the slots, so a running request's adapter is never evicted;
- the step's LoRA GEMMs add LoraShape.gemm_time(tokens with an adapter, adapters in the step).

A request's `lora_load_s` is the load time of its adapter in the steps that loaded it for it (0 when
its adapter was in a GPU slot when it was admitted: a warm start); the report splits TTFT by cold and
warm starts.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stallfree.core.plan import StepPlan
from stallfree.costmodel.host_link import HostLink
from stallfree.costmodel.lora import LoraShape
from stallfree.sim.defaults import DEFAULT_LORA_RANK
from stallfree.sim.inputs.workload import Workload
from stallfree.sim.run.costs import StepCostModel
from stallfree.sim.run.result import SimResult

__all__ = [
    "DEFAULT_LORA_RANK",
    "STORAGE_READ_BPS",
    "AdapterCache",
    "LoraCost",
    "assign_loras",
    "lora_summary",
    "parse_popularity",
]

#: Reading an adapter from local storage, B/s: a PCIe 4.0 x4 NVMe SSD's sequential read (16 GT/s x 4 lanes,
#: 128b/130b = 7.9 GB/s raw; drives sold as "7,000 MB/s"). Our assumption: safetensors parsing is not counted.
STORAGE_READ_BPS = 7.0e9


def parse_popularity(text: str) -> float:
    """The Zipf exponent S of "zipf:S" (S >= 0; 0 is uniform).

    Raises:
        ValueError: any other text; the message quotes it.
    """
    kind, _, rest = text.strip().partition(":")
    try:
        s = float(rest)
    except ValueError:
        s = math.nan
    if kind != "zipf" or not math.isfinite(s) or s < 0 or s > 10:
        raise ValueError(f"adapter popularity {text!r}: expected zipf:S with 0 <= S <= 10 (zipf:0 is uniform)")
    return s


def assign_loras(wl: Workload, num_adapters: int, zipf_s: float, seed: int = 0) -> Workload:
    """`wl` with each request's adapter drawn independently: adapter k (named "lora-k", k = 0 .. N-1) with
    probability proportional to 1 / (k + 1)^S, so "lora-0" is the most popular.

    Raises:
        ValueError: num_adapters not an integer >= 1 or zipf_s out of range.
    """
    if isinstance(num_adapters, bool) or not isinstance(num_adapters, int) or num_adapters < 1:
        raise ValueError(f"number of adapters must be an integer >= 1, got {num_adapters!r}")
    if not (math.isfinite(zipf_s) and 0 <= zipf_s <= 10):
        raise ValueError(f"Zipf exponent must be from 0 to 10, got {zipf_s!r}")
    rng = random.Random(f"lora:{seed}")  # a stream of its own: lengths and arrivals stay as they were
    names = [f"lora-{k}" for k in range(num_adapters)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_adapters)]
    drawn = rng.choices(names, weights, k=len(wl))
    return replace(wl, loras=tuple(drawn), name=f"{wl.name}; {num_adapters} adapters zipf:{zipf_s:g}")


class AdapterCache:
    """One replica's adapters: `gpu_slots` in GPU memory, `cpu_slots` in host memory (the GPU ones among
    them), least recently used first out. Mutated by its LoraCost only.

    Attributes:
        gpu, cpu: adapter -> None, least recently used first.
        loads: adapters loaded into a GPU slot so far; storage_loads: of them, read from storage first.
    """

    __slots__ = ("gpu", "cpu", "gpu_slots", "cpu_slots", "loads", "storage_loads")

    def __init__(self, gpu_slots: int, cpu_slots: int) -> None:
        self.gpu: OrderedDict[Hashable, None] = OrderedDict()
        self.cpu: OrderedDict[Hashable, None] = OrderedDict()
        self.gpu_slots, self.cpu_slots = gpu_slots, cpu_slots
        self.loads = self.storage_loads = 0

    def bring(self, adapters: set[Hashable]) -> list[tuple[Hashable, bool]]:
        """Make every adapter of a step resident; return the ones loaded, with whether each came from
        storage (in the order loaded)."""
        out = []
        for a in sorted(adapters, key=str):  # a fixed order: the run does not depend on hashing
            if a in self.gpu:
                self.gpu.move_to_end(a)
                self.cpu.move_to_end(a)
                continue
            cold = a not in self.cpu
            # The GPU slot first: its adapter then stays in host memory only, where it may be evicted.
            self._evict(self.gpu, self.gpu_slots, adapters)
            if cold:
                self._evict(self.cpu, self.cpu_slots, adapters | set(self.gpu))
                self.storage_loads += 1
            self.cpu[a] = None
            self.cpu.move_to_end(a)
            self.gpu[a] = None
            self.loads += 1
            out.append((a, cold))
        return out

    @staticmethod
    def _evict(lru: OrderedDict[Hashable, None], slots: int, keep: set[Hashable]) -> None:
        """Free one place in `lru` when full, taking the least recently used adapter not in `keep` (none
        when all are kept: the place is then exceeded, which max_loras prevents for the GPU)."""
        if len(lru) < slots:
            return
        for a in lru:
            if a not in keep:
                del lru[a]
                return


@dataclass(frozen=True)
class LoraCost:
    """A step cost model plus LoRA: loading adapters a step needs and its LoRA GEMMs (module docstring).

    Unbound (`step_time`), it prices a plan with `inner` alone (a time-budget controller's probes);
    each replica prices its steps through `bind_replica(res)`, which keeps that replica's AdapterCache
    and writes its requests' lora_load_s. Other attributes are read through to `inner`.

    Args:
        inner: the step cost model.
        shape: the adapters' size and GEMM price (stallfree.costmodel.lora.lora_shape).
        link: each GPU's host link.
        max_loras: GPU slots per replica (the scheduler's max_loras).
        max_cpu_loras: adapters in host memory per replica, >= max_loras.
        storage_bps: reading an adapter from storage, B/s.
    """

    inner: StepCostModel
    shape: LoraShape
    link: HostLink
    max_loras: int
    max_cpu_loras: int
    storage_bps: float = STORAGE_READ_BPS

    def __post_init__(self) -> None:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}), "
                             "as vLLM requires: adapters in GPU slots are kept in host memory too")

    def step_time(self, plan: StepPlan) -> float:
        """The inner model's time of `plan`, s (no residency without a replica)."""
        return self.inner.step_time(plan)

    def load_time(self, from_storage: bool) -> float:
        """Seconds to load one adapter into a GPU slot: the host link copy of bytes_per_gpu, after
        reading bytes_total from storage when it is not in host memory."""
        t = self.link.copy_time(self.shape.bytes_per_gpu)
        return t + self.shape.bytes_total / self.storage_bps if from_storage else t

    def bind_replica(self, res: SimResult) -> _BoundLoraCost:
        """The pricer of one replica's steps, writing into its result `res` (res.lora names the adapters)."""
        return _BoundLoraCost(self, res, AdapterCache(self.max_loras, self.max_cpu_loras))

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class _BoundLoraCost:
    """LoraCost for one replica: its AdapterCache, and the result whose lora_load_s and counters it writes."""

    __slots__ = ("cost", "res", "cache", "_inner_time", "_names")

    def __init__(self, cost: LoraCost, res: SimResult, cache: AdapterCache) -> None:
        self.cost, self.res, self.cache = cost, res, cache
        bind = getattr(cost.inner, "bind_replica", None)  # the inner model's per-replica state (a step cache)
        self._inner_time = (cost.inner if bind is None else bind(res)).step_time
        self._names: Sequence[Hashable | None] = res.lora or ()

    def step_time(self, plan: StepPlan) -> float:
        """Load the plan's adapters that are not in a GPU slot, then price the step: inner time + loads +
        LoRA GEMMs, s."""
        t = self._inner_time(plan)
        names = self._names
        if not names:
            return t  # a run whose requests name no adapter (built around this workload's)
        tokens: dict[Hashable, int] = {}
        lora_tokens = 0
        counts = plan.decode_tokens or (1,) * plan.num_decodes
        for rid, n in zip(plan.decode_rids, counts, strict=True):
            a = names[rid]  # type: ignore[call-overload]
            if a is not None:
                tokens[a] = tokens.get(a, 0) + n
                lora_tokens += n
        firsts: list[tuple[int, Hashable]] = []
        for c in plan.prefills:
            a = names[c.rid]  # type: ignore[call-overload]
            if a is not None:
                tokens[a] = tokens.get(a, 0) + c.num_tokens
                lora_tokens += c.num_tokens
                firsts.append((c.rid, a))  # type: ignore[arg-type]
        if not tokens:
            return t
        loaded = self.cache.bring(set(tokens))
        if loaded:
            cost = self.cost
            took = {a: cost.load_time(cold) for a, cold in loaded}
            t += sum(took.values())
            res = self.res
            res.lora_loads += len(loaded)
            res.lora_storage_loads += sum(cold for _, cold in loaded)
            assert res.lora_load_s is not None
            for rid, a in firsts:  # the prompts (new or recomputed) whose adapter came in for them
                if a in took:
                    res.lora_load_s[rid] += took[a]
        return t + self.cost.shape.gemm_time(lora_tokens, len(tokens))


def lora_summary(res: SimResult, lat: dict[str, Any]) -> dict[str, Any] | None:
    """The report's LoRA figures (None without adapters): adapters named, requests on an adapter,
    lora_loads (adapters loaded into a GPU slot; from storage: lora_storage_loads), the mean load per
    cold start, ms, and TTFT mean/median/p99, ms, of cold starts (lora_load_s > 0) against warm ones
    (an adapter already in a GPU slot) and of base-model requests."""
    if res.lora is None or res.lora_load_s is None:
        return None
    import numpy as np

    names, loads = res.lora, res.lora_load_s
    done = lat["rids"]
    ttft = lat["ttft"]
    groups: dict[str, list[float]] = {"cold": [], "warm": [], "base": []}
    for i, rid in enumerate(done):
        kind = "base" if names[rid] is None else ("cold" if loads[rid] > 0 else "warm")
        groups[kind].append(float(ttft[i]) * 1e3)
    out: dict[str, Any] = {
        "num_adapters": len({a for a in names if a is not None}),
        "lora_requests": sum(a is not None for a in names),
        "lora_loads": res.lora_loads,
        "lora_storage_loads": res.lora_storage_loads,
        "mean_lora_load_ms": (sum(x for x in loads if x > 0) / max(1, sum(1 for x in loads if x > 0))) * 1e3,
    }
    for kind, xs in groups.items():
        arr = np.asarray(xs)
        out[f"{kind}_requests"] = len(xs)
        out[f"mean_ttft_ms_{kind}"] = float(arr.mean()) if len(xs) else None
        out[f"median_ttft_ms_{kind}"] = float(np.median(arr)) if len(xs) else None
        out[f"p99_ttft_ms_{kind}"] = float(np.percentile(arr, 99)) if len(xs) else None
    return out
