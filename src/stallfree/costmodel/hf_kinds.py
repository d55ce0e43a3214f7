"""What a Hugging Face config.json says about the parts the cost model prices: whether the MLP is gated
(from model_type and hidden_act), and which fields name an architecture the parameter formulas of
model.py do not cover (refused by name rather than guessed).

Imports allowed: the standard library and stallfree.costmodel.errors.
"""

from __future__ import annotations

from typing import Any

from stallfree.costmodel.errors import CostModelError

__all__ = [
    "EVERY_LAYER_FIELDS",
    "GATED_MLP_TYPES",
    "PLAIN_MLP_TYPES",
    "UNPRICEABLE_FIELDS",
    "gated_mlp",
    "refuse_unpriceable",
]

#: model_type values whose MLP is gated (three matrices: gate, up, down; SwiGLU or GeGLU).
GATED_MLP_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "gpt_oss",
     "llama4_text", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
     "olmo2", "granite", "cohere", "stablelm", "internlm2", "exaone", "smollm3"}
)
#: model_type values whose MLP has two matrices (up, down) with a plain activation (GELU).
PLAIN_MLP_TYPES = frozenset(
    {"phi", "gpt_neox", "gpt2", "gptj", "gpt_bigcode", "falcon", "opt", "bloom", "starcoder2", "mpt"}
)
#: Config fields of architectures the parameter formulas do not cover, with what each one means.
#: Multi-head latent attention, DeepSeek's routed plus shared experts and dense first layers are read
#: (model.model_from_hf_config); these stay refused.
UNPRICEABLE_FIELDS = {
    "shared_expert_intermediate_size": "a shared expert of its own size beside the routed ones (Qwen2-MoE)",
}

#: Fields whose value other than the one given means MoE on some layers only, in a pattern the
#: formulas do not cover: decoder_sparse_step 1 (Qwen3-MoE) and moe_layer_freq 1 (DeepSeek) mean every
#: layer is MoE (after the first_k_dense_replace dense ones).
EVERY_LAYER_FIELDS = {"decoder_sparse_step": 1, "moe_layer_freq": 1}


def gated_mlp(owner: str, config: dict[str, Any]) -> bool:
    """Return whether the config's MLP is gated, from its model_type (architecture) and hidden_act.

    Known architectures decide (GATED_MLP_TYPES, PLAIN_MLP_TYPES). For another model_type, a SiLU
    activation means a gated (SwiGLU) MLP, as in every SiLU decoder of Hugging Face transformers; any
    other activation is refused rather than guessed, since a gate adds half again the MLP's weights.

    Raises:
        CostModelError: an unknown model_type whose hidden_act is not SiLU; names both fields.
    """
    kind = str(config.get("model_type", "")).lower()
    if kind in GATED_MLP_TYPES:
        return True
    if kind in PLAIN_MLP_TYPES:
        return False
    act = str(config.get("hidden_act", config.get("hidden_activation", ""))).lower()
    if act in ("silu", "swish", "swiglu"):
        return True
    raise CostModelError(
        f"{owner}: cannot tell whether the MLP is gated: model_type {config.get('model_type')!r} is not "
        f"one the cost model knows and hidden_act {config.get('hidden_act')!r} is not SiLU; give a model "
        "file in our format with gated_mlp true or false"
    )


def refuse_unpriceable(owner: str, config: dict[str, Any]) -> None:
    """Refuse a config whose architecture the formulas of model.py do not cover, naming the field.

    Raises:
        CostModelError: a field of UNPRICEABLE_FIELDS is set (non-null, non-zero); a field of
            EVERY_LAYER_FIELDS has another value than 1; mlp_only_layers is not empty; or Qwen-style
            use_sliding_window is true (its max_window_layers split is not priced).
    """
    for name, meaning in UNPRICEABLE_FIELDS.items():
        if config.get(name):
            _refuse(owner, name, config[name], meaning)
    for name, every in EVERY_LAYER_FIELDS.items():
        if config.get(name) not in (None, every):
            _refuse(owner, name, config[name], "MoE layers only every few layers")
    if config.get("mlp_only_layers"):
        _refuse(owner, "mlp_only_layers", config["mlp_only_layers"], "dense layers mixed with MoE layers")
    if config.get("use_sliding_window"):
        _refuse(owner, "use_sliding_window", True, "a sliding window on the layers below max_window_layers")


def _refuse(owner: str, name: str, value: Any, meaning: str) -> None:
    raise CostModelError(
        f"{owner}: field {name!r} = {value!r} means {meaning}, which the cost model cannot price; give a "
        "model file in our format with explicit \"params\" counts instead"
    )
