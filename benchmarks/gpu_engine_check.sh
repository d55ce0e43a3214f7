#!/usr/bin/env bash
# GPU check of the engine, prepared to run in one go in under 10 minutes on one CUDA GPU.
# From the repository root:  bash benchmarks/gpu_engine_check.sh [OUT_DIR]
# 1. the GPU-only tests (bf16 on cuda); 2. the engine benchmark on cuda in bf16 and float32, with a
# 4,096-token arriving prompt. Results: OUT_DIR/{pytest_gpu.txt, bf16/, fp32/} (results.json + CSV).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-engine-check}}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt" || true
timeout 120 python -m pytest -q -m gpu tests/engine 2>&1 | tee "$OUT/pytest_gpu.txt"
timeout 200 python -m stallfree bench engine --device cuda --dtype bf16 --long-prompt 4096 \
    --out "$OUT/bf16" | tee "$OUT/bench_bf16.txt"
timeout 200 python -m stallfree bench engine --device cuda --dtype float32 --long-prompt 4096 \
    --out "$OUT/fp32" | tee "$OUT/bench_fp32.txt"
