"""What `stallfree validate --out DIR` writes: requests.csv (engine and simulator latencies side by side),
engine_steps.csv (the step log the calibration read), local_gpu.json (this machine with its calibration,
for `--gpu FILE`), and validate.png (simulated against measured latency per request).

Imports allowed: the standard library, matplotlib (inside write_outputs), stallfree.core,
stallfree.costmodel, stallfree.sim, stallfree.validate.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from stallfree.costmodel import GPUSpec
from stallfree.costmodel.hardware import gpu_to_dict
from stallfree.sim.inputs.workload import Workload
from stallfree.validate.compare import Latencies

__all__ = ["write_gpu", "write_outputs"]


def write_gpu(path: Path, gpu: GPUSpec) -> None:
    """Write `gpu` (with its calibration) in the gpus.json entry format.

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(gpu_to_dict(gpu), indent=1) + "\n", encoding="utf-8")


def _ms(lat: dict[Hashable, Latencies], rid: int, metric: str) -> str:
    v = lat[rid].value(metric) if rid in lat else None
    return "" if v is None else f"{v * 1e3:.3f}"


def write_outputs(
    out: Path,
    workload: Workload,
    run: Any,
    sim: Any,
    eng: dict[Hashable, Latencies],
    simlat: dict[Hashable, Latencies],
    half: int,
    gpu: GPUSpec,
) -> None:
    """Write the four files of the module docstring into `out` (created if missing).

    Raises:
        OSError: a file cannot be written.
    """
    out.mkdir(parents=True, exist_ok=True)
    metrics = ("ttft", "tpot", "itl", "e2e")
    with (out / "requests.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rid", "half", "arrival_s", "prompt_len", "output_len"]
                   + [f"{who}_{m}_ms" for m in metrics for who in ("engine", "sim")])
        for i in range(len(workload)):
            w.writerow([i, "calibrate" if i < half else "test", f"{workload.arrivals[i]:.4f}",
                        workload.prompt_lens[i], workload.output_lens[i]]
                       + [x for m in metrics for x in (_ms(eng, i, m), _ms(simlat, i, m))])
    with (out / "engine_steps.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "start_s", "num_prefill_tokens", "num_decodes", "decode_context_sum",
                    "prefill_context_sum", "num_tokens", "num_sampled", "seconds"])
        for k, (start, _end, s) in enumerate(run.steps):
            w.writerow([k, f"{start:.6f}", s.num_prefill_tokens, s.num_decodes, s.decode_context_sum,
                        s.prefill_context_sum, s.num_tokens, s.num_sampled, f"{s.seconds:.6f}"])
    write_gpu(out / "local_gpu.json", gpu)
    _plot(out / "validate.png", eng, simlat, half, len(workload))


def _plot(path: Path, eng: dict[Hashable, Latencies], sim: dict[Hashable, Latencies], half: int, n: int) -> None:
    """Scatter simulated against measured E2E and TTFT per request, with the y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, metric in zip(axes, ("e2e", "ttft"), strict=True):
        for part, rids, marker in (("calibration half", range(half), "o"), ("test half", range(half, n), "s")):
            pts = [(eng[r].value(metric), sim[r].value(metric)) for r in rids if r in eng and r in sim]
            xs = [p[0] * 1e3 for p in pts if p[0] is not None and p[1] is not None]
            ys = [p[1] * 1e3 for p in pts if p[0] is not None and p[1] is not None]
            ax.scatter(xs, ys, marker=marker, label=part, alpha=0.7)
        lim = max([v.value(metric) or 0.0 for v in (*eng.values(), *sim.values())] + [1e-3]) * 1e3 * 1.05
        ax.plot([0, lim], [0, lim], color="grey", linewidth=1)
        ax.set_xlabel(f"engine {metric.upper()} (ms)")
        ax.set_ylabel(f"simulator {metric.upper()} (ms)")
        ax.legend()
    fig.suptitle("stallfree validate: simulated against measured, per request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
