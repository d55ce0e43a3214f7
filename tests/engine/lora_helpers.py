"""Small random PEFT adapters written locally for the engine's and server's LoRA tests (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_adapter(folder: Path, cfg, modules: list[str], rank: int, alpha: float, seed: int,
                 b_std: float = 0.02, config_extra: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a seeded random PEFT adapter (stallfree.engine.lora.random_peft_adapter), with extra keys merged
    into its adapter_config.json; return its tensors by PEFT's names."""
    from stallfree.engine.lora import random_peft_adapter

    tensors = random_peft_adapter(folder, cfg, modules, rank, alpha, seed, b_std)
    if config_extra:
        meta = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**meta, **config_extra}))
    return tensors


def merge_into(hf_model, tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Merge an adapter into transformers' model by hand, W += scaling x B A; return the weights it
    changed (their originals, by parameter name) so the caller can restore them."""
    params = dict(hf_model.named_parameters())
    saved = {}
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            saved[name] = params[name].detach().clone()
            params[name].add_(scaling * (b @ a))
    return saved


def restore(hf_model, saved: dict[str, torch.Tensor]) -> None:
    """Put back the weights merge_into changed."""
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, w in saved.items():
            params[name].copy_(w)
