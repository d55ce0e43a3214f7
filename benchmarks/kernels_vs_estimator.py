"""Check: the measured-kernel cost model against aiconfigurator-core's own step estimator, on the
shapes where both apply (decode-only steps of equal contexts; one whole prompt), per model and GPU.

Run: PYTHONPATH=src python benchmarks/kernels_vs_estimator.py [--json] [--new]

Models: Llama-3.1-8B (tp 1), Qwen3-32B (tp 2; the package's bundled config.json, read as a user's
config file would be) and Llama-3.1-70B (tp 4), bf16, on H100 SXM and H200, vLLM's current tables.
Ratio = our step time / the estimator's (EngineHandle.decode_step_latency at isl = start - 1, osl = 2,
whose s = isl + osl // 2 + 1 keys equal a decode at `start`; predict_prefill_latency(1, prompt)).

--new: the newer decoders instead, each built by the package's own model class from the config.json it
bundles (DeepSeek-V3 and Kimi-K2: MLA and shared experts; gpt-oss: windowed layers and MXFP4 experts;
Qwen3-235B-A22B, Llama 4 Scout; DeepSeek-V3 in NVFP4 on B200). Where the package's MoE graph has no
lm_head, a prefill's ratio is taken less our lm_head GEMM (column `less lm_head`).

--moe: the MoE models of the held-out list at TP 1, 2, 4 and 8 (MOE_CASES: Mixtral-8x7B, Mixtral-8x22B,
Qwen3-30B-A3B, bf16, vLLM's current tables, where the weights fit), against the package's estimator built
with its own default MoE routing (power law, alpha 1.2), where ours prices an MoE of at most
BALANCED_ROUTING_MAX_EXPERTS experts on balanced routing: decode-only steps as above, and mixed steps
(b decodes at `start` plus one chunk of c prompt tokens) against the estimator's decode step plus its
prefill of the chunk (two steps' fixed costs: a bound, read for how it moves with tp, not its level).

--dp: data-parallel attention (DP_CASES: D attention ranks of tp GPUs, experts over ep), where the
estimator's batch is one rank's: our decode_step_time of D x b decodes against its decode step of b, and our
step of D whole prompts of p tokens (one per rank) against its prefill of one prompt of p.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from typing import Any

from stallfree.costmodel import get_gpu, get_model, model_from_hf_config
from stallfree.costmodel.kernels import KernelCostModel

DECODES = ((1, 512), (32, 1024), (128, 4096))
PROMPTS = (512, 2048, 8192)


def _qwen3_32b() -> tuple[Any, dict[str, Any]]:
    text = resources.files("aiconfigurator_core").joinpath("model_configs/Qwen--Qwen3-32B_config.json").read_text()
    config = json.loads(text)
    return model_from_hf_config("qwen3-32b", config), config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--new", action="store_true", help="the newer decoders (MLA, windows, 4-bit)")
    ap.add_argument("--dp", action="store_true", help="data-parallel attention (DP_CASES)")
    ap.add_argument("--moe", action="store_true", help="the MoE models at TP 1, 2, 4, 8 (MOE_CASES)")
    ap.add_argument("--gpu", default="h100-sxm", help="--moe: the GPU (default h100-sxm)")
    a = ap.parse_args()
    if a.moe:
        return _report(_moe_rows(a.gpu), a.json)
    if a.dp:
        return _report(_dp_rows(), a.json)
    if a.new:
        return _report(_new_rows(), a.json)
    qwen, qcfg = _qwen3_32b()
    cases = [("llama-3.1-8b", get_model("llama-3.1-8b"), None, 1), ("qwen3-32b", qwen, qcfg, 2),
             ("llama-3.1-70b", get_model("llama-3.1-70b"), None, 4)]
    rows = []
    for gpu in ("h100-sxm", "h200"):
        for name, spec, cfg, tp in cases:
            km = KernelCostModel(spec, get_gpu(gpu), tp, "bf16", engine="vllm", config=cfg)
            h = km.tables.handle
            for b, start in DECODES:
                ours, est = km.decode_step_time(b, start), h.decode_step_latency(b, start - 1, 2) * 1e-3
                rows.append({"gpu": gpu, "model": name, "tp": tp, "shape": f"decode {b} x {start}",
                             "ours_ms": ours * 1e3, "estimator_ms": est * 1e3, "ratio": ours / est})
            for p in PROMPTS:
                ours, est = km.prefill_step_time(p), h.predict_prefill_latency(1, p) * 1e-3
                rows.append({"gpu": gpu, "model": name, "tp": tp, "shape": f"prefill {p}",
                             "ours_ms": ours * 1e3, "estimator_ms": est * 1e3, "ratio": ours / est})
    return _report(rows, a.json)


#: (model, gpu, tp, dtype, engine) of the newer decoders.
NEW_CASES = (
    ("deepseek-v3", "h200", 8, "fp8", "vllm"),
    ("deepseek-v3", "h200", 8, "fp8", "sglang"),
    ("deepseek-v3", "h200", 8, "fp8", "trtllm"),
    ("kimi-k2", "h200", 8, "fp8", "vllm"),
    ("gpt-oss-120b", "h100-sxm", 1, "mxfp4", "vllm"),
    ("gpt-oss-120b", "h200", 1, "mxfp4", "vllm"),
    ("qwen3-235b-a22b", "h200", 4, "fp8", "vllm"),  # block FP8: 1,536 / tp must be 128-aligned
    ("llama-4-scout", "h200", 8, "bf16", "vllm"),
    ("deepseek-v3", "b200", 8, "nvfp4", "trtllm"),
)


def _new_rows() -> list[dict[str, Any]]:
    rows = []
    for name, gpu, tp, dtype, engine in NEW_CASES:
        km = KernelCostModel(get_model(name), get_gpu(gpu), tp, dtype, engine=engine)
        h, label = km.tables.handle, f"{name} {dtype} {engine}"
        for b, start in DECODES:
            ours, est = km.decode_step_time(b, start), h.decode_step_latency(b, start - 1, 2) * 1e-3
            rows.append({"gpu": gpu, "model": label, "tp": tp, "shape": f"decode {b} x {start}",
                         "ours_ms": ours * 1e3, "estimator_ms": est * 1e3, "ratio": ours / est})
        head = km.logits_s(1) if km.tables.logits < 0 else 0.0
        for p in PROMPTS:
            ours, est = km.prefill_step_time(p), h.predict_prefill_latency(1, p) * 1e-3
            rows.append({"gpu": gpu, "model": label, "tp": tp, "shape": f"prefill {p}", "ours_ms": ours * 1e3,
                         "estimator_ms": est * 1e3, "ratio": ours / est, "less_lm_head": (ours - head) / est})
    return rows


#: The MoE models of the held-out list, each at every tp its bf16 weights fit.
MOE_CASES = (("mixtral-8x7b", (1, 2, 4, 8)), ("mixtral-8x22b", (4, 8)), ("qwen3-30b-a3b", (1, 2, 4, 8)))
#: (decodes, their context) of the MoE decode steps: a serving batch's sizes, where the routing matters.
MOE_DECODES = ((1, 512), (32, 1024), (64, 2048), (96, 2048), (128, 2048), (128, 4096))
#: (decodes, their context, prefill chunk tokens) of the mixed steps.
MIXED = ((32, 1024, 512), (128, 2048, 1024))


def _default_routing_handle(km: KernelCostModel, tp: int) -> Any:
    """The package's estimator of km's configuration with its default MoE routing (power law): built
    afresh, past the tables' caches, with the balanced-routing rule off."""
    import json as _json
    from unittest import mock

    from stallfree.costmodel import kernel_tables

    config = km._config  # the config.json handed to the package
    with mock.patch.object(kernel_tables, "BALANCED_ROUTING_MAX_EXPERTS", 0):
        tables, _ = kernel_tables._build_tables(config, _json.dumps(config, sort_keys=True), km.tables.system,
                                                "vllm", km.version, tp, km.dtype, km.kv_dtype)
    return tables.handle


def _moe_rows(gpu: str) -> list[dict[str, Any]]:
    from stallfree.core.plan import ScheduledChunk, StepPlan

    rows = []
    for name, tps in MOE_CASES:
        for tp in tps:
            try:
                km = KernelCostModel(get_model(name), get_gpu(gpu), tp, "bf16", engine="vllm")
            except ValueError as exc:
                rows.append({"gpu": gpu, "model": name, "tp": tp, "shape": f"not priced: {exc}"[:60],
                             "ours_ms": 0.0, "estimator_ms": 0.0, "ratio": float("nan")})
                continue
            h = _default_routing_handle(km, tp)
            for b, start in MOE_DECODES:
                ours, est = km.decode_step_time(b, start), h.decode_step_latency(b, start - 1, 2) * 1e-3
                rows.append({"gpu": gpu, "model": name, "tp": tp, "shape": f"decode {b} x {start}",
                             "ours_ms": ours * 1e3, "estimator_ms": est * 1e3, "ratio": ours / est})
            for b, start, c in MIXED:
                plan = StepPlan(0, tuple(range(b)), (start,) * b, (ScheduledChunk(b, c, True, 0, True),), b + c,
                                b * start, b + c)
                ours = km.step_time(plan)
                est = (h.decode_step_latency(b, start - 1, 2) + h.predict_prefill_latency(1, c)) * 1e-3
                rows.append({"gpu": gpu, "model": name, "tp": tp, "shape": f"mixed {b} x {start} + {c}",
                             "ours_ms": ours * 1e3, "estimator_ms": est * 1e3, "ratio": ours / est})
    return rows


#: (model, gpu, tp, dp_attention, ep, dtype, engine) of the data-parallel attention checks.
DP_CASES = (
    ("deepseek-v3", "h200", 1, 8, 8, "fp8", "sglang"),
    ("deepseek-v3", "h200", 1, 8, 8, "fp8", "trtllm"),
    ("deepseek-v3", "h200", 1, 8, 8, "fp8", "vllm"),
    ("deepseek-v3", "b200", 1, 8, 8, "nvfp4", "trtllm"),
    ("kimi-k2", "h200", 2, 4, 8, "fp8", "vllm"),
    ("qwen3-235b-a22b", "h200", 1, 8, 8, "fp8", "vllm"),
    ("gpt-oss-120b", "h200", 1, 4, 4, "mxfp4", "vllm"),
)


def _dp_rows() -> list[dict[str, Any]]:
    from stallfree.core.plan import ScheduledChunk, StepPlan

    rows = []
    for name, gpu, tp, dp, ep, dtype, engine in DP_CASES:
        km = KernelCostModel(get_model(name), get_gpu(gpu), tp, dtype, engine=engine, ep=ep, dp_attention=dp)
        h, label = km.tables.handle, f"{name} {dtype} {engine} dp{dp} ep{ep}"
        for b, start in DECODES:
            ours, est = km.decode_step_time(dp * b, start), h.decode_step_latency(b, start - 1, 2) * 1e-3
            rows.append({"gpu": gpu, "model": label, "tp": tp, "shape": f"decode {dp} x {b} x {start}",
                         "ours_ms": ours * 1e3, "estimator_ms": est * 1e3, "ratio": ours / est})
        head = km.logits_s(1) if km.tables.logits < 0 else 0.0
        for p in PROMPTS:
            plan = StepPlan(0, (), (), tuple(ScheduledChunk(i, p, True, 0, True) for i in range(dp)), dp * p, 0, dp * p)
            ours, est = km.step_time(plan), h.predict_prefill_latency(1, p) * 1e-3
            rows.append({"gpu": gpu, "model": label, "tp": tp, "shape": f"prefill {dp} x {p}", "ours_ms": ours * 1e3,
                         "estimator_ms": est * 1e3, "ratio": ours / est, "less_lm_head": (ours - head) / est})
    return rows


def _report(rows: list[dict[str, Any]], as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'gpu':<9} {'model':<30} {'tp':>2} {'shape':<20} {'ours ms':>9} {'estimator ms':>12} {'ratio':>9} "
          f"{'less lm_head':>12}")
    for r in rows:
        less = f"{r['less_lm_head']:>12.6f}" if "less_lm_head" in r else ""
        print(f"{r['gpu']:<9} {r['model']:<30} {r['tp']:>2} {r['shape']:<20} {r['ours_ms']:>9.3f} "
              f"{r['estimator_ms']:>12.3f} {r['ratio']:>9.6f} {less}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
