"""Exceptions raised by the engine.

Imports allowed: the standard library and stallfree.core.

Hierarchy (StallfreeError, from stallfree.core.errors, is the base of every project error)::

    StallfreeError
    ├── EngineError (ValueError)        base of what the engine refuses on purpose
    │   ├── ContextLengthExceeded       prompt + max_tokens is longer than the model's context
    │   ├── InvalidSamplingParams       a SamplingParams field is out of range (names field and value)
    │   ├── InvalidPrompt               an empty prompt, a token id outside the vocabulary, a duplicate rid
    │   ├── UnknownLora                 a request names a LoRA adapter that is not served
    │   ├── InvalidLoraAdapter          an adapter folder, rank, target module or name the engine refuses
    │   └── ModelLoadError              a checkpoint is missing, malformed or of an unsupported kind
    ├── StepFailed (RuntimeError)       a forward pass or sampling raised; see LLMEngine.step (the
    │                                   server raises the same class to the requests of that step)
    └── SchedulerError
        └── RequestRejected (ValueError) the scheduler can never fit it in the KV cache: the core's own
                                        class, re-exported here (one class, stallfree.RequestRejected)

Every EngineError is raised before any state changes, so the caller may catch it and carry on.
"""

from __future__ import annotations

from collections.abc import Hashable

from stallfree.core import RequestRejected as _CoreRequestRejected
from stallfree.core.errors import StallfreeError

__all__ = [
    "ContextLengthExceeded",
    "EngineError",
    "InvalidPrompt",
    "InvalidLoraAdapter",
    "InvalidSamplingParams",
    "ModelLoadError",
    "RequestRejected",
    "StepFailed",
    "UnknownLora",
]


class EngineError(StallfreeError, ValueError):
    """Base class of the engine's refusals; the message names the offending field and value."""


class ContextLengthExceeded(EngineError):
    """A prompt plus max_tokens does not fit in the model's context.

    Attributes:
        prompt_tokens: the prompt's length, in tokens.
        max_tokens: the requested completion length, in tokens.
        max_model_len: the model's context length, in tokens.
    """

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )


class InvalidSamplingParams(EngineError):
    """A SamplingParams field is out of range; the message names the field and its value."""


class InvalidPrompt(EngineError):
    """A prompt is empty, holds a token id outside the vocabulary, or its rid is already live."""


class UnknownLora(EngineError):
    """A request names a LoRA adapter that is not served (the server answers 404).

    Attributes:
        name: the adapter asked for.
        served: the names of the adapters served, sorted.
    """

    def __init__(self, name: str, served: tuple[str, ...]) -> None:
        self.name = name
        self.served = tuple(sorted(served))
        listed = ", ".join(repr(n) for n in self.served) or "none"
        super().__init__(f"LoRA adapter {name!r:.80} is not served; served adapters: {listed}")


class InvalidLoraAdapter(EngineError):
    """A LoRA adapter cannot be loaded or unloaded: a folder without adapter_config.json or
    adapter_model.safetensors, a rank above max_lora_rank, a target module or shape that does not match
    the base model, a name already served (or not served, to unload); the message names it. Nothing
    changes when it is raised: running requests keep their adapters."""


#: The scheduler refused the request: it can never fit in the KV cache (kv_tokens). The core's class itself.
RequestRejected = _CoreRequestRejected


class ModelLoadError(EngineError):
    """A checkpoint could not be loaded: missing file, unsupported architecture or tokenizer."""


class StepFailed(StallfreeError, RuntimeError):
    """A step's forward pass or sampling raised; the original exception is the __cause__.

    The plan stays in flight and no request has advanced: the next step() retries the same plan,
    without the requests aborted in between (LLMEngine.abort works on them). The server's engine loop
    hands the requests of a failed step this same class.

    Attributes:
        rids: the requests in the failed step's batch (empty when not known).
    """

    def __init__(self, message: str, rids: tuple[Hashable, ...] = ()) -> None:
        super().__init__(message)
        self.rids = rids
