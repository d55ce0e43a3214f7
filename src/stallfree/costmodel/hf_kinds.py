"""What a Hugging Face config.json says about the parts the cost model prices: its fields in our
models.json format (hf_fields), whether the MLP is gated (from model_type and hidden_act), and which
fields name an architecture the parameter formulas of model.py do not cover (refused by name rather
than guessed).

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
    "hf_fields",
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


def hf_fields(key: str, config: dict[str, Any]) -> dict[str, Any]:
    """Return the fields of a models.json entry (model.model_from_dict) read from a Hugging Face
    config.json (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, DeepSeek-V3, Kimi-K2, gpt-oss, Llama 4).

    Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default: the
    attention heads), head_dim (default hidden / heads), intermediate_size, vocab_size,
    tie_word_embeddings, num_local_experts (or num_experts, n_routed_experts) and num_experts_per_tok;
    Qwen2 models (model_type 'qwen2') get q/k/v biases, as do configs with attention_bias true (which
    also biases o). The MLP's kind (gated or not) comes from model_type and hidden_act
    (gated_mlp). The newer parts (model.py's docstring gives their parameters):
      - MLA: kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
      - DeepSeek MoE: n_shared_experts, first_k_dense_replace (dense layers of intermediate_size, the
        experts of moe_intermediate_size); moe_layer_freq and decoder_sparse_step must be 1;
      - Qwen3 (qwen3, qwen3_moe): q and k RMSNorms of head_dim each, so norms of 2h + 2d per layer;
      - gpt-oss: layer_types 'sliding_attention' layers over sliding_window tokens, one sink per head,
        biased experts and router;
      - Llama 4 (text_config): one shared expert per MoE layer; interleave_moe_layer_step s puts the
        MoE on every s-th layer and a dense MLP of intermediate_size_mlp on the others; the layers with
        RoPE (three of every four, no_rope_layers) attend in chunks of attention_chunk_size tokens,
        priced as a window of that size (an upper bound: a chunk's first query sees one key).
    The context length is max_position_embeddings (None when the config has none). DeepSeek's
    multi-token-prediction layers (num_nextn_predict_layers) are not counted: serving without
    speculative decoding does not run them.

    Raises:
        CostModelError: a required key is missing or out of range; the MLP's kind cannot be told; or the
            architecture has parts the formulas do not cover (refuse_unpriceable, layer_types
            other than full and sliding attention); the message names the field.
    """
    owner = f"model {key!r} (config.json)"
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        config = text
    refuse_unpriceable(owner, config)
    kind = str(config.get("model_type", "")).lower()
    experts = config.get("num_local_experts", config.get("num_experts", config.get("n_routed_experts"))) or 0
    moe_f = config.get("moe_intermediate_size") if experts else None
    data: dict[str, Any] = {
        "name": config.get("_name_or_path") or key,
        "num_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "num_heads": config.get("num_attention_heads"),
        "num_kv_heads": config.get("num_key_value_heads") or config.get("num_attention_heads"),
        "head_dim": config.get("head_dim"),
        "intermediate_size": moe_f or config.get("intermediate_size"),
        "vocab_size": config.get("vocab_size"),
        # null is transformers' "unset" (its default, untied); a string is left for model_from_dict to refuse.
        "tie_word_embeddings": config.get("tie_word_embeddings") or False,
        "qkv_bias": bool(config.get("attention_bias", False)) or kind == "qwen2",
        "o_bias": bool(config.get("attention_bias", False)),
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
    # Before any arithmetic on them below (a string would concatenate, a list repeat): each count a whole number.
    for field, hf in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                      ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                      ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"),
                      ("vocab_size", "vocab_size"), ("num_experts", "num_experts")):
        value = data[field]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CostModelError(f"{owner}: field {hf!r} must be a whole number >= 0, got {value!r}")
    _newer_parts(owner, kind, config, data)
    return data


def _newer_parts(owner: str, kind: str, config: dict[str, Any], data: dict[str, Any]) -> None:
    """Fill `data` with the MLA, shared-expert, dense-layer, norm and window fields of `config`."""
    if config.get("kv_lora_rank"):
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            data[name] = config.get(name) or 0
        data["head_dim"] = data["qk_nope_head_dim"] + data["qk_rope_head_dim"] or None
    if data["num_experts"]:
        data["num_shared_experts"] = config.get("n_shared_experts") or 0
        dense = config.get("first_k_dense_replace") or 0
        dense_f = config.get("intermediate_size")
        if kind == "llama4_text":
            data["num_shared_experts"] = 1
            step = config.get("interleave_moe_layer_step") or 1
            dense = data["num_layers"] - len(range(step - 1, data["num_layers"], step))
            dense_f = config.get("intermediate_size_mlp") or dense_f
        if dense:
            data["num_dense_layers"] = dense
            data["dense_intermediate_size"] = dense_f
    h, d = data["hidden_size"], data["head_dim"] or data["hidden_size"] // data["num_heads"]
    if kind in ("qwen3", "qwen3_moe"):
        data["norm_params_per_layer"] = 2 * h + 2 * d
    if kind == "gpt_oss":
        data["attention_sinks"] = True
        data["mlp_bias"] = True
    types = config.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise CostModelError(f"{owner}: field 'layer_types' holds {unknown}, which the cost model cannot price")
        windowed = types.count("sliding_attention")
        if windowed:
            data["num_window_layers"] = windowed
            data["sliding_window"] = config.get("sliding_window")
    chunk = config.get("attention_chunk_size")
    if kind == "llama4_text" and chunk:
        rope = config.get("no_rope_layers") or [
            int((i + 1) % (config.get("no_rope_layer_interval") or 4) != 0) for i in range(data["num_layers"])
        ]
        data["num_window_layers"] = sum(1 for x in rope if x)
        data["sliding_window"] = chunk


