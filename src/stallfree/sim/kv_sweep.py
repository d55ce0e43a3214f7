"""A sweep over KV capacity: one simulation per KV size (prefix caching on or off, as the setup says),
answering "how large must the cache be": the prefix cache hit rate and TTFT p50/p99 against capacity.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim;
matplotlib lazily (the plot).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.experiment import run_experiment
from stallfree.sim.setup import HardwareOptions, Setup

__all__ = ["KV_SWEEP_KEYS", "kv_sweep", "kv_sweep_title", "plot_kv_sweep"]

#: The keys of each kv_sweep row.
KV_SWEEP_KEYS = (
    "kv_tokens", "prefix_caching", "prefix_cache_hit_rate", "prefix_cache_hit_rate_bound",
    "prefix_cache_evictions", "median_ttft_ms", "p99_ttft_ms", "request_throughput", "output_throughput",
    "num_preemptions", "rejected", "hardware",
)


def kv_sweep(
    make_setup: Callable[[int], Setup],
    kv_sizes: Sequence[int],
    budget: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Simulate chunked batching once per KV capacity, smallest first.

    Args:
        make_setup: kv_tokens -> the Setup of that run (the same workload and options otherwise).
        kv_sizes: KV capacities, tokens, each >= 1.
        budget: token budget per step.
        progress: called with (runs done, runs) after each run.

    Returns:
        One dict per size with the keys of KV_SWEEP_KEYS (hit rates are fractions, None without
        caching; latencies in ms; throughput in requests/s and tokens/s; "hardware": the setup's
        description of the replica, model, GPUs and dtype first).

    Raises:
        ValueError: kv_sizes is empty or holds a value < 1.
    """
    sizes = sorted(set(kv_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--kv-tokens needs sizes >= 1, got {list(kv_sizes)!r}")
    rows = []
    for k, kv in enumerate(sizes, start=1):
        setup = make_setup(kv)
        study = run_experiment(setup, batching="chunked", budget=budget)
        summary = study.summaries[0]
        row = {key: summary.get(key) for key in KV_SWEEP_KEYS}
        row["kv_tokens"] = setup.kv_tokens
        row["prefix_caching"] = setup.prefix_caching
        row["rejected"] = summary.get("rejected", 0)
        row["hardware"] = setup.hardware
        rows.append(row)
        if progress:
            progress(k, len(sizes))
    return rows


def with_kv_tokens(setup_options: HardwareOptions, kv: int) -> HardwareOptions:
    """`setup_options` with its KV capacity override set to `kv` tokens."""
    return dataclasses.replace(setup_options, kv_tokens=kv)


def kv_sweep_title(rows: Sequence[dict[str, Any]], title: str) -> str:
    """The KV sweep figure's title: `title`, then on a second line the replica the rows ran on (the
    model, the GPUs and the dtype: the rows' "hardware" up to its first ';'), when they say."""
    hardware = rows[0].get("hardware") if rows else None
    if not hardware:
        return title
    return f"{title}\n{str(hardware).split(';', 1)[0].strip()}"


def plot_kv_sweep(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Write a PNG: hit rate (with the infinite-cache bound) and TTFT p50/p99 against KV capacity.

    Args:
        rows: kv_sweep's rows.
        path: the PNG to write.
        title: the figure's title (workload, budget); kv_sweep_title adds the model and GPUs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv = [r["kv_tokens"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    hit = [r["prefix_cache_hit_rate"] for r in rows]
    if any(h is not None for h in hit):
        ax1.plot(kv, [h or 0.0 for h in hit], "o-", label="achieved")
        bound = rows[0].get("prefix_cache_hit_rate_bound")
        if bound is not None:
            ax1.axhline(bound, ls="--", color="gray", label=f"infinite cache ({bound:.1%})")
    ax1.set(xscale="log", xlabel="KV capacity (tokens)", ylabel="prefix cache hit rate", ylim=(0, 1))
    ax1.legend(loc="upper left")
    ax2.plot(kv, [r["median_ttft_ms"] / 1e3 for r in rows], "o-", label="TTFT p50")
    ax2.plot(kv, [r["p99_ttft_ms"] / 1e3 for r in rows], "s-", label="TTFT p99")
    ax2.set(xscale="log", yscale="log", xlabel="KV capacity (tokens)", ylabel="TTFT (s)")
    ax2.legend(loc="upper right")
    fig.suptitle(kv_sweep_title(rows, title))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
