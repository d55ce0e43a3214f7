"""Mapping tables between our names and the measured-kernel package's (aiconfigurator-core): GPU presets
onto its systems, engines and their version slots, dtypes onto its quantization modes, and a model
preset onto the config.json the package reads; plus the parser of `--kernels ENGINE[:VERSION]`.

Imports allowed: the standard library and stallfree.costmodel (errors, model). Nothing here imports
the package itself: these are plain tables, so that an error can name what is missing without it.

Source of the tables: aiconfigurator-core 0.12.0 (Apache-2.0, NVIDIA), its systems/*.yaml and
systems/data/<system>/<family>/<engine>/<version>/ folders, and systems/query_versions.yaml (the
version slots: `current`, `previous`, `next`).
"""

from __future__ import annotations

from typing import Any

from stallfree.costmodel.errors import CostModelError
from stallfree.costmodel.model import ModelSpec

__all__ = [
    "BLACKWELL_SYSTEMS",
    "ENGINES",
    "KV_DTYPE_MODES",
    "MOE_DTYPE_MODES",
    "MXFP4_ON_BLACKWELL_TRTLLM",
    "NO_TABLES",
    "PCIE_ONLY_SYSTEMS",
    "PACKAGE_CONFIGS",
    "PACKAGE_FP8_CONFIGS",
    "SYSTEMS",
    "WEIGHT_DTYPE_MODES",
    "architecture_of",
    "config_from_spec",
    "parse_kernels",
    "quant_modes",
    "system_for",
]

#: The engines whose kernels the package measured, by our name (the package's backend names).
ENGINES = ("vllm", "sglang", "trtllm")

#: Our GPU presets that the package holds measured tables for, onto its system names.
SYSTEMS: dict[str, str] = {
    "h100-sxm": "h100_sxm",
    "h200": "h200_sxm",
    "b200": "b200_sxm",
    "gb200": "gb200",
    "a100-sxm-80gb": "a100_sxm",
    "l40s": "l40s",
    "rtx-pro-6000": "rtx_pro_6000_server",
}

#: Our GPU presets without measured tables there, with the reason (a system file without data, or
#: no system at all).
NO_TABLES: dict[str, str] = {
    "h100-pcie": "the package lists h100_pcie but ships no measured tables for it",
    "l4": "the package lists l4 but ships no measured tables for it",
    "a10g": "the package has no a10g system",
    "a40": "the package has no a40 system",
    "l40": "the package has no l40 system (only l40s)",
    "rtx-4090": "the package has no rtx-4090 system",
    "h20": "the package has no h20 system",
    "mi300x": "the package measures NVIDIA GPUs only (no mi300x system)",
}

#: The package's systems whose GPUs are joined by PCIe alone (no NVLink): their systems/*.yaml give
#: intra_node_bw equal to pcie_bw (l40s: PCIe 4.0, 32e9 B/s; rtx_pro_6000_server: PCIe Gen5 x16, 64e9 B/s).
#: vLLM turns its custom all-reduce off on more than two such GPUs and all-reduces with NCCL
#: (vllm/distributed/device_communicators/custom_all_reduce.py: "Custom allreduce is disabled because
#: it's not supported on more than two PCIe-only GPUs").
PCIE_ONLY_SYSTEMS = frozenset({"l40s", "rtx_pro_6000_server"})

#: Our weight dtypes onto the package's GEMM quantization modes (fp8: per-tensor FP8 W8A8; int4:
#: weight-only INT4, its int4_wo; nvfp4: its nvfp4, Blackwell only). mxfp4 leaves the dense GEMMs in
#: bf16 (gpt-oss stores only its experts in MXFP4), so it is priced for MoE models only.
WEIGHT_DTYPE_MODES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "int4": "int4_wo", "nvfp4": "nvfp4",
    "mxfp4": "bfloat16",
}

#: Our weight dtypes onto the package's MoE (routed experts) quantization modes (mxfp4: its
#: w4a16_mxfp4, MXFP4 weights with 16-bit activations, gpt-oss's native format).
MOE_DTYPE_MODES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "int4": "int4_wo", "nvfp4": "nvfp4",
    "mxfp4": "w4a16_mxfp4",
}

#: Our presets whose public config.json the package bundles (its model_configs/<stem>_config.json,
#: Apache-2.0): the kernel backend hands the package that file itself, so the package's own model
#: class (DeepSeek's MLA and shared experts, gpt-oss's windowed layers, Llama 4's interleaving) builds
#: the op list, rather than a Llama- or Mixtral-shaped config written from our ModelSpec.
PACKAGE_CONFIGS: dict[str, str] = {
    "deepseek-v3": "deepseek-ai--DeepSeek-V3",
    "kimi-k2": "moonshotai--Kimi-K2-Instruct",
    "qwen3-8b": "Qwen--Qwen3-8B",
    "qwen3-32b": "Qwen--Qwen3-32B",
    "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B",
    "qwen3-235b-a22b": "Qwen--Qwen3-235B-A22B",
    "gpt-oss-20b": "openai--gpt-oss-20b",
    "gpt-oss-120b": "openai--gpt-oss-120b",
    "llama-4-scout": "meta-llama--Llama-4-Scout-17B-16E-Instruct",
    "llama-4-maverick": "meta-llama--Llama-4-Maverick-17B-128E-Instruct",
}


#: For fp8 weights, the published FP8 checkpoint's config.json where the package bundles it and it differs
#: from the bf16 one only by its block-scaled quantization_config (128 x 128 blocks): the Qwen3 MoE models
#: ship their FP8 weights that way, and the package's vLLM tables price its fp8_block MoE kernels at about
#: half the per-tensor fp8 ones (Qwen3-235B-A22B at tp 4 on H200, 8 decodes at 1,000 tokens: 24.0 against
#: 47.7 ms), so the checkpoint's own format is what is priced.
PACKAGE_FP8_CONFIGS: dict[str, str] = {
    "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B-FP8",
    "qwen3-235b-a22b": "Qwen--Qwen3-235B-A22B-FP8",
}


#: The package's systems of our presets whose GPUs are SM >= 100 (its systems/*.yaml sm_version: b200_sxm and
#: gb200 100, rtx_pro_6000_server 120): TensorRT-LLM runs MXFP4 experts there with MXFP8
#: activations (MXFP4_ON_BLACKWELL_TRTLLM).
BLACKWELL_SYSTEMS = frozenset({"b200_sxm", "gb200", "rtx_pro_6000_server"})

#: The MoE mode of MXFP4 experts (gpt-oss) under TensorRT-LLM on a Blackwell system: MXFP4 weights with
#: MXFP8 activations, the package's w4a8_mxfp4_mxfp8. Why: TensorRT-LLM's
#: ModelConfig.get_mxfp4_quant_algo (tensorrt_llm/_torch/model_config.py) returns W4A8_MXFP4_MXFP8 on
#: SM >= 100 for every MoE backend but Triton unless OVERRIDE_QUANT_ALGO is set, and W4A16_MXFP4 below SM
#: 100. The package's default for an mxfp4 checkpoint, w4a16_mxfp4, is the bf16-activation path; on B200
#: its TensorRT-LLM 1.3.0rc20 table prices gpt-oss-120b's experts at 6.40 ms a step of 4 decodes at tp 1,
#: against 1.80 ms for w4a8_mxfp4_mxfp8 (the whole step 8.03 against 3.43 ms; the bundled row at
#: concurrency 4, ISL 8,192, measured a TPOT of 3.57 ms).
MXFP4_ON_BLACKWELL_TRTLLM = "w4a8_mxfp4_mxfp8"


def quant_modes(dtype: str, config: dict[str, Any], moe: bool, system: str | None = None,
                engine: str | None = None) -> tuple[str, str | None]:
    """Return the package's (GEMM, MoE) quantization modes for our weight `dtype` and a config.json.

    fp8 is block-scaled (the package's fp8_block, 128 x 128 blocks) where the config's
    quantization_config says so (DeepSeek-V3, Kimi-K2 ship that way), else per-tensor. mxfp4 experts
    under engine 'trtllm' on a Blackwell `system` (the package's system name, BLACKWELL_SYSTEMS) are
    MXFP4_ON_BLACKWELL_TRTLLM, elsewhere w4a16_mxfp4. int4 on an MoE model whose compressed-tensors config
    leaves the attention unquantized (Kimi-K2.5) keeps bf16 GEMMs with int4_wo experts. The MoE mode is None
    for a dense model.

    Raises:
        CostModelError: a dtype the package has no mode for here (int8, the package's W8A8 INT8 is
            not mapped), or mxfp4 on a dense model; the message names the dtype.
    """
    if dtype not in WEIGHT_DTYPE_MODES:
        raise CostModelError(
            f"dtype {dtype!r} has no kernel tables here; priced: {', '.join(WEIGHT_DTYPE_MODES)}"
        )
    if dtype == "mxfp4" and not moe:
        raise CostModelError(
            "dtype 'mxfp4' is priced by the kernel tables for MoE experts only (gpt-oss); a dense model's "
            "GEMMs have no MXFP4 tables there"
        )
    gemm, expert = WEIGHT_DTYPE_MODES[dtype], MOE_DTYPE_MODES[dtype]
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    if dtype == "fp8" and isinstance(qc, dict) and qc.get("weight_block_size"):
        gemm = expert = "fp8_block"
    if dtype == "mxfp4" and engine == "trtllm" and system in BLACKWELL_SYSTEMS:
        expert = MXFP4_ON_BLACKWELL_TRTLLM
    if dtype == "int4" and moe and _dense_layers_unquantized(qc):
        gemm = "bfloat16"
    return gemm, (expert if moe else None)

def _dense_layers_unquantized(qc: Any) -> bool:
    """Whether a compressed-tensors quantization_config leaves the attention out of its 4-bit layers (its
    `ignore` list names self_attn, as Kimi-K2.5's INT4 checkpoint does: only the routed experts are INT4,
    attention, shared experts and dense MLPs stay bf16)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return False
    return any("self_attn" in str(name) for name in qc.get("ignore") or ())


#: Our KV cache dtypes onto the package's KV cache modes.
KV_DTYPE_MODES: dict[str, str] = {"bf16": "bfloat16", "fp16": "bfloat16", "fp8": "fp8", "int8": "int8"}


def system_for(gpu_key: str) -> str:
    """Return the package's system name for our GPU preset key (e.g. 'h100-sxm' -> 'h100_sxm').

    Raises:
        CostModelError: the GPU has no measured tables there; the message names the GPU, says why
            and lists the GPUs that have them.
    """
    system = SYSTEMS.get(gpu_key)
    if system is not None:
        return system
    why = NO_TABLES.get(gpu_key, "it is not one of our presets that the package measured")
    raise CostModelError(
        f"gpu {gpu_key!r} has no measured kernel tables: {why}; GPUs with tables: {', '.join(sorted(SYSTEMS))}"
    )


def parse_kernels(text: str) -> tuple[str, str]:
    """Parse `ENGINE[:VERSION]` (vllm, sglang, trtllm; or 'none') into (engine, version).

    VERSION defaults to 'current' (a slot name or a literal version, checked later against the
    package's slots). 'none' gives ('none', '').

    Raises:
        CostModelError: an unknown engine or an empty version; the message names the value.
    """
    engine, _, version = str(text).strip().partition(":")
    engine = engine.strip().lower()
    if engine == "none" and not version:
        return "none", ""
    if engine not in ENGINES:
        raise CostModelError(
            f"--kernels engine must be one of {', '.join(ENGINES)} or none, got {engine!r}"
            + (f" (from {text!r})" if str(text).strip() != engine else "")
        )
    if _ and not version.strip():
        raise CostModelError(f"--kernels {text!r}: the version after ':' is empty")
    return engine, version.strip() or "current"


# ModelSpec fields the kernel backend's Mixtral, Qwen3 and Llama families do not have, with what they mean.
_NOT_MAPPED = (
    ("kv_lora_rank", "multi-head latent attention"),
    ("num_shared_experts", "shared experts"),
    ("num_dense_layers", "dense layers beside the MoE ones"),
    ("num_window_layers", "windowed attention layers"),
    ("attention_sinks", "attention sinks"),
    ("mlp_bias", "biased experts"),
)


def architecture_of(spec: ModelSpec) -> str:
    """Return the Hugging Face architecture the package should build for our model preset.

    MoE presets are Mixtral-style (MixtralForCausalLM); keys starting 'qwen3' are Qwen3ForCausalLM,
    'qwen2' Qwen2ForCausalLM; every other gated-MLP dense preset is Llama-shaped (Llama, Mistral,
    Yi, CodeLlama).

    Raises:
        CostModelError: the MLP is not gated (Falcon's two-matrix GELU MLP): the package's Llama
            family assumes three matrices; or the model has a part these families lack (MLA, shared
            experts, dense layers in an MoE, windowed layers, sinks, biased experts); the message
            names the field.
    """
    for name, meaning in _NOT_MAPPED:
        value = getattr(spec, name)
        if value:
            raise CostModelError(
                f"model {spec.key!r}: {name} = {value!r} ({meaning}) is not mapped onto the measured-kernel "
                "backend; use --kernels none (the roofline prices it)"
            )
    if not spec.gated_mlp:
        raise CostModelError(
            f"model {spec.key!r}: gated_mlp is false (a two-matrix MLP); the measured-kernel backend prices "
            "gated (SwiGLU) MLPs only; use --kernels none"
        )
    if spec.num_experts:
        return "MixtralForCausalLM"
    if spec.key.startswith("qwen3"):
        return "Qwen3ForCausalLM"
    if spec.key.startswith("qwen2"):
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


def config_from_spec(spec: ModelSpec) -> dict[str, Any]:
    """Return a Hugging Face style config.json (as a dict) written from our ModelSpec, for the package.

    Carries exactly the dimensions the cost model knows (layers, hidden, heads, KV heads, head_dim,
    MLP size, vocab, experts, tied embeddings, context length); the rest (activation, norm eps, rope)
    does not change kernel shapes.

    Raises:
        CostModelError: as architecture_of.
    """
    arch = architecture_of(spec)
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": {"MixtralForCausalLM": "mixtral", "Qwen3ForCausalLM": "qwen3",
                       "Qwen2ForCausalLM": "qwen2"}.get(arch, "llama"),
        "hidden_act": "silu",
        "num_hidden_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": spec.context_length or 131072,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
    }
    if spec.num_experts:
        cfg["num_local_experts"] = spec.num_experts
        cfg["num_experts_per_tok"] = spec.experts_per_token
    return cfg

