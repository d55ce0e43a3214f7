"""A sweep over the size of a CPU KV tier (prefix caching on, the GPU cache fixed): one simulation per
tier size, answering "how much host memory is worth adding for KV": the hit rate by tier and TTFT
p50/p99 against the tier's tokens (and the host memory they take).

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim;
matplotlib lazily (the plot).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.experiment import run_experiment

__all__ = ["TIER_SWEEP_KEYS", "plot_tier_sweep", "tier_sweep", "tier_sweep_lines"]

#: The keys of each tier_sweep row.
TIER_SWEEP_KEYS = (
    "cpu_kv_tokens", "cpu_kv_bytes", "kv_tokens", "prefix_cache_hit_rate", "prefix_cache_hit_rate_first_admission",
    "hit_rate_gpu", "hit_rate_cpu", "first_admission_hit_rate_gpu", "first_admission_hit_rate_cpu",
    "prefix_cache_hit_rate_bound", "kv_loads", "kv_offloads", "median_ttft_ms", "p99_ttft_ms",
    "request_throughput", "num_preemptions", "rejected", "num_requests", "hardware",
)


def tier_sweep(
    make_setup: Callable[[int], Setup],
    cpu_sizes: Sequence[int],
    budget: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Simulate chunked batching with prefix caching once per CPU tier size, smallest first (0: none).

    Args:
        make_setup: cpu_kv_tokens -> the Setup of that run (0: GPU-only caching); the rest the same.
        cpu_sizes: tier sizes, tokens, each >= 0.
        budget: token budget per step.
        progress: called with (runs done, runs) after each run.

    Returns:
        One dict per size with the keys of TIER_SWEEP_KEYS (rates are fractions of the tokens looked
        up; latencies in ms; cpu_kv_bytes: host memory of the tier, bytes over all ranks, 0 without one).

    Raises:
        ValueError: cpu_sizes is empty or holds a value < 0.
    """
    sizes = sorted(set(cpu_sizes))
    if not sizes or sizes[0] < 0:
        raise ValueError(f"`cpu_sizes` needs sizes >= 0, got {list(cpu_sizes)!r}")
    rows = []
    for k, cpu in enumerate(sizes, start=1):
        setup = make_setup(cpu)
        study = run_experiment(setup, batching="chunked", budget=budget)
        summary = study.summaries[0]
        res = study.results[0]
        tier = summary.get("kv_tier") or {}
        hit = summary.get("prefix_cache_hit_rate") or 0.0
        first = res.prefix_cache_hit_rate_first_admission or 0.0
        row: dict[str, Any] = {key: summary.get(key) for key in TIER_SWEEP_KEYS}
        row.update(
            cpu_kv_tokens=setup.cpu_kv_tokens, cpu_kv_bytes=setup.cpu_kv_tokens * setup.kv_bytes_per_token,
            kv_tokens=setup.kv_tokens, prefix_cache_hit_rate_first_admission=first,
            hit_rate_gpu=tier.get("hit_rate_gpu", hit), hit_rate_cpu=tier.get("hit_rate_cpu", 0.0),
            first_admission_hit_rate_gpu=tier.get("first_admission_hit_rate_gpu", first),
            first_admission_hit_rate_cpu=tier.get("first_admission_hit_rate_cpu", 0.0),
            kv_loads=tier.get("kv_loads", 0), kv_offloads=tier.get("kv_offloads", 0),
            rejected=summary.get("rejected", 0), hardware=setup.hardware,
        )
        rows.append(row)
        if progress:
            progress(k, len(sizes))
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def tier_sweep_lines(rows: Sequence[dict[str, Any]], title: str) -> list[str]:
    """The tier sweep's text table: the title, the column names, one line per tier size."""
    lines = [f"cpu tier sweep: {title}"]
    lines.append(f"{'CPU tokens':>12}  {'GiB':>7}  {'hit':>6}  {'GPU':>6}  {'CPU':>6}  {'1st adm':>7}  "
                 f"{'1st CPU':>7}  {'bound':>6}  {'TTFT p50':>9}  {'TTFT p99':>9}  {'req/s':>6}  {'loads':>9}")
    for r in rows:
        lines.append(
            f"{r['cpu_kv_tokens']:>12,}  {r['cpu_kv_bytes'] / 2**30:>7,.1f}  "
            f"{_fmt(r.get('prefix_cache_hit_rate'), '.1%'):>6}  {_fmt(r.get('hit_rate_gpu'), '.1%'):>6}  "
            f"{_fmt(r.get('hit_rate_cpu'), '.1%'):>6}  "
            f"{_fmt(r.get('prefix_cache_hit_rate_first_admission'), '.1%'):>7}  "
            f"{_fmt(r.get('first_admission_hit_rate_cpu'), '.1%'):>7}  "
            f"{_fmt(r.get('prefix_cache_hit_rate_bound'), '.1%'):>6}  {_fmt(r.get('median_ttft_ms'), ',.0f'):>9}  "
            f"{_fmt(r.get('p99_ttft_ms'), ',.0f'):>9}  {_fmt(r.get('request_throughput'), '.3f'):>6}  "
            f"{_fmt(r.get('kv_loads'), ','):>9}"
        )
    lines.append("hit rates are fractions of the prompt tokens looked up; 1st adm: first admissions only; "
                 "TTFT in ms; GiB: host memory of the tier over all ranks")
    return lines


def plot_tier_sweep(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Write a PNG: first-admission hit rate by tier (GPU, CPU stacked, the bound dashed) and TTFT
    p50/p99 against the tier's tokens; the run without a tier is drawn at the left edge as "0".

    Args:
        rows: tier_sweep's rows.
        path: the PNG to write.
        title: the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['cpu_kv_tokens'] / 1e6:.3g}M" if r['cpu_kv_tokens'] else "0" for r in rows]
    xs = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    gpu = [r["first_admission_hit_rate_gpu"] for r in rows]
    cpu = [r["first_admission_hit_rate_cpu"] for r in rows]
    ax1.bar(xs, gpu, label="GPU tier")
    ax1.bar(xs, cpu, bottom=gpu, label="CPU tier")
    bound = next((r["prefix_cache_hit_rate_bound"] for r in rows if r.get("prefix_cache_hit_rate_bound")), None)
    if bound is not None:
        ax1.axhline(bound, ls="--", color="gray", label=f"infinite cache ({bound:.1%})")
    top = max([g + c for g, c in zip(gpu, cpu, strict=True)] + [bound or 0.0])
    ax1.set(xlabel="CPU KV tier (tokens)", ylabel="hit rate, first admissions", ylim=(0, min(1.0, top * 1.4 + 0.02)))
    ax1.legend(loc="upper left", fontsize="small")
    ax2.plot(xs, [(r.get("median_ttft_ms") or 0) / 1e3 for r in rows], "o-", label="TTFT p50")
    ax2.plot(xs, [(r.get("p99_ttft_ms") or 0) / 1e3 for r in rows], "s-", label="TTFT p99")
    ax2.set(xlabel="CPU KV tier (tokens)", ylabel="TTFT (s)", yscale="log")
    ax2.legend(loc="upper right", fontsize="small")
    for ax in (ax1, ax2):
        ax.set_xticks(xs, labels)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
