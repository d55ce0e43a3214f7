"""Model specifications (ModelSpec): dimensions, parameter counts worked out from them, and the presets.

Imports allowed: the standard library and stallfree.costmodel (errors, hardware).

Parameter counts (all checked against the published totals in data/models.json by the tests):
    per layer = attention + MLP + norms + MoE router
    attention = h x (n_q x d) [q] + 2 x h x (n_kv x d) [k, v] + (n_q x d) x h [o]
                (+ n_q x d + 2 x n_kv x d biases when qkv_bias)
    MLP       = 3 x h x f (gated, SwiGLU) or 2 x h x f (plain); times E experts for MoE
    router    = h x E (MoE only)
    total     = L x per layer + V x h (embedding) + V x h (lm_head, unless tied) + final norm (half a
                layer's norm weights)
Active parameters (MoE) count k of the E experts per token (Mixtral: 12.9B of 46.7B).
Source: Kaplan et al. 2020 (arXiv 2001.08361) for "non-embedding parameters"; the layer shapes are
those of Llama, Mistral/Mixtral, Qwen2 and Falcon as listed in data/models.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.hardware import alias_index, normalize_name, read_json_object
from stallfree.costmodel.hf_kinds import (
    GATED_MLP_TYPES,
    PLAIN_MLP_TYPES,
    UNPRICEABLE_FIELDS,
    gated_mlp,
    refuse_unpriceable,
)

__all__ = [
    "GATED_MLP_TYPES",
    "PLAIN_MLP_TYPES",
    "UNPRICEABLE_FIELDS",
    "ModelSpec",
    "get_model",
    "list_models",
    "load_model_file",
    "model_from_dict",
    "model_from_hf_config",
]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer's shape, with parameter counts derived from it.

    Attributes:
        key: the lookup name (e.g. 'llama-3.3-70b').
        name: the display name.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size:
            L, h, n_q, n_kv, d, f (per expert for MoE), V.
        tie_word_embeddings: the lm_head is the embedding matrix (stored once).
        qkv_bias: q, k and v projections carry biases (Qwen2).
        gated_mlp: three MLP matrices (SwiGLU); False for a two-matrix MLP (Falcon's GELU MLP).
        norm_params_per_layer: norm weights per layer (2h for two RMSNorms; 4h for two LayerNorms with bias).
        num_experts, experts_per_token: E and k of an MoE layer; 0 and 0 for a dense model.
        param_overrides: counts given explicitly by a data file (keys 'total', 'active', 'layer',
            'active_layer', 'embed', 'lm_head'); they replace the computed ones, for architectures the
            formulas above do not cover.
        sources: where the dimensions come from.
        context_length: the most tokens (prompt plus output) one request may hold, or None when
            unknown: the config's max_position_embeddings, or the model card's documented limit.
        context_length_source: where context_length comes from.

    Raises:
        CostModelError (at construction): a dimension is not a positive integer, the experts are
            inconsistent (k > E, or only one of them set), or n_q is not a multiple of n_kv.
    """

    key: str
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    gated_mlp: bool = True
    norm_params_per_layer: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    param_overrides: tuple[tuple[str, int], ...] = ()
    aliases: tuple[str, ...] = ()
    sources: tuple[str, ...] = field(default=(), compare=False)
    context_length: int | None = None
    context_length_source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        owner = f"model {self.key!r}"
        cl = self.context_length
        if cl is not None and (isinstance(cl, bool) or not isinstance(cl, int) or cl < 1):
            raise CostModelError(f"{owner}: context_length must be an integer >= 1, got {cl!r}")
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
        if self.norm_params_per_layer is not None and self.norm_params_per_layer < 0:
            raise CostModelError(
                f"{owner}: norm_params_per_layer must be >= 0, got {self.norm_params_per_layer}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CostModelError(
                f"{owner}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        e, k = self.num_experts, self.experts_per_token
        if e < 0 or k < 0 or (e == 0) != (k == 0) or k > e:
            raise CostModelError(
                f"{owner}: need 1 <= experts_per_token <= num_experts (or both 0), got {k} of {e}"
            )
        for name, value in self.param_overrides:
            if not isinstance(value, int) or value < 0:
                raise CostModelError(f"{owner}: params[{name!r}] must be an integer >= 0, got {value!r}")

    # Parameter counts. Cheap enough to compute on demand; the CostModel caches what it needs.
    def _override(self, name: str) -> int | None:
        return dict(self.param_overrides).get(name)

    @property
    def _norms(self) -> int:
        return 2 * self.hidden_size if self.norm_params_per_layer is None else self.norm_params_per_layer

    @property
    def attention_params_per_layer(self) -> int:
        """Weights (and biases) of one layer's q, k, v and o projections."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        return 2 * h * q + 2 * h * kv + bias

    @property
    def expert_params_per_layer(self) -> int:
        """Weights of one MLP (one expert, for MoE) in one layer."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def dense_params_per_layer(self) -> int:
        """Weights of one layer that every token uses: attention, norms, router (all but the experts)."""
        router = self.hidden_size * self.num_experts
        mlp = 0 if self.num_experts else self.expert_params_per_layer
        return self.attention_params_per_layer + self._norms + router + mlp

    @property
    def layer_params(self) -> int:
        """All weights inside the decoder layers (Kaplan's non-embedding N)."""
        got = self._override("layer")
        if got is not None:
            return got
        return self.num_layers * (
            self.dense_params_per_layer + self.num_experts * self.expert_params_per_layer
        )

    @property
    def active_layer_params(self) -> int:
        """Decoder-layer weights one token runs through (k experts of E for MoE)."""
        got = self._override("active_layer")
        if got is not None:
            return got
        if not self.num_experts:
            return self.layer_params
        return self.num_layers * (
            self.dense_params_per_layer + self.experts_per_token * self.expert_params_per_layer
        )

    @property
    def embed_params(self) -> int:
        """The input embedding table, V x h."""
        got = self._override("embed")
        return self.vocab_size * self.hidden_size if got is None else got

    @property
    def lm_head_params(self) -> int:
        """The output projection, V x h (the same matrix as the embedding when tied)."""
        got = self._override("lm_head")
        return self.vocab_size * self.hidden_size if got is None else got

    @property
    def total_params(self) -> int:
        """Every stored weight: layers, embedding, lm_head (once if tied), final norm."""
        got = self._override("total")
        if got is not None:
            return got
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.layer_params + self.embed_params + head + self._norms // 2

    @property
    def active_params(self) -> int:
        """total_params less the experts a token does not use."""
        got = self._override("active")
        if got is not None:
            return got
        return self.total_params - (self.layer_params - self.active_layer_params)

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.num_experts > 0

    def kv_bytes_per_token(self, kv_bytes: int) -> int:
        """KV cache bytes per token on one GPU without tensor parallelism: 2 x L x n_kv x d x kv_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes


def _int(data: dict[str, Any], key: str, owner: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise CostModelError(f"{owner}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise CostModelError(f"{owner}: {key} must be an integer, got {value!r}")
    return value


def model_from_dict(key: str, data: dict[str, Any]) -> ModelSpec:
    """Build a ModelSpec from one entry of the models.json format.

    Required keys: num_layers, hidden_size, num_heads, intermediate_size, vocab_size. Optional:
    num_kv_heads (default num_heads), head_dim (default hidden_size / num_heads), tie_word_embeddings,
    qkv_bias, gated_mlp, norm_params_per_layer, num_experts, experts_per_token, params (explicit counts),
    name, aliases, sources, context_length (tokens) and context_length_source.

    Raises:
        CostModelError: a key is missing or a value is out of range; the message names it.
    """
    owner = f"model {key!r}"
    heads = _int(data, "num_heads", owner)
    hidden = _int(data, "hidden_size", owner)
    params = data.get("params") or {}
    if not isinstance(params, dict):
        raise CostModelError(f"{owner}: params must be an object of counts")
    head_dim = data.get("head_dim")
    if head_dim is None:
        if heads < 1 or hidden % heads:
            raise CostModelError(
                f"{owner}: head_dim missing and hidden_size {hidden} not divisible by {heads} heads"
            )
        head_dim = hidden // heads
    return ModelSpec(
        key=key,
        name=str(data.get("name", key)),
        num_layers=_int(data, "num_layers", owner),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_int(data, "num_kv_heads", owner, heads),
        head_dim=head_dim,
        intermediate_size=_int(data, "intermediate_size", owner),
        vocab_size=_int(data, "vocab_size", owner),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        qkv_bias=bool(data.get("qkv_bias", False)),
        gated_mlp=bool(data.get("gated_mlp", True)),
        norm_params_per_layer=data.get("norm_params_per_layer"),
        num_experts=_int(data, "num_experts", owner, 0),
        experts_per_token=_int(data, "experts_per_token", owner, 0),
        param_overrides=tuple(
            sorted((str(k), v) for k, v in params.items() if k in _OVERRIDABLE and v is not None)
        ),
        aliases=tuple(normalize_name(a) for a in data.get("aliases", ())),
        sources=tuple(data.get("sources", ())),
        context_length=data.get("context_length"),
        context_length_source=str(data.get("context_length_source", "")),
    )


_OVERRIDABLE = ("total", "active", "layer", "active_layer", "embed", "lm_head")


def model_from_hf_config(key: str, config: dict[str, Any]) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json (Llama, Mistral, Mixtral, Qwen2 and alike).

    Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default: the
    attention heads), head_dim (default hidden / heads), intermediate_size, vocab_size,
    tie_word_embeddings, num_local_experts (or num_experts) and num_experts_per_tok; Qwen2 models
    (model_type 'qwen2') get q/k/v biases, as do configs with attention_bias true. The MLP's kind
    (gated or not) comes from model_type and hidden_act (hf_kinds.gated_mlp): a phi-2 or GPT-NeoX MLP has no
    gate. Parameter counts are worked out from these dimensions (see the module docstring). The context
    length is max_position_embeddings (None when the config has none).

    Raises:
        CostModelError: a required key is missing or out of range; the MLP's kind cannot be told; or the
            architecture has parts the formulas do not cover (multi-head latent attention, shared
            experts, MoE on some layers only); the message names the field.
    """
    owner = f"model {key!r} (config.json)"
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        config = text
    refuse_unpriceable(owner, config)
    experts = config.get("num_local_experts", config.get("num_experts")) or 0
    data = {
        "name": config.get("_name_or_path") or key,
        "num_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "num_heads": config.get("num_attention_heads"),
        "num_kv_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
        "head_dim": config.get("head_dim"),
        "intermediate_size": config.get("moe_intermediate_size")
        if experts and config.get("moe_intermediate_size")
        else config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "qkv_bias": bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2",
        "gated_mlp": gated_mlp(owner, config),
        "num_experts": experts,
        "experts_per_token": config.get("num_experts_per_tok", 0) if experts else 0,
        "sources": ("Hugging Face config.json",),
        "context_length": config.get("max_position_embeddings"),
        "context_length_source": "config.json max_position_embeddings",
    }
    for required, hf in (
        ("num_layers", "num_hidden_layers"),
        ("hidden_size", "hidden_size"),
        ("num_heads", "num_attention_heads"),
        ("intermediate_size", "intermediate_size"),
        ("vocab_size", "vocab_size"),
    ):
        if data[required] is None:
            raise CostModelError(f"{owner}: missing key {hf!r}")
    return model_from_dict(key, data)


@cache
def _presets() -> dict[str, ModelSpec]:
    text = resources.files("stallfree.costmodel").joinpath("data/models.json").read_text(encoding="utf-8")
    return {
        normalize_name(k): model_from_dict(normalize_name(k), v)
        for k, v in json.loads(text)["models"].items()
    }


@cache
def _alias_index() -> dict[str, str]:
    return alias_index(_presets())


def list_models() -> list[str]:
    """Return the preset model names, sorted."""
    return sorted(_presets())


def load_model_file(path: str | Path) -> ModelSpec:
    """Load a model from a JSON file: a Hugging Face config.json, or one entry of the models.json format.

    A file with 'num_hidden_layers' is read as a Hugging Face config; otherwise as our format.

    Raises:
        CostModelError: the file cannot be read or parsed, or a key is missing or out of range.
    """
    p = Path(path)
    data = read_json_object(p, "model")
    key = normalize_name(p.parent.name if p.stem == "config" else p.stem)
    if "num_hidden_layers" in data or "text_config" in data:
        return model_from_hf_config(key, data)
    return model_from_dict(normalize_name(str(data.get("key", key))), data)


def get_model(name: str | ModelSpec) -> ModelSpec:
    """Return the model preset called `name`, or load it from `name` when that is a path to a .json file.

    Raises:
        CostModelError: the name is unknown (the message lists the known names) or the file is bad.
    """
    if isinstance(name, ModelSpec):
        return name
    if str(name).endswith(".json"):
        return load_model_file(name)
    key = _alias_index().get(normalize_name(str(name)))
    if key is None:
        raise CostModelError(
            f"unknown model {name!r}; known models: {', '.join(list_models())} (or a path to a .json file)"
        )
    return _presets()[key]
