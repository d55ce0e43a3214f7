"""`stallfree validate`: how far the simulator is from a real engine on the same requests, under the same
scheduler configuration (the same scheduler code drives both, so the error is the step-time model's and
the overheads around it).

Imports allowed: the standard library, stallfree.core, stallfree.costmodel, stallfree.sim,
stallfree.engine (and through it torch, only when the engine runs); matplotlib for the plot.

Modules: compare (latencies, summaries, errors, the vLLM result reader; no torch), run (the engine
replay, the local machine's spec and calibration, the simulation), vllm (a `vllm bench serve` result
against the simulator), output (CSVs, plot, GPU file), cli (the command); for `--against`: against (the
format by content, run folders replayed open-loop, the figures and the verdict), runs (the run-folder
reader), silicon (closed-loop benchmark rows), hardware (names onto our presets, derived KV capacity,
the pricing with an engine profile).
"""

from __future__ import annotations

__all__: list[str] = []
