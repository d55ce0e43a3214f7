"""The price of a CPU KV tier's copies: KV blocks loaded from host memory into GPU blocks, and offloaded
the other way, over the GPU's host link (gpus.json: host_link_GBps, host_link_latency_us; SOURCES.md).

Imports allowed: the standard library, stallfree.core and stallfree.costmodel.

Overlap (a choice, documented in docs/prefix_caching.md):

- loads (StepPlan.kv_loads, host to GPU) are on the critical path: the step's forward pass waits for
  them (its chunks read the loaded blocks), so they add latency + loaded bytes / bandwidth to the step.
  No layer-by-layer pipelining is assumed: an upper bound of what a pipelined load costs.
- offloads (StepPlan.kv_offloads, GPU to host) overlap the step's compute: an engine copies a cached
  block to the host in the background (vLLM's offloading connector stores asynchronously; a block can
  be copied as soon as it is computed, long before it is evicted), on the other direction of the
  full-duplex link, so they cost only what they exceed the step by: the step takes
  max(compute, latency + offloaded bytes / bandwidth), then its loads.

Under tensor parallelism each rank copies its own share of each block over its own link, so the bytes
are those of one GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from stallfree.core.plan import StepPlan
from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.hardware import GPUSpec

__all__ = ["HostLink", "KVTransferCost", "host_link", "kv_offloading_tokens"]


class _Priced(Protocol):
    def step_time(self, plan: StepPlan) -> float: ...


@dataclass(frozen=True, slots=True)
class HostLink:
    """A GPU's link to host memory.

    Args:
        bandwidth_bytes_per_s: per direction, B/s, > 0.
        latency_s: the fixed cost of one batch of copies, s, >= 0.
        source: where the figures come from.

    Raises:
        CostModelError: a figure out of range; the message names it.
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth_bytes_per_s, (int, float)) and 0 < self.bandwidth_bytes_per_s < math.inf):
            raise CostModelError(f"host link bandwidth must be a number of B/s > 0, got {self.bandwidth_bytes_per_s!r}")
        if not (isinstance(self.latency_s, (int, float)) and 0 <= self.latency_s < math.inf):
            raise CostModelError(f"host link latency must be a number of s >= 0, got {self.latency_s!r}")

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` bytes one way: latency + nbytes / bandwidth; 0 for nothing."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s if nbytes > 0 else 0.0


def host_link(gpu: GPUSpec) -> HostLink:
    """The host link of `gpu` (gpus.json's host_link_GBps and host_link_latency_us).

    Raises:
        CostModelError: the GPU gives no host link figures; the message names the GPU and the keys.
    """
    if gpu.host_link_bw_bytes_per_s is None or gpu.host_link_latency_s is None:
        raise CostModelError(
            f"GPU {gpu.key!r} gives no host link (host_link_GBps, host_link_latency_us), which prices a CPU KV "
            "tier's copies; add them to a GPU file"
        )
    return HostLink(gpu.host_link_bw_bytes_per_s, gpu.host_link_latency_s, gpu.host_link_source)


def kv_offloading_tokens(size_gib: float, kv_bytes_per_token_per_gpu: float, tp: int) -> int:
    """Tokens of KV that `size_gib` GiB of host memory holds, the size summed over the `tp` ranks (vLLM's
    --kv-offloading-size): floor(size_gib x 2^30 / (tp x kv_bytes_per_token_per_gpu)).

    Raises:
        CostModelError: size_gib not a finite number >= 0, or bytes per token not > 0.
    """
    if isinstance(size_gib, bool) or not isinstance(size_gib, (int, float)) or not 0 <= size_gib < math.inf:
        raise CostModelError(f"--kv-offloading-size must be a number of GiB >= 0, got {size_gib!r}")
    if not kv_bytes_per_token_per_gpu > 0 or tp < 1:
        raise CostModelError(f"KV bytes per token per GPU must be > 0 and tp >= 1, got "
                             f"{kv_bytes_per_token_per_gpu!r}, {tp!r}")
    return int(size_gib * 2**30 // (tp * kv_bytes_per_token_per_gpu))


@dataclass(frozen=True, slots=True)
class KVTransferCost:
    """A step cost model plus the step's CPU-tier copies (module docstring: loads before the forward
    pass, offloads overlapping it).

    step_time(plan) = max(inner.step_time(plan), copy(offloads)) + copy(loads), where copy(n) =
    latency + n x block_bytes / bandwidth (0 for none). Attributes of `inner` (kv_capacity_tokens, ...)
    are read through.

    Args:
        inner: the step cost model (anything with step_time(plan) -> s).
        link: the GPU's host link.
        block_bytes_per_gpu: bytes of one KV block on one GPU: block_size x KV bytes per token per GPU.

    Raises:
        CostModelError: block_bytes_per_gpu not > 0.
    """

    inner: _Priced
    link: HostLink
    block_bytes_per_gpu: float

    def __post_init__(self) -> None:
        if not self.block_bytes_per_gpu > 0:
            raise CostModelError(f"block_bytes_per_gpu must be > 0, got {self.block_bytes_per_gpu!r}")

    def copy_time(self, blocks: int) -> float:
        """Seconds to copy `blocks` blocks one way (0 for none)."""
        return self.link.copy_time(blocks * self.block_bytes_per_gpu)

    def step_time(self, plan: StepPlan) -> float:
        """max(the inner model's time of `plan`, its offloads' time) + its loads' time, s."""
        t = self.inner.step_time(plan)
        if plan.kv_offloads:
            t = max(t, self.copy_time(len(plan.kv_offloads)))
        if plan.kv_loads:
            t += self.copy_time(len(plan.kv_loads))
        return t

    def __getattr__(self, name: str) -> object:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
