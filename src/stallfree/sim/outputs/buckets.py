"""Latency by prompt length: TTFT, TPOT and E2E of the requests in each prompt-length bucket, so that
what a long-prompt option does to short prompts (and the reverse) can be read from the report.

Imports allowed: the standard library; numpy lazily.

The buckets are half-open intervals of prompt tokens, lo <= prompt_len < hi, with 1k = 1,024 tokens:
"<1k" [0, 1,024), "1k-4k" [1,024, 4,096), "4k-32k" [4,096, 32,768) and "32k+" [32,768, inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["PROMPT_BUCKETS", "bucket_stats", "prompt_bucket", "table_rows"]

#: (name, lo, hi) in prompt tokens, lo inclusive, hi exclusive.
PROMPT_BUCKETS: tuple[tuple[str, int, float], ...] = (
    ("<1k", 0, 1024),
    ("1k-4k", 1024, 4096),
    ("4k-32k", 4096, 32768),
    ("32k+", 32768, math.inf),
)


def prompt_bucket(prompt_len: int) -> str:
    """The name of the bucket of a prompt of `prompt_len` tokens (PROMPT_BUCKETS).

    Raises:
        ValueError: prompt_len < 0.
    """
    if prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0 tokens, got {prompt_len!r}")
    for name, lo, hi in PROMPT_BUCKETS:
        if lo <= prompt_len < hi:
            return name
    raise AssertionError("unreachable: the last bucket is unbounded")


def bucket_stats(lat: dict[str, Any], prompt_lens: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per prompt-length bucket with at least one finished request: requests, and the median and
    p99 of TTFT, TPOT and E2E, ms.

    Args:
        lat: stallfree.sim.outputs.report.latency_arrays of a run (rids, ttft, tpot, tpot_rids, e2e; s).
        prompt_lens: every request's prompt length, tokens, indexed by rid.

    Returns:
        {bucket name: {"requests", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_e2el_ms", "p99_e2el_ms"}}, in PROMPT_BUCKETS order; a TPOT figure is None when no
        request of the bucket emitted two tokens.
    """
    import numpy as np

    # The lengths in their own integer type where they are an array (a view, not a copy: a run of millions of
    # requests holds its latency arrays meanwhile); each bucket's values are made one figure at a time.
    plen = np.asarray(prompt_lens)
    if plen.dtype.kind not in "iu":
        plen = np.asarray(prompt_lens, dtype=np.int64)
    out: dict[str, dict[str, Any]] = {}
    done_len = plen[lat["rids"]] if len(lat["rids"]) else np.empty(0, dtype=np.int64)
    tpot_len = plen[lat["tpot_rids"]] if len(lat["tpot_rids"]) else np.empty(0, dtype=np.int64)
    for name, lo, hi in PROMPT_BUCKETS:
        mine = (done_len >= lo) & (done_len < hi)
        if not mine.any():
            continue
        row: dict[str, Any] = {"requests": int(mine.sum())}
        tmine = (tpot_len >= lo) & (tpot_len < hi)
        for key, column, chosen in (("ttft", "ttft", mine), ("tpot", "tpot", tmine), ("e2el", "e2e", mine)):
            values = lat[column][chosen]
            for q, label in ((50, "median"), (99, "p99")):
                row[f"{label}_{key}_ms"] = float(np.percentile(values, q) * 1e3) if len(values) else None
            del values
        out[name] = row
    return out


def table_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Rows for the terminal table: per bucket any run has, "TTFT / TPOT / E2E p50|p99 (ms)" cells
    ("-" for a run without that bucket)."""
    names = [b for b, _, _ in PROMPT_BUCKETS if any(b in (s.get("by_prompt_len") or {}) for s in summaries)]
    rows = []
    for b in names:
        for key, title, spec in (("ttft", "TTFT", "{:,.0f}"), ("tpot", "TPOT", "{:,.1f}"), ("e2el", "E2E", "{:,.0f}")):
            cells = []
            for s in summaries:
                r = (s.get("by_prompt_len") or {}).get(b)
                if r is None or r[f"median_{key}_ms"] is None:
                    cells.append("-")
                    continue
                cells.append(f"{spec.format(r[f'median_{key}_ms'])} | {spec.format(r[f'p99_{key}_ms'])}")
            n = max(((s.get("by_prompt_len") or {}).get(b) or {}).get("requests", 0) for s in summaries)
            rows.append((f"{title} p50 | p99 (ms), prompt {b}" + (f" ({n:,} req)" if key == "ttft" else ""), cells))
    return rows
