"""Check: the newer presets' parameter counts against the published figures, and their KV bytes per
token against aiconfigurator-core's memory model of the same config.json (BaseModel.get_kvcache_bytes_per_sequence,
an independent formula), at tp 1 and 8, bf16 KV.

Run: PYTHONPATH=src python benchmarks/models_vs_package.py
Published figures: data/SOURCES.md (DeepSeek-V3 README 671B / 37B; Kimi-K2 README 1T / 32B; gpt-oss 117B /
5.1B and 21B / 3.6B; Llama 4 ~109B and ~400B / 17B; Qwen3 cards).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings

from stallfree.costmodel import get_model
from stallfree.costmodel.kernel_maps import PACKAGE_CONFIGS

PUBLISHED = {"deepseek-v3": (671, 37), "kimi-k2": (1000, 32), "gpt-oss-120b": (117, 5.1), "gpt-oss-20b": (21, 3.6),
             "llama-4-scout": (109, 17), "llama-4-maverick": (400, 17), "qwen3-30b-a3b": (30.5, 3.3),
             "qwen3-235b-a22b": (235, 22), "qwen3-8b": (8.2, None), "qwen3-32b": (32.8, None)}


def _package_kv(stem: str, tp: int) -> float:
    import aiconfigurator_core
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model as aic_model

    folder = tempfile.mkdtemp()
    try:
        src = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "model_configs", f"{stem}_config.json")
        shutil.copy(src, os.path.join(folder, "config.json"))
        mc = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=tp, moe_ep_size=1,
                                gemm_quant_mode="bfloat16", kvcache_quant_mode="bfloat16", moe_quant_mode="bfloat16")
        return float(aic_model(folder, mc, "vllm").get_kvcache_bytes_per_sequence(1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    print(f"{'preset':<18} {'total B':>9} {'pub':>6} {'active B':>9} {'pub':>5} {'KV B/tok tp1':>12} {'package':>8} "
          f"{'tp8':>7} {'package':>8}")
    for key, stem in PACKAGE_CONFIGS.items():
        m = get_model(key)
        pub_t, pub_a = PUBLISHED.get(key, (None, None))
        kv1, kv8 = m.kv_bytes_per_token(2, 1), m.kv_bytes_per_token(2, 8)
        try:
            p1, p8 = _package_kv(stem, 1), _package_kv(stem, 8)
        except Exception as exc:  # a config the package's class refuses at that tp
            p1 = p8 = float("nan")
            print(f"  ({key}: the package's model: {exc})")
        print(f"{key:<18} {m.total_params / 1e9:>9.2f} {pub_t or '-':>6} {m.active_params / 1e9:>9.2f} "
              f"{pub_a or '-':>5} {kv1:>12,.0f} {p1:>8,.0f} {kv8:>7,.0f} {p8:>8,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
