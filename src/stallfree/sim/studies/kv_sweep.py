"""A sweep over KV capacity: one simulation per KV size (prefix caching on or off, as the setup says),
answering "how large must the cache be": the prefix cache hit rate and TTFT p50/p99 against capacity.

Imports allowed: the standard library, stallfree.core, stallfree.costmodel and stallfree.sim;
below stallfree.sim.outputs.writers, which writes its rows and plot (plots.plot_kv_sweep).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stallfree.sim.inputs.setup import Setup
from stallfree.sim.studies.experiment import run_experiment

__all__ = ["KV_SWEEP_KEYS", "kv_sweep", "kv_sweep_lines", "kv_sweep_title", "preemption_inflated"]

#: The keys of each kv_sweep row.
KV_SWEEP_KEYS = (
    "kv_tokens", "prefix_caching", "prefix_cache_hit_rate", "prefix_cache_hit_rate_first_admission",
    "prefix_cache_hit_rate_bound",
    "prefix_cache_evictions", "median_ttft_ms", "p99_ttft_ms", "request_throughput", "output_throughput",
    "num_preemptions", "rejected", "num_requests", "hit_rate_inflated_by_preemption", "hardware",
)


def kv_sweep(
    make_setup: Callable[[int], Setup],
    kv_sizes: Sequence[int],
    budget: int,
    progress: Callable[[int, int], None] | None = None,
    batching: str = "chunked",
) -> list[dict[str, Any]]:
    """Simulate one batching mode (chunked by default) once per KV capacity, smallest first.

    Args:
        make_setup: kv_tokens -> the Setup of that run (the same workload and options otherwise).
        kv_sizes: KV capacities, tokens, each >= 1.
        budget: token budget per step.
        progress: called with (runs done, runs) after each run.
        batching: the batching mode of every run.

    Returns:
        One dict per size with the keys of KV_SWEEP_KEYS (hit rates are fractions, None without
        caching; latencies in ms, None when every request was rejected; throughput in requests/s and
        tokens/s; "hit_rate_inflated_by_preemption": caching on and requests preempted, whose
        readmissions count as lookups and hits, so that the rate can pass the infinite-cache bound;
        "prefix_cache_hit_rate_first_admission": the rate over first admissions only;
        "hardware": the setup's description of the replica, model, GPUs and dtype first).

    Raises:
        ValueError: kv_sizes is empty or holds a value < 1.
    """
    sizes = sorted(set(kv_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"`kv_sizes` needs sizes >= 1, got {list(kv_sizes)!r}")
    rows = []
    for k, kv in enumerate(sizes, start=1):
        setup = make_setup(kv)
        study = run_experiment(setup, batching=batching, budget=budget)
        summary = study.summaries[0]
        row = {key: summary.get(key) for key in KV_SWEEP_KEYS}
        row["kv_tokens"] = setup.kv_tokens
        if row["prefix_cache_hit_rate"] is not None:
            row["prefix_cache_hit_rate_first_admission"] = study.results[0].prefix_cache_hit_rate_first_admission
        row["prefix_caching"] = setup.prefix_caching
        row["rejected"] = summary.get("rejected", 0)
        row["hit_rate_inflated_by_preemption"] = bool(setup.prefix_caching and summary.get("num_preemptions"))
        row["hardware"] = setup.hardware
        rows.append(row)
        if progress:
            progress(k, len(sizes))
    return rows


def kv_sweep_title(rows: Sequence[dict[str, Any]], title: str) -> str:
    """The KV sweep figure's title: `title`, then on a second line the replica the rows ran on (the
    model, the GPUs and the dtype: the rows' "hardware" up to its first ';'), when they say."""
    hardware = rows[0].get("hardware") if rows else None
    if not hardware:
        return title
    return f"{title}\n{str(hardware).split(';', 1)[0].strip()}"


def preemption_inflated(row: dict[str, Any]) -> bool:
    """Whether the row's hit rate counts readmissions after preemption (caching on, requests preempted)."""
    return bool(row.get("hit_rate_inflated_by_preemption"))


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def kv_sweep_lines(rows: Sequence[dict[str, Any]], title: str) -> list[str]:
    """The KV sweep's text table: a header line (`title`, then the replica), the column names, one
    line per size; "-" for figures a run lacks (every request rejected, or caching off); rows whose hit
    rate readmissions after preemption inflate end in "*"."""
    lines = [f"kv sweep: {kv_sweep_title(rows, title).replace(chr(10), '; ')}"]
    lines.append(f"{'KV tokens':>13}  {'hit rate':>8}  {'1st adm.':>8}  {'bound':>6}  {'TTFT p50 ms':>11}  "
                 f"{'TTFT p99 ms':>11}  {'req/s':>7}  {'evictions':>9}  {'preempted':>9}  {'rejected':>8}")
    for r in rows:
        mark = " *" if preemption_inflated(r) else ""
        lines.append(
            f"{r['kv_tokens']:>13,}  {_fmt(r.get('prefix_cache_hit_rate'), '.1%'):>8}  "
            f"{_fmt(r.get('prefix_cache_hit_rate_first_admission'), '.1%'):>8}  "
            f"{_fmt(r.get('prefix_cache_hit_rate_bound'), '.1%'):>6}  {_fmt(r.get('median_ttft_ms'), ',.0f'):>11}  "
            f"{_fmt(r.get('p99_ttft_ms'), ',.0f'):>11}  {_fmt(r.get('request_throughput'), '.3f'):>7}  "
            f"{_fmt(r.get('prefix_cache_evictions'), ','):>9}  {_fmt(r.get('num_preemptions'), ','):>9}  "
            f"{_fmt(r.get('rejected'), ','):>8}{mark}"
        )
    if any(preemption_inflated(r) for r in rows):
        lines.append("* requests preempted: their readmissions count as lookups and hits, so the hit rate can "
                     "exceed the infinite-cache bound")
    if any(r.get("rejected") for r in rows):
        lines.append("rows with rejected requests measure the admitted requests only")
    return lines
