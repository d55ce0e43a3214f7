"""What LoRA adds to a decode step of the engine: the median wall time of a step of 16 decodes of the bundled
model (CPU, float32, one torch thread) with no adapter, one adapter on every request, and base plus two adapters
mixed, each adapter on all seven projections at rank 16 (seeded random, stallfree.engine.lora.random_peft_adapter).

Usage: PYTHONPATH=src python benchmarks/lora_step_cost.py [--repeats 2]

Imports allowed: the standard library, torch, stallfree.engine.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import torch

from stallfree.engine import LLMEngine, SamplingParams, engine_config
from stallfree.engine.lora import PEFT_MODULES, random_peft_adapter
from stallfree.engine.model import LlamaModel
from stallfree.engine.weights import load_checkpoint


def median_decode_ms(model: LlamaModel, tokenizer: object, folders: dict[str, pathlib.Path],
                     loras: list[str | None]) -> float:
    """Median decode step (ms) of 16 requests whose adapters cycle through `loras`, 40 tokens each."""
    eng = LLMEngine(model, tokenizer, scheduler=engine_config(256, 16, 8192, max_loras=2),  # type: ignore[arg-type]
                    enable_lora=True, lora_modules=folders)
    for i in range(16):
        eng.add_request(i, "The capital of France is", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                        lora=loras[i % len(loras)])
    eng.step()  # the prefill
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    """Print the three medians, `--repeats` times."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    ck = load_checkpoint()
    model = LlamaModel(ck.config, ck.tensors)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="lora-cost-"))
    folders = {}
    for seed, name in enumerate(("a", "b")):
        random_peft_adapter(tmp / name, ck.config, list(PEFT_MODULES), 16, 16, seed=seed)
        folders[name] = tmp / name
    for rep in range(args.repeats):
        for label, loras in (("base", [None]), ("one adapter", ["a"]), ("base + a + b", [None, "a", "b"])):
            ms = median_decode_ms(model, ck.tokenizer, folders, loras)
            print(f"run {rep}: {label}: {ms:.1f} ms median decode step (16 decodes)")


if __name__ == "__main__":
    main()
