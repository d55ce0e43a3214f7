"""What a tuning search says: the `stallfree serve` flags of its choice, the report (rows, choice and why),
and the best candidate of each kind.

Imports allowed: the standard library, stallfree.core and stallfree.sim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stallfree.sim.studies.tune import ROW_KEYS, TuneResult

__all__ = [
    "best_by_kind",
    "partial_prefill_flags",
    "serve_command",
    "tune_report",
]


def serve_command(row: dict[str, Any]) -> str:
    """The `stallfree serve` flags of a chosen candidate (with the partial-prefill flags when it has them)."""
    line = f"stallfree serve --max-num-batched-tokens {row['token_budget']} --max-num-seqs {row['max_seqs']}"
    return line + partial_prefill_flags(row)


def partial_prefill_flags(row: dict[str, Any]) -> str:
    """A candidate's partial-prefill flags, vLLM's names (with a leading space), or "" when it has none."""
    pp = row.get("partial_prefills")
    if not pp:
        return ""
    k, lng, thr = pp
    return f" --max-num-partial-prefills {k} --max-long-partial-prefills {lng} --long-prefill-token-threshold {thr}"


def tune_report(result: TuneResult, header: dict[str, Any], vllm_serve: str | None = None) -> dict[str, Any]:
    """Return the JSON report of a tune: header, SLOs (s), the bound, the chosen row, the serve lines
    ("serve": `stallfree serve`'s flags; "vllm_serve": `vllm_serve`, the `vllm serve` line of the simulated
    replica that the command prints, when given; both None when no candidate meets the SLOs: `slo_met` is
    then false), every row, the wall time (s)."""
    bound = None
    if result.bound is not None:
        b = result.bound
        bound = {
            "token_budget": b.token_budget,
            "num_decodes": b.num_decodes,
            "decode_context": b.decode_context,
            "chunk_start": b.chunk_start,
            "decode_floor_ms": b.decode_floor_s * 1e3,
            "step_ms": b.step_s * 1e3,
        }
    return {
        "header": header,
        "slo_ttft_s": result.slo_ttft,
        "slo_tpot_s": result.slo_tpot,
        "bound": bound,
        "chosen": {k: result.best.get(k) for k in ROW_KEYS}
        | ({"range": result.best["range"]} if "range" in result.best else {}),
        "slo_met": result.slo_met,
        "slo_attainment_target": result.attainment_target,
        "attainment": result.attainment,
        "attainment_met": result.attainment_met,
        "serve": serve_command(result.best) if result.slo_met else None,
        "vllm_serve": vllm_serve if result.slo_met else None,
        "rows": [{k: r.get(k) for k in ROW_KEYS} for r in result.rows],
        "wall_s": result.wall_s,
    }


def best_by_kind(rows: Sequence[dict[str, Any]], base_max_seqs: int) -> list[dict[str, Any]]:
    """The best setting of each kind a tune searched, from its ranked rows (best first).

    Kinds: "token_budget" (the best of the rows at the base max_seqs without partial prefills),
    "max_seqs" (the best of the rows at that budget without partial prefills) and, when any row has
    them, "partial_prefills" (the best of those rows, (K, L, T)).

    Returns:
        [{"kind", "value", "tried" (distinct values simulated, ascending), "request_goodput",
        "slo_attainment", "p99_tpot_ms"}], in that order; a kind with no row is left out.
    """
    out: list[dict[str, Any]] = []

    def add(kind: str, pool: list[dict[str, Any]], key: str, tried: set[Any]) -> dict[str, Any] | None:
        if not pool:
            return None
        row = pool[0]
        out.append({"kind": kind, "value": row[key], "tried": sorted(tried),
                    **{k: row.get(k) for k in ("request_goodput", "slo_attainment", "p99_tpot_ms")}})
        return row

    plain = [r for r in rows if not r.get("partial_prefills")]
    budget_row = add("token_budget", [r for r in plain if r["max_seqs"] == base_max_seqs] or plain,
                     "token_budget", {r["token_budget"] for r in rows})
    if budget_row is not None:
        add("max_seqs", [r for r in plain if r["token_budget"] == budget_row["token_budget"]], "max_seqs",
            {r["max_seqs"] for r in rows})
    pp = [r for r in rows if r.get("partial_prefills")]
    add("partial_prefills", pp, "partial_prefills", {tuple(r["partial_prefills"]) for r in pp})
    return out
