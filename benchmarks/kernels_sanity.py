"""Check: are kernel-priced steps sane on GPUs with no measured end-to-end runs here (A100-SXM-80GB, L40S),
beside H100 SXM where they were validated? Three references, none of them the rows the engine profile
was fitted on:

1. the package's own step estimator for the same static shape (EngineHandle.decode_step_latency,
   predict_prefill_latency): the same tables through the package's code, so a mapping error of ours
   (system, version, dtype, op list) shows as a ratio away from 1;
2. the floor (stallfree's roofline at efficiency 1.0, no overheads: datasheet bandwidth and dense peak):
   a lower bound, so `floor / kernels` is the memory-bandwidth or compute utilization the tables imply
   and must lie in (0, 1];
3. the step time relative to H100 SXM, against the datasheet ratio (bandwidth for decodes, dense BF16
   peak for prefills).

Run: PYTHONPATH=src python benchmarks/kernels_sanity.py [--json]   (about 30 s; needs aiconfigurator-core)

Models: Llama-3.1-8B tp 1, Qwen3-32B tp 2, Llama-3.1-70B tp 4, bf16, vLLM's `current` tables of each
GPU (0.24.0 on H100 and L40S, 0.14.0 on A100).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from stallfree.costmodel import get_gpu, get_model
from stallfree.costmodel.kernels import KernelCostModel
from stallfree.costmodel.roofline import CostModel

GPUS = ("h100-sxm", "a100-sxm-80gb", "l40s")
CASES = (("llama-3.1-8b", 1), ("qwen3-32b", 2), ("llama-3.1-70b", 4))
DECODES = ((1, 1024), (32, 1024), (128, 2048))
PROMPTS = (1024, 4096)


def _shapes(km: KernelCostModel, floor: CostModel) -> list[tuple[str, float, float, float]]:
    h, out = km.tables.handle, []
    for b, start in DECODES:
        out.append((f"decode {b} x {start}", km.decode_step_time(b, start),
                    h.decode_step_latency(b, start - 1, 2) * 1e-3, floor.decode_step_time(b, start)))
    for p in PROMPTS:
        out.append((f"prefill {p}", km.prefill_step_time(p), h.predict_prefill_latency(1, p) * 1e-3,
                    floor.prefill_step_time(p)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    ref: dict[tuple[str, str], float] = {}
    for gpu in GPUS:
        g = get_gpu(gpu)
        for name, tp in CASES:
            spec = get_model(name)
            km = KernelCostModel(spec, g, tp, "bf16", engine="vllm")
            floor = CostModel(spec, g, tp, "bf16")
            h100 = get_gpu("h100-sxm")
            for shape, ours, est, low in _shapes(km, floor):
                key = (name, shape)
                if gpu == "h100-sxm":
                    ref[key] = ours
                datasheet = (h100.mem_bw_bytes_per_s / g.mem_bw_bytes_per_s if shape.startswith("decode")
                             else h100.bf16_flops_per_s / g.bf16_flops_per_s)
                rows.append({"gpu": gpu, "tables": f"{km.tables.system} vllm {km.version}", "model": name, "tp": tp,
                             "shape": shape, "kernels_ms": ours * 1e3, "estimator_ratio": ours / est,
                             "utilization": low / ours, "vs_h100": ours / ref[key], "datasheet_vs_h100": datasheet})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'gpu':<14} {'tables':<20} {'model':<14} {'tp':>2} {'shape':<18} {'kernels ms':>10} "
          f"{'/estimator':>10} {'floor/kern':>10} {'vs H100':>8} {'datasheet':>9}")
    for r in rows:
        print(f"{r['gpu']:<14} {r['tables']:<20} {r['model']:<14} {r['tp']:>2} {r['shape']:<18} "
              f"{r['kernels_ms']:>10.2f} {r['estimator_ratio']:>10.4f} {r['utilization']:>10.2f} "
              f"{r['vs_h100']:>8.2f} {r['datasheet_vs_h100']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
