"""Small random PEFT adapters written locally for the engine's and server's LoRA tests (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# PEFT module -> its prefix in the layer and (out, in) from the model's shape.
_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shape(cfg, module: str) -> tuple[int, int]:
    """(out, in) of a PEFT module of a model with ModelConfig `cfg`."""
    d, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, f = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}[module]


def make_adapter(folder: Path, cfg, modules: list[str], rank: int, alpha: float, seed: int,
                 b_std: float = 0.02, config_extra: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a PEFT adapter (adapter_config.json, adapter_model.safetensors) with random A and B, seeded.

    Returns its tensors by PEFT's names (float32)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m in modules:
            out, inp = module_shape(cfg, m)
            base = f"base_model.model.model.layers.{i}.{_PREFIX[m]}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{base}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none",
            "lora_dropout": 0.0, "task_type": "CAUSAL_LM", **(config_extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(meta))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
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
