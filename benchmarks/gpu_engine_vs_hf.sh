#!/usr/bin/env bash
# The engine on one CUDA GPU, prepared to run in one go in under 5 minutes:
#   1. the tests marked gpu (float32 equals the CPU's greedy tokens; unwritten KV never reaches an
#      output in bf16, fp16 and fp32; bf16 answers " Paris");
#   2. stallfree against transformers' generate() on the same GPU (benchmarks/engine_vs_hf.py:
#      one at a time, 16 at once, staggered arrivals; tokens/s, mean E2E, identical greedy outputs
#      or the first divergence) in bfloat16 (the GPU default) and float32.
# From the repository root:  bash benchmarks/gpu_engine_vs_hf.sh [OUT_DIR]
# Results: OUT_DIR/{gpu.txt, pytest_gpu.txt, vs_hf_bf16.{txt,json}, vs_hf_fp32.{txt,json}}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-engine-vs-hf}}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt" || true
timeout 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/engine 2>&1 | tee "$OUT/pytest_gpu.txt" || true
for dt in bfloat16 float32; do
    short=$([ "$dt" = bfloat16 ] && echo bf16 || echo fp32)
    timeout 100 "$PY" benchmarks/engine_vs_hf.py --device cuda --dtype "$dt" --reps 3 --gap-s 0.05 \
        --threads 4 --json "$OUT/vs_hf_$short.json" 2>&1 | tee "$OUT/vs_hf_$short.txt" || true
done
