"""The shape of a Llama-family decoder (ModelConfig) and its rotary position tables.

Imports allowed: the standard library, torch, stallfree.engine.errors.

Source: Llama (Touvron et al., 2023) with rotary position embeddings (RoFormer, Su et al., 2021);
the "llama3" frequency scaling follows Meta's Llama 3.1 reference implementation, "linear"
position interpolation follows Chen et al., 2023.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.engine.errors import ModelLoadError

__all__ = ["ModelConfig", "rope_tables"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The hyperparameters of a Llama-architecture decoder.

    Attributes:
        vocab_size: V, tokens in the vocabulary.
        hidden_size: the model width d = H*D for Llama models (not required: D is stored).
        intermediate_size: the SwiGLU inner width, F.
        num_layers: L.
        num_heads: H, query heads.
        num_kv_heads: Hkv, key/value heads (grouped-query attention when < H).
        head_dim: D.
        rms_norm_eps: the epsilon inside RMSNorm.
        rope_theta: the rotary base (10,000 for Llama 2, 100,000 for SmolLM2, 500,000 for Llama 3).
        rope_scaling: None, or a dict with "rope_type" ("linear" or "llama3") and its parameters.
        max_model_len: the context length, in tokens.
        tie_embeddings: the LM head shares the token embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2); False for Llama.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_embeddings: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"model config: {name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers at 4 bytes an element (float32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (Llama, Mistral or Qwen2 layout).

        Raises:
            ModelLoadError: a required key is missing, or the architecture uses a feature this
                decoder does not implement (sliding-window attention within the context).
        """
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_scaling") or None
            params = cfg.get("rope_parameters") or {}
            theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
            if rope is None and params.get("rope_type", "default") != "default":
                rope = dict(params)
            max_len = int(cfg.get("max_position_embeddings", 2048))
            window = cfg.get("sliding_window")
            if window is not None and cfg.get("use_sliding_window", True) and int(window) < max_len:
                raise ModelLoadError(
                    f"sliding_window {window} < max_position_embeddings {max_len} is not supported"
                )
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope,
                max_model_len=max_len,
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks the key {exc.args[0]!r}") from None


def _inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None) -> torch.Tensor:
    """Return the rotary inverse frequencies [D/2] (float32), with the model's scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if freq_factors is not None:
        return inv / freq_factors.float()
    scaling = cfg.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        # Short wavelengths (high frequencies) are kept, long ones divided by `factor`, and the
        # band between is interpolated smoothly.
        smooth = ((orig / wavelen) - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > orig / low, inv / factor, inv)
        between = (wavelen <= orig / low) & (wavelen >= orig / high)
        return torch.where(between, mid, out)
    raise ModelLoadError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def rope_tables(
    cfg: ModelConfig, freq_factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the cos and sin tables for positions 0 .. max_model_len - 1.

    Shapes: cos, sin: [max_model_len, D] float32; each half-dimension frequency appears twice
    (the "rotate half" layout of Hugging Face Llama checkpoints).

    Args:
        freq_factors: per-frequency divisors [D/2] stored in some GGUF files (rope_freqs.weight).

    Raises:
        ModelLoadError: an unsupported rope_scaling type.
    """
    inv = _inv_freq(cfg, freq_factors)
    pos = torch.arange(cfg.max_model_len, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
