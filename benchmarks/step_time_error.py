"""Measure the step-time error model of stallfree.sim.studies.ranges on the dev data, and print its constants.

One sample per replayed dev run: r = measured mean TPOT / simulated mean TPOT (a mean TPOT is the mean
time of the steps a request decodes in). The samples are the four run folders of
data/validation/llmservingsim_vllm and the vLLM rows of the package's sample (aiconfigurator-core's
silicon_sample.csv) on H100 and H200 for the dev models, both replayed by `stallfree validate --against`
with the defaults. Prints the 10th, 50th and 90th percentile of r, pooled and per group.

    python benchmarks/step_time_error.py                      # runs both replays (about 6 minutes on 2 cores)
    python benchmarks/step_time_error.py --folders F.json --rows R.json   # reads their --json output
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

FOLDERS = ["validate", "--against", "data/validation/llmservingsim_vllm", "--json"]
ROWS = ["validate", "--against", "aiconfigurator", "--engine", "vllm", "--gpu", "h100-sxm,h200",
        "--model", "qwen3-32b,llama-3.1", "--json"]


def _load(path: Path | None, argv: list[str]) -> dict[str, Any]:
    if path is not None:
        return dict(json.loads(path.read_text()))
    out = subprocess.run([sys.executable, "-m", "stallfree", *argv], check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout))


def samples(folders: dict[str, Any], rows: dict[str, Any]) -> dict[str, list[float]]:
    """The ratios r by group: each run folder its own group, each (model, GPU) of the rows one."""
    groups: dict[str, list[float]] = defaultdict(list)
    for run in folders["runs"]:
        groups[f"run {run['run']}"].append(run["measured"]["mean_tpot_ms"] / run["simulated"]["mean_tpot_ms"])
    for row in rows["rows"]:
        if row.get("osl", 0) > 1 and row.get("sim_tpot_ms") and row.get("measured_tpot_ms"):
            groups[f"rows {row['model']} {row['gpu']}"].append(row["measured_tpot_ms"] / row["sim_tpot_ms"])
    return groups


def main() -> None:
    """Print the percentiles of r and the constants of stallfree.sim.studies.ranges."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folders", type=Path, help="saved output of: stallfree " + " ".join(FOLDERS))
    ap.add_argument("--rows", type=Path, help="saved output of: stallfree " + " ".join(ROWS))
    args = ap.parse_args()
    groups = samples(_load(args.folders, FOLDERS), _load(args.rows, ROWS))
    pooled = [r for g in groups.values() for r in g]
    for name, rs in sorted(groups.items()):
        p10, p50, p90 = np.percentile(rs, [10, 50, 90])
        print(f"{name:60} n={len(rs):3}  p10 {p10:.3f}  p50 {p50:.3f}  p90 {p90:.3f}")
    p10, p50, p90 = np.percentile(pooled, [10, 50, 90])
    print(f"{'pooled':60} n={len(pooled):3}  p10 {p10:.3f}  p50 {p50:.3f}  p90 {p90:.3f}")
    print(f"STEP_TIME_LOW = {p10:.3f}\nSTEP_TIME_HIGH = {p90:.3f}")


if __name__ == "__main__":
    main()
