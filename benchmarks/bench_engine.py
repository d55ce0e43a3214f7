"""Benchmark the engine on real execution (same as `stallfree bench engine`).

Run from the repository root: PYTHONPATH=src python benchmarks/bench_engine.py [--threads 1] [--quick]
It writes engine_steps.csv (step, num_prefill_tokens, num_decodes, decode_context_sum,
prefill_context_sum, num_tokens, seconds) and results.json under --out, and prints the figures.
"""

from __future__ import annotations

import sys

from stallfree.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "engine", *sys.argv[1:]]))
