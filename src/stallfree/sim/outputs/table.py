"""The console table of one or more runs' summaries (rich, loaded lazily).

Imports allowed: the standard library and stallfree.sim.outputs; rich only lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stallfree.sim.outputs.buckets import table_rows as bucket_table_rows
from stallfree.sim.outputs.wording import rate_text

__all__ = [
    "print_table",
]


#: A row's format: a format string, or a function of the value (rate_text: a light load never reads 0.00).
_Spec = str | Callable[[Any], str]

_TABLE_ROWS: tuple[tuple[str, str, _Spec], ...] = (
    ("completed", "completed requests", "{:,}"),
    ("rejected_by_reason.context_length", "rejected: over context length", "{:,}"),
    ("rejected_by_reason.kv_capacity", "rejected: never fits the KV", "{:,}"),
    ("request_throughput", "requests/s", rate_text),
    ("output_throughput", "output tokens/s", "{:,.0f}"),
    ("request_goodput", "goodput (req/s)", rate_text),
    ("slo_attainment", "SLO attainment", "{:.1%}"),
    ("mean_ttft_ms", "TTFT mean (ms)", "{:,.1f}"),
    ("median_ttft_ms", "TTFT median (ms)", "{:,.1f}"),
    ("p90_ttft_ms", "TTFT p90 (ms)", "{:,.1f}"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "{:,.1f}"),
    ("mean_tpot_ms", "TPOT mean (ms)", "{:,.2f}"),
    ("median_tpot_ms", "TPOT median (ms)", "{:,.2f}"),
    ("p90_tpot_ms", "TPOT p90 (ms)", "{:,.2f}"),
    ("p99_tpot_ms", "TPOT p99 (ms)", "{:,.2f}"),
    ("mean_itl_ms", "ITL mean (ms)", "{:,.2f}"),
    ("p99_itl_ms", "ITL p99 (ms)", "{:,.2f}"),
    ("mean_e2el_ms", "E2E mean (ms)", "{:,.0f}"),
    ("p99_e2el_ms", "E2E p99 (ms)", "{:,.0f}"),
    ("mean_queue_ms", "queueing mean (ms)", "{:,.1f}"),
    ("p99_queue_ms", "queueing p99 (ms)", "{:,.1f}"),
    ("mean_tokens_per_step", "tokens/step", "{:,.1f}"),
    ("budget_utilization", "budget utilization", "{:.1%}"),
    ("mean_running_decodes", "running decodes (mean)", "{:,.1f}"),
    ("mean_kv_utilization", "KV utilization mean", "{:.1%}"),
    ("max_kv_utilization", "KV utilization max", "{:.1%}"),
    ("num_preemptions", "preemptions", "{:,}"),
    ("num_recomputed_tokens", "recomputed tokens", "{:,}"),
    ("prefix_cache_hit_rate", "prefix cache hit rate", "{:.1%}"),
    ("prefix_cache_hit_rate_bound", "prefix cache hit bound (infinite cache)", "{:.1%}"),
    ("prefix_cache_evictions", "prefix cache evictions", "{:,}"),
    ("kv_tier.cpu_kv_tokens", "CPU KV tier (tokens)", "{:,}"),
    ("kv_tier.hit_rate_gpu", "hit rate, GPU tier", "{:.1%}"),
    ("kv_tier.hit_rate_cpu", "hit rate, CPU tier", "{:.1%}"),
    ("kv_tier.first_admission_hit_rate_gpu", "1st-admission hit rate, GPU tier", "{:.1%}"),
    ("kv_tier.first_admission_hit_rate_cpu", "1st-admission hit rate, CPU tier", "{:.1%}"),
    ("kv_tier.kv_loads", "KV blocks loaded from CPU", "{:,}"),
    ("kv_tier.kv_offloads", "KV blocks offloaded to CPU", "{:,}"),
    ("lora.lora_loads", "LoRA adapter loads", "{:,}"),
    ("lora.lora_storage_loads", "LoRA loads from storage", "{:,}"),
    ("lora.mean_ttft_ms_cold", "TTFT mean, cold adapter (ms)", "{:,.1f}"),
    ("lora.mean_ttft_ms_warm", "TTFT mean, warm adapter (ms)", "{:,.1f}"),
    ("num_steps", "steps", "{:,}"),
    ("sim_wall_s", "simulation wall time (s)", "{:,.2f}"),
)


def _value(summary: dict[str, Any], key: str) -> Any:
    """A summary's value; "a.b" reads key b of the dict at a (0 when the dict lacks it)."""
    if "." not in key:
        return summary.get(key)
    outer, inner = key.split(".", 1)
    d = summary.get(outer)
    return None if d is None else d.get(inner, 0)


def _fmt(value: Any, spec: _Spec) -> str:
    if value is None:
        return "-"
    return spec(value) if callable(spec) else spec.format(value)


def _by_side(summary: dict[str, Any], key: str) -> bool:
    """Whether a disaggregated run's cell of `key` is stated per side (its summary's `sides`)."""
    return summary.get("sides") is not None and summary.get(key) is None and key in summary["sides"].get("decode", {})


def _side_text(summary: dict[str, Any], key: str, spec: _Spec) -> str:
    """"P x | D y": a disaggregated run's per-step figure on its prefill side and on its decode side."""
    sides = summary["sides"]
    return f"P {_fmt(sides['prefill'].get(key), spec)} | D {_fmt(sides['decode'].get(key), spec)}"


def _range_text(summary: dict[str, Any], key: str, spec: _Spec) -> str:
    """" [low-high]" of a latency key when the run carries its range (stallfree.sim.studies.ranges), else ""."""
    span = (summary.get("range") or {}).get(key)
    if not span:
        return ""
    return f" [{_fmt(span[0], spec)}-{_fmt(span[1], spec)}]"


def console() -> Any:
    """A rich Console for stdout; wide when stdout is not a terminal, so piped tables are not cut."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=200)


def print_table(summaries: Sequence[dict[str, Any]], title: str | None = None) -> None:
    """Print summaries side by side on the terminal (rich), one column per run."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for s in summaries:
        table.add_column(str(s.get("label", "")), justify="right")
    for key, name, spec in _TABLE_ROWS:
        if all(s.get(key) is None for s in summaries) and key in ("request_goodput", "slo_attainment"):
            continue
        if key.startswith("kv_tier.") and all(s.get("kv_tier") is None for s in summaries):
            continue
        if key.startswith("lora.") and all(s.get("lora") is None for s in summaries):
            continue
        # The cache rows when caching is on in any run; "-" in a run without it.
        if key.startswith("prefix_cache_") and all(s.get("prefix_cache_hit_rate") is None for s in summaries):
            continue
        if key.startswith("prefix_cache_"):  # a disaggregated run's sides have no prefix caching
            table.add_row(name, *("not modelled" if s.get("sides") is not None else
                                  _fmt(_value(s, key) if s.get("prefix_cache_hit_rate") is not None else None, spec)
                                  for s in summaries))
            continue
        table.add_row(name, *(_side_text(s, key, spec) if _by_side(s, key) else
                              _fmt(_value(s, key), spec) + _range_text(s, key, spec) for s in summaries))
        if key == "p99_queue_ms":
            for title, cells in bucket_table_rows(summaries):
                table.add_row(title, *cells)
            for title, cells in _session_rows(summaries):
                table.add_row(title, *cells)
    console().print(table)


#: The most turns whose TTFT the table shows one row each (the JSON has every turn).
_TABLE_TURNS = 10


def _session_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Rows of a session run (ttft_by_turn, sessions): mean | p99 TTFT by turn for the first turns, the
    sessions completed and those ended early; none when no run has sessions."""
    if all(s.get("ttft_by_turn") is None for s in summaries):
        return []
    turns = sorted({t["turn"] for s in summaries for t in s.get("ttft_by_turn") or ()})[:_TABLE_TURNS]
    rows = []
    for k in turns:
        cells = []
        for s in summaries:
            t = next((t for t in s.get("ttft_by_turn") or () if t["turn"] == k), None)
            cells.append("-" if t is None else f"{t['mean_ttft_ms']:,.1f} | {t['p99_ttft_ms']:,.1f}")
        rows.append((f"TTFT mean | p99 (ms), turn {k}", cells))
    done = [None if s.get("sessions") is None else s["sessions"] for s in summaries]
    rows.append(("sessions completed", ["-" if x is None else f"{x['completed']:,} of {x['num_sessions']:,}"
                                        for x in done]))
    rows.append(("sessions ended early", ["-" if x is None else f"{sum(x['ended_by_reason'].values()):,}"
                                          for x in done]))
    return rows
