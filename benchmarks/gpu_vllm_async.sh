#!/usr/bin/env bash
# stallfree's vLLM scheduler under vLLM's default asynchronous scheduling, on one CUDA GPU, prepared to run in
# one go in about 8 minutes. Needs vLLM 0.33 or 0.34 installed with its CUDA torch (pip install -e ".[vllm]");
# nothing is downloaded: the model is a tiny random-weight Llama made here (benchmarks/vllm_e2e.py).
# From the repository root:  bash benchmarks/gpu_vllm_async.sh [OUT_DIR]
# 1. outputs: the model served by vLLM's scheduler and by `--scheduler-cls stallfree.integrations.vllm.Scheduler`
#    (async scheduling on, vLLM's default on a GPU), the same greedy requests to both: short prompts, a long
#    prompt beside streams, a disconnect, an abort (part basic), 16 streams in 2,304 tokens of KV, so requests
#    are preempted (part kvp); identical outputs request by request are expected;
# 2. latencies: short prompts arriving while long prompts prefill, beside streams (part mixed): short-prompt
#    TTFT p50/p99 and the streams' inter-token gaps p50/p99, vLLM's scheduler with and without
#    --long-prefill-token-threshold and stallfree's with and without K = 4, L = 1, T = 128.
# stallfree's server logs are checked for asynchronous scheduling being on (the scheduler logs it at start). OUT_DIR/results/installed/ holds every run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(readlink -f "${1:-gpu-vllm-async}")"
mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt" || true
E2E=(python benchmarks/vllm_e2e.py --installed --dir "$OUT" --serve-arg=--enforce-eager)
timeout 120 "${E2E[@]}" setup
timeout 300 "${E2E[@]}" run --parts basic,kvp --n 16 | tee "$OUT/outputs.txt" || true
timeout 240 "${E2E[@]}" run --parts mixed --rounds 1 | tee "$OUT/mixed.txt" || true
echo "stallfree's servers: asynchronous scheduling as vLLM configured it (async_scheduling=True expected):"
for f in "$OUT"/results/installed/*stallfree*.log; do
  printf '  %s: %s\n' "$(basename "$f")" "$(grep -o "stallfree's vLLM scheduler: .*" "$f" | head -1)"
done
