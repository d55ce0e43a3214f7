"""Fit an engine profile (stallfree.sim.inputs.engine_profile) on part of the measured closed-loop rows of
aiconfigurator-core's systems/silicon_sample.csv, and report its error on the rows it never saw.

    python benchmarks/fit_engine_profile.py --kernels vllm --fit-model llama-3.1-70b --name vllm --write

The rule (docs/fidelity.md): fit on the vLLM rows of the model named by --fit-model (default
Llama-3.1-70B: the most rows, both GPUs, TP 1 to 8), on H100 and H200; report on the other dense
models' vLLM rows there (--report-model, default Qwen3-32B and Llama-3.1-8B-FP8). The fit is
linear and in two stages, each a reason that carries over to other models:

1. TPOT, on the decode-dominated fit rows (ISL <= OSL: a request's TPOT is then the time of steps that
   are nearly all decodes) whose requests all fit the KV cache at once (concurrency x (ISL + OSL) <= the
   replay's KV tokens: otherwise the simulated TPOT is the scheduler's queueing and preemption, not a
   step's time). In a closed loop's steady state a request's TPOT is the mean time of the steps
   it decodes in, and nearly every step samples about `concurrency` tokens; so the engine's CPU time beyond
   the priced steps shows as measured TPOT - simulated TPOT = step + per_sampled x concurrency. A
   least-squares fit of that residual on (1, concurrency), each term kept >= 0 (a negative term is set to
   0 and the other refitted), gives step_s and per_sampled_s. The prefill-heavy rows (ISL > OSL) are left
   out of this stage: what their TPOT lacks grows as 1 / TP (prefill chunks priced short on the GPU), which
   a CPU term must not absorb.
2. TTFT, on all fit rows. With those step terms the rows are replayed again; what TTFT still lacks is what
   the client waits before the engine sees the request: frontend_s = the median of measured - simulated
   TTFT (clamped at 0).

--write stores the profile as NAME in src/stallfree/sim/data/engine_profiles.json with the rows, the
command and the fit-row errors. Needs aiconfigurator-core (the rows, and the kernel tables for --kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from stallfree.core.metrics import percentile
from stallfree.sim.inputs.engine_profile import PROFILES_FILE, EngineProfile
from stallfree.validate.silicon import REQUESTS_PER_ROW, bundled_csv, read_rows, replay_row, select

DATA = Path(__file__).resolve().parents[1] / "src" / "stallfree" / "sim" / "data" / PROFILES_FILE


def _replay(rows: list[Any], profile: EngineProfile, kernels: str, k: int) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        try:
            out.append(replay_row(r, profile, kernels, k))
        except ValueError as exc:
            print(f"  skipped line {r.line}: {exc}", file=sys.stderr)
    return out


def _nonneg_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a, b >= 0 (a negative term set to 0, the other refitted)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if a < 0:
        a = 0.0
        sx2 = sum(x * x for x in xs)
        b = max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sx2) if sx2 > 0 else 0.0
    if b < 0:
        b, a = 0.0, max(0.0, my)
    return a, b


def _errors(done: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for m in ("ttft", "tpot"):
        apes = [d[f"{m}_ape_pct"] for d in done if d[f"{m}_ape_pct"] is not None]
        out[f"{m}_median_ape_pct"] = round(percentile(apes, 50.0), 1)
        out[f"{m}_p90_ape_pct"] = round(percentile(apes, 90.0), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    """Fit, report and (with --write) store the profile."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="vllm", help="the step pricing the terms add to (default vllm)")
    p.add_argument("--fit-model", default="llama-3.1-70b", help="rows whose model contains this are fitted on")
    p.add_argument("--report-model", default="qwen3-32b,llama-3.1-8b", help="rows reported on")
    p.add_argument("--gpu", default="h100-sxm,h200", help="GPUs of the rows (default h100-sxm,h200)")
    p.add_argument("--requests-per-row", type=int, default=REQUESTS_PER_ROW)
    p.add_argument("--name", default="vllm", help="the profile's name (default vllm)")
    p.add_argument("--write", action="store_true", help=f"store the profile in {DATA.name}")
    a = p.parse_args(argv)
    rows = read_rows(bundled_csv())
    fit_rows = select(rows, model=a.fit_model, gpu=a.gpu, engine="vllm", mode="agg")
    report_rows = select(rows, model=a.report_model, gpu=a.gpu, engine="vllm", mode="agg")
    k = a.requests_per_row
    print(f"fit on {len(fit_rows)} rows ({a.fit_model}), report on {len(report_rows)} ({a.report_model}); "
          f"--kernels {a.kernels}, {k} x concurrency requests per row")
    base = _replay(fit_rows, EngineProfile("none"), a.kernels, k)
    decode_rows = [d for d in base if d["tpot_ape_pct"] is not None and d["isl"] <= d["osl"]
                   and d["concurrency"] * (d["isl"] + d["osl"]) <= d["kv_tokens"]]
    xs = [float(d["concurrency"]) for d in decode_rows]
    ys = [(d["measured_tpot_ms"] - d["sim_tpot_ms"]) * 1e-3 for d in decode_rows]
    print(f"stage 1 (TPOT) on the {len(decode_rows)} decode-dominated fit rows that fit the KV cache")
    step_s, per_s = _nonneg_fit(xs, ys)
    stepped = _replay(fit_rows, EngineProfile("fit", step_s, per_s), a.kernels, k)
    front_s = max(0.0, statistics.median((d["measured_ttft_ms"] - d["sim_ttft_ms"]) * 1e-3 for d in stepped))
    cmd = (f"python benchmarks/fit_engine_profile.py --kernels {a.kernels} --fit-model {a.fit_model} "
           f"--gpu {a.gpu} --requests-per-row {k} --name {a.name}")
    prof = EngineProfile(a.name, step_s, per_s, front_s, pricing=a.kernels,
                         fitted_on=f"{len(fit_rows)} vLLM agg rows of aiconfigurator-core 0.12.0 "
                                   f"systems/silicon_sample.csv whose model contains {a.fit_model!r}, on {a.gpu} "
                                   f"(step terms on the {len(decode_rows)} with ISL <= OSL whose requests all "
                                   f"fit the KV cache; front end on all), "
                                   f"{k} x concurrency requests per row",
                         command=cmd)
    print(prof.describe())
    fitted = _replay(fit_rows, prof, a.kernels, k)
    report_none = _replay(report_rows, EngineProfile("none"), a.kernels, k)
    report = _replay(report_rows, prof, a.kernels, k)
    errs = {"fit_rows_without_profile": _errors(base), "fit_rows_with_profile": _errors(fitted),
            "report_rows_without_profile": _errors(report_none), "report_rows_with_profile": _errors(report)}
    for key, e in errs.items():
        print(f"  {key}: {e}")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for kind, done in (("without profile", base + report_none), ("with profile", fitted + report)):
        for d in done:
            groups.setdefault((d["model"], d["system"], kind), []).append(d)
    for (model, system, kind), done in sorted(groups.items()):
        print(f"  {model} on {system}, {kind} ({len(done)} rows): {_errors(done)}")
    if a.write:
        data = json.loads(DATA.read_text(encoding="utf-8"))
        old = data["profiles"].get(a.name, {})
        entry = {"version": str(int(old.get("version", "1")) + 1) if old else "1", **prof.to_json()}
        entry["errors"] = errs
        data["profiles"][a.name] = entry
        DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote profile {a.name!r} to {DATA}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
