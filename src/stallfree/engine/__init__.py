"""The engine: a Llama-family decoder in PyTorch run step by step under the scheduler, with chunked
prefill and a paged KV cache (needs the `engine` extra: torch, numpy, gguf, tokenizers,
safetensors, jinja2).

Imports allowed: stallfree.core, torch and the engine extra's packages; never stallfree.server or
stallfree.sim. Names are imported lazily, so `import stallfree.engine` (and the CLI's --help)
does not import torch.

Dimensions used in every shape comment of this package (tensors are float32 unless said; bf16 or
fp16 with `dtype`):

    T    tokens in the flat batch of one step (decodes + prefill chunks), <= token budget
    B    sequences (requests) in a step; for attention, the one-token entries (decodes)
    S    rows whose logits are computed (the entries that sample a token)
    L    decoder layers
    d    the model width (hidden size)
    F    the SwiGLU inner width (intermediate size)
    H    query heads;  Hkv  key/value heads (grouped-query attention, H % Hkv == 0)
    D    head dim
    V    vocabulary size
    N    KV slots = num_blocks * block_size
    C    the longest context (keys) attended to by an entry, in tokens

Public API (what the server relies on)::

    eng = LLMEngine.from_pretrained(path=None, token_budget=512, max_seqs=64, kv_tokens=None,
                                    device=None, dtype="float32")
    eng.add_request(rid, "text" or [ids], SamplingParams(max_tokens=16, temperature=0))
    outs = eng.step()      # list[RequestOutput]
    eng.abort(rid); eng.has_unfinished()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stallfree.engine.engine import LLMEngine, default_kv_tokens, engine_config
    from stallfree.engine.errors import (
        ContextLengthExceeded,
        EngineError,
        InvalidPrompt,
        InvalidSamplingParams,
        ModelLoadError,
        RequestRejected,
        StepFailed,
    )
    from stallfree.engine.outputs import RequestOutput
    from stallfree.engine.sampling import SamplingParams

__all__ = [
    "ContextLengthExceeded",
    "EngineError",
    "InvalidPrompt",
    "InvalidSamplingParams",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "StepFailed",
    "default_kv_tokens",
    "engine_config",
]

_WHERE = {
    "LLMEngine": "engine",
    "default_kv_tokens": "engine",
    "engine_config": "engine",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling",
    "ContextLengthExceeded": "errors",
    "EngineError": "errors",
    "InvalidPrompt": "errors",
    "InvalidSamplingParams": "errors",
    "ModelLoadError": "errors",
    "RequestRejected": "errors",
    "StepFailed": "errors",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"stallfree.engine.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
