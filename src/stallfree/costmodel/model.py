"""Model specifications (ModelSpec): dimensions, parameter counts worked out from them, and the presets.

Size: this module is over 400 lines because ModelSpec's counts (parameters, KV bytes, attention FLOPs)
are properties of one frozen class that share its validation; reading a Hugging Face config.json lives
in hf_kinds.py.

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

The parts of newer decoders (layer shapes read from the public config.json files of DeepSeek-V3,
Kimi-K2, Qwen3, gpt-oss and Llama 4, and the modelling code of Hugging Face transformers that loads them):
    MLA attention (kv_lora_rank r_kv > 0; DeepSeek-V2/V3, Kimi-K2), with r_q = q_lora_rank, d_n, d_r,
                d_v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim:
                q  = h x r_q + r_q [norm] + r_q x n_q x (d_n + d_r)   (or h x n_q x (d_n + d_r) when r_q = 0)
                kv = h x (r_kv + d_r) + r_kv [norm] + r_kv x n_q x (d_n + d_v);   o = n_q x d_v x h
    o bias    = h (attention_bias true: gpt-oss, Llama); attention sinks = n_q per layer (gpt-oss)
    shared experts S per MoE layer, each the size of a routed expert (DeepSeek, Kimi, Llama 4)
    dense layers: L_dense layers carry a dense MLP of f_dense (DeepSeek's first_k_dense_replace,
                Llama 4 Maverick's interleaved dense layers) and L - L_dense carry the MoE
    MLP biases (gpt-oss experts): 2f + h per gated MLP, plus E for the router
KV cache per token: 2 x L x n_kv x d x bytes (GQA), or L x (r_kv + d_r) x bytes for MLA, whose one
latent per token is the same on every tensor-parallel rank (DeepSeek-V2, arXiv 2405.04434, section 2.1).
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
from stallfree.costmodel.hardware import (
    alias_index,
    did_you_mean,
    json_bool,
    json_int,
    json_str,
    json_strings,
    normalize_name,
    read_json_object,
)
from stallfree.costmodel.hf_kinds import GATED_MLP_TYPES, PLAIN_MLP_TYPES, UNPRICEABLE_FIELDS, hf_fields

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
        num_shared_experts: S, experts every token runs through in each MoE layer, each of
            intermediate_size (DeepSeek's n_shared_experts; Llama 4's shared expert).
        num_dense_layers: L_dense, layers of an MoE model whose MLP is dense (of dense_intermediate_size).
        dense_intermediate_size: f_dense, the dense layers' MLP size; 0 means intermediate_size.
        mlp_bias: the MLP (each expert) and the router carry biases (gpt-oss).
        o_bias: the attention output projection carries a bias (attention_bias true in the config).
        attention_sinks: one learned sink logit per query head per layer (gpt-oss): n_q parameters.
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: r_kv, r_q, d_n,
            d_r, d_v of multi-head latent attention; kv_lora_rank 0 means ordinary (grouped-query)
            attention, and then the others are unused.
        sliding_window: W, the most keys (tokens) a query of a windowed layer attends to; 0 for none.
        num_window_layers: layers that attend over the window only (gpt-oss's sliding_attention
            layers; Llama 4's chunked-attention layers, priced as a window of the chunk size).
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
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    dense_intermediate_size: int = 0
    mlp_bias: bool = False
    o_bias: bool = False
    attention_sinks: bool = False
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    num_window_layers: int = 0
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
        for name in ("num_shared_experts", "num_dense_layers", "dense_intermediate_size", "kv_lora_rank",
                     "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "sliding_window", "num_window_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CostModelError(f"{owner}: {name} must be an integer >= 0, got {value!r}")
        if self.num_dense_layers > self.num_layers or self.num_window_layers > self.num_layers:
            raise CostModelError(
                f"{owner}: num_dense_layers {self.num_dense_layers} and num_window_layers "
                f"{self.num_window_layers} must be at most the {self.num_layers} layers"
            )
        if (self.num_shared_experts or self.num_dense_layers) and not e:
            raise CostModelError(f"{owner}: shared experts and dense layers need num_experts > 0")
        if bool(self.sliding_window) != bool(self.num_window_layers):
            raise CostModelError(
                f"{owner}: sliding_window {self.sliding_window} and num_window_layers "
                f"{self.num_window_layers} must both be set or both be 0"
            )
        if self.kv_lora_rank and not (self.qk_nope_head_dim and self.qk_rope_head_dim and self.v_head_dim):
            raise CostModelError(
                f"{owner}: multi-head latent attention (kv_lora_rank {self.kv_lora_rank}) needs "
                "qk_nope_head_dim, qk_rope_head_dim and v_head_dim >= 1"
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
    def is_mla(self) -> bool:
        """True for multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def attention_params_per_layer(self) -> int:
        """Weights (and biases, sinks) of one layer's attention: q, k, v and o (GQA) or MLA's projections."""
        h, n_q = self.hidden_size, self.num_heads
        if self.is_mla:
            d_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            r_q, r_kv = self.q_lora_rank, self.kv_lora_rank
            q = h * r_q + r_q + r_q * n_q * d_qk if r_q else h * n_q * d_qk
            kv = h * (r_kv + self.qk_rope_head_dim) + r_kv + r_kv * n_q * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + n_q * self.v_head_dim * h + (h if self.o_bias else 0)
        q, kv = n_q * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        extra = (h if self.o_bias else 0) + (n_q if self.attention_sinks else 0)
        return 2 * h * q + 2 * h * kv + bias + extra

    def _mlp(self, f: int) -> int:
        bias = (2 * f + self.hidden_size if self.gated_mlp else f + self.hidden_size) if self.mlp_bias else 0
        return (3 if self.gated_mlp else 2) * self.hidden_size * f + bias

    @property
    def expert_params_per_layer(self) -> int:
        """Weights of one MLP (one expert, for MoE) in one layer, biases included."""
        return self._mlp(self.intermediate_size)

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts: L - L_dense for MoE models, 0 for dense ones."""
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def dense_mlp_params(self) -> int:
        """Weights of one dense layer's MLP (f_dense, or intermediate_size)."""
        return self._mlp(self.dense_intermediate_size or self.intermediate_size)

    @property
    def dense_params_per_layer(self) -> int:
        """Weights of one layer that every token uses: attention, norms, router (all but the experts).

        For an MoE layer, the shared experts count here; for a dense layer, its MLP."""
        if not self.num_experts:
            return self.attention_params_per_layer + self._norms + self.expert_params_per_layer
        router = self.hidden_size * self.num_experts + (self.num_experts if self.mlp_bias else 0)
        shared = self.num_shared_experts * self.expert_params_per_layer
        return self.attention_params_per_layer + self._norms + router + shared

    def _layers(self, experts: int) -> int:
        if not self.num_experts:
            return self.num_layers * self.dense_params_per_layer
        dense = self.num_dense_layers * (self.attention_params_per_layer + self._norms + self.dense_mlp_params)
        moe = self.num_moe_layers * (self.dense_params_per_layer + experts * self.expert_params_per_layer)
        return dense + moe

    @property
    def routed_expert_params(self) -> int:
        """Weights of all routed experts of all MoE layers (what a step reads only in part)."""
        return self.num_moe_layers * self.num_experts * self.expert_params_per_layer

    @property
    def layer_params(self) -> int:
        """All weights inside the decoder layers (Kaplan's non-embedding N)."""
        got = self._override("layer")
        if got is not None:
            return got
        return self._layers(self.num_experts)

    @property
    def active_layer_params(self) -> int:
        """Decoder-layer weights one token runs through (k of the E routed experts, plus the shared ones)."""
        got = self._override("active_layer")
        if got is not None:
            return got
        if not self.num_experts:
            return self.layer_params
        return self._layers(self.experts_per_token)

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

    def kv_bytes_per_token(self, kv_bytes: float, tp: int = 1) -> float:
        """KV cache bytes per token on one GPU of a tensor-parallel group of `tp`.

        GQA: 2 x L x ceil(n_kv / tp) x d x kv_bytes (KV heads split, or replicated when tp > n_kv).
        MLA: L x (r_kv + d_r) x kv_bytes whatever tp, since the latent is not split across ranks.
        Every layer is counted in full, windowed ones included: an upper bound for those models.
        """
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_bytes
        return 2 * self.num_layers * -(-self.num_kv_heads // tp) * self.head_dim * kv_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair in one layer, as a prefill computes it: QK^T plus AV.

        GQA: 4 x n_q x d. MLA (keys and values expanded from the latent): 2 x n_q x (d_n + d_r) + 2 x n_q x d_v.
        """
        if self.is_mla:
            n_q = self.num_heads
            return 2 * n_q * (self.qk_nope_head_dim + self.qk_rope_head_dim) + 2 * n_q * self.v_head_dim
        return 4 * self.num_heads * self.head_dim

    @property
    def decode_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair in one layer for a decode.

        GQA: as a prefill. MLA decodes attend over the latent itself with the up-projections absorbed
        into q and o (DeepSeek-V2, arXiv 2405.04434, section 2.1.3; FlashMLA):
        2 x n_q x (r_kv + d_r) + 2 x n_q x r_kv (DeepSeek-V3: 278,528 against a prefill's 81,920).
        """
        if self.is_mla:
            n_q, r = self.num_heads, self.kv_lora_rank
            return 2 * n_q * (r + self.qk_rope_head_dim) + 2 * n_q * r
        return self.attention_flops_per_pair


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
    qkv_bias, gated_mlp, norm_params_per_layer, num_experts, experts_per_token, num_shared_experts,
    num_dense_layers, dense_intermediate_size, mlp_bias, o_bias, attention_sinks, kv_lora_rank,
    q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, sliding_window, num_window_layers
    (ModelSpec's attributes of the same names), params (explicit counts), name, aliases, sources,
    context_length (tokens) and context_length_source.

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
        name=json_str(data, "name", owner, key),
        num_layers=_int(data, "num_layers", owner),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_int(data, "num_kv_heads", owner, heads),
        head_dim=head_dim,
        intermediate_size=_int(data, "intermediate_size", owner),
        vocab_size=_int(data, "vocab_size", owner),
        tie_word_embeddings=json_bool(data, "tie_word_embeddings", owner, False),
        qkv_bias=json_bool(data, "qkv_bias", owner, False),
        gated_mlp=json_bool(data, "gated_mlp", owner, True),
        norm_params_per_layer=(
            None if data.get("norm_params_per_layer") is None else json_int(data, "norm_params_per_layer", owner)
        ),
        num_experts=_int(data, "num_experts", owner, 0),
        experts_per_token=_int(data, "experts_per_token", owner, 0),
        num_shared_experts=_int(data, "num_shared_experts", owner, 0),
        num_dense_layers=_int(data, "num_dense_layers", owner, 0),
        dense_intermediate_size=_int(data, "dense_intermediate_size", owner, 0),
        mlp_bias=json_bool(data, "mlp_bias", owner, False),
        o_bias=json_bool(data, "o_bias", owner, False),
        attention_sinks=json_bool(data, "attention_sinks", owner, False),
        kv_lora_rank=_int(data, "kv_lora_rank", owner, 0),
        q_lora_rank=_int(data, "q_lora_rank", owner, 0),
        qk_nope_head_dim=_int(data, "qk_nope_head_dim", owner, 0),
        qk_rope_head_dim=_int(data, "qk_rope_head_dim", owner, 0),
        v_head_dim=_int(data, "v_head_dim", owner, 0),
        sliding_window=_int(data, "sliding_window", owner, 0),
        num_window_layers=_int(data, "num_window_layers", owner, 0),
        param_overrides=tuple(
            sorted((str(k), v) for k, v in params.items() if k in _OVERRIDABLE and v is not None)
        ),
        aliases=tuple(normalize_name(a) for a in json_strings(data, "aliases", owner)),
        sources=json_strings(data, "sources", owner),
        context_length=data.get("context_length"),
        context_length_source=json_str(data, "context_length_source", owner, ""),
    )


_OVERRIDABLE = ("total", "active", "layer", "active_layer", "embed", "lm_head")


def model_from_hf_config(key: str, config: dict[str, Any]) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE,
    DeepSeek-V3, Kimi-K2, gpt-oss, Llama 4 and alike).

    hf_kinds.hf_fields says which config fields are read and how (MLA, shared experts, dense layers,
    Qwen3's q and k norms, gpt-oss's windows, sinks and biases, Llama 4's interleaving and chunks);
    parameter counts are worked out from them (see the module docstring).

    Raises:
        CostModelError: a required key is missing or out of range; the MLP's kind cannot be told; or the
            architecture has parts the formulas do not cover; the message names the field.
    """
    return model_from_dict(key, hf_fields(key, config))


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
            f"unknown model {name!r}{did_you_mean(str(name), _alias_index())}; known models: "
            f"{', '.join(list_models())} (or a path to a .json file)"
        )
    return _presets()[key]
