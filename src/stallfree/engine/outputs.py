"""What the engine hands back per request and step (RequestOutput); no torch, so that servers and
their tests can use it without the model stack.

Imports allowed: the standard library only.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["RequestOutput"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request emitted in one step.

    Attributes:
        rid: the request.
        new_token_ids: the tokens sampled this step (one per step; EOS and stop tokens included).
        text: the new text of this step; never ends inside a multi-byte character, excludes stop
            strings and the text of EOS / stop tokens, and may be "" while text is held back.
        finished: the request ended this step.
        finish_reason: "stop" (EOS, a stop token or string), "length" (max_tokens) or None.
        num_prompt_tokens: the prompt's length, in tokens.
        num_generated: tokens generated so far, this step's included.
    """

    rid: Hashable
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated: int
