#!/usr/bin/env bash
# `stallfree validate` on one CUDA GPU, prepared to run in one go in under 8 minutes.
# From the repository root:  bash benchmarks/gpu_validate.sh [OUT_DIR] [LARGER_MODEL_DIR]
# 1. the bundled SmolLM2-135M in bf16 on cuda, at the trace's full prompt lengths (capped at 2,048) and
#    a larger budget, with the JSON result and the CSVs/plot; 2. if a Hugging Face Llama directory is
#    given (e.g. a Llama-3.2-1B checkout), the same for it. Each run prints the engine-versus-simulator
#    table; OUT_DIR/*/ holds requests.csv, engine_steps.csv, local_gpu.json and validate.png.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-validate}}"
LARGER="${2:-}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt" || true
COMMON=(--device cuda --engine-dtype bf16 --num-requests 64 --token-budget 1024 --max-seqs 64
        --kv-tokens 262144 --prompt-scale 1 --output-scale 1 --max-prompt 2048 --max-output 256 --load 0.7)
timeout 240 python -m stallfree validate "${COMMON[@]}" --out "$OUT/smollm2" --json \
    > "$OUT/smollm2.json"
python -m stallfree validate "${COMMON[@]}" --num-requests 8 --out "$OUT/smollm2-small" | tee "$OUT/smollm2-small.txt"
if [ -n "$LARGER" ]; then
    timeout 240 python -m stallfree validate "${COMMON[@]}" --engine-model "$LARGER" --out "$OUT/larger" --json \
        > "$OUT/larger.json"
fi
python - "$OUT" <<'EOF'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    e = r["error"]
    print(f.stem, {k: round(e[k], 1) for k in ("e2e_median_ape_pct", "e2e_p90_ape_pct", "ttft_p99_err_pct",
                                                "tpot_p99_err_pct") if e.get(k) is not None})
EOF
