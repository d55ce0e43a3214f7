"""The one input processor (stallfree.engine.inputs): a prompt checked and made a core Request in one place."""

from __future__ import annotations

import pytest

from stallfree.engine.errors import ContextLengthExceeded, EngineError, InvalidPrompt, UnknownLora
from stallfree.engine.inputs import InputProcessor, check_token_ids


def _proc(**kw: object) -> InputProcessor:
    return InputProcessor(lambda text: [ord(c) for c in text], 256, 16, **kw)  # type: ignore[arg-type]


def test_text_is_tokenized_and_made_a_request() -> None:
    """A 3-character text is 3 tokens; the Request carries its length, max_tokens and the fields."""
    p = _proc().process("r1", "abc", 5, priority=2, tenant="t")
    assert p.token_ids == [97, 98, 99]
    r = p.request
    assert (r.rid, r.prompt_len, r.max_new, r.priority, r.tenant, r.lora) == ("r1", 3, 5, 2, "t", None)


@pytest.mark.parametrize(("prompt", "match"), [
    ([1, 256], "token id 256 is outside the vocabulary \\[0, 256\\)"),
    ([-1], "token id -1"),
    ("", "empty"),
    ([], "empty"),
    ([1.5], "string or a list of token ids"),
], ids=["past-vocab", "negative", "empty-text", "empty-ids", "float"])
def test_bad_prompts_are_invalid_prompt(prompt: object, match: str) -> None:
    """Each bad prompt is one InvalidPrompt (an EngineError, a ValueError) naming what is wrong."""
    with pytest.raises(InvalidPrompt, match=match):
        _proc().process("r", prompt, 1)  # type: ignore[arg-type]


def test_context_length_is_its_own_type() -> None:
    """14 prompt tokens + 3 > 16: ContextLengthExceeded with the three numbers, caught by type."""
    with pytest.raises(ContextLengthExceeded) as info:
        _proc().process("r", [1] * 14, 3)
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.max_model_len) == (14, 3, 16)


@pytest.mark.parametrize(("field", "value"), [("priority", True), ("cache_salt", ""), ("tenant", ""),
                                              ("lora", 3)], ids=["priority", "salt", "tenant", "lora"])
def test_bad_fields_name_the_field(field: str, value: object) -> None:
    """A bad request field is an InvalidPrompt whose message names the field."""
    with pytest.raises(InvalidPrompt, match=field):
        _proc().process("r", "a", 1, **{field: value})  # type: ignore[arg-type]


def test_adapters() -> None:
    """Without adapters any name is UnknownLora listing none; with them the id the lookup gives is the Request's."""
    with pytest.raises(UnknownLora, match="served adapters: none"):
        _proc().process("r", "a", 1, lora="x")

    def lookup(name: str) -> int:
        if name != "sql":
            raise UnknownLora(name, ("sql",))
        return 7

    proc = _proc(lora_id=lookup)
    assert proc.process("r", "a", 1, lora="sql").request.lora == 7
    with pytest.raises(UnknownLora, match="'nope' is not served; served adapters: 'sql'") as info:
        proc.process("r", "a", 1, lora="nope")
    assert isinstance(info.value, EngineError) and info.value.served == ("sql",)


def test_block_hashes_come_from_the_engines_function() -> None:
    """The hashes the engine's function returns for (ids, salt) go into the Request unchanged."""
    proc = _proc(block_hashes=lambda ids, salt: (len(ids), salt))
    assert proc.process("r", "abcd", 1, cache_salt="s").request.block_hashes == (4, "s")


def test_check_token_ids_alone() -> None:
    """The server's check is the same function: ids in range pass, the first bad one is named."""
    check_token_ids([0, 255], 256)
    with pytest.raises(InvalidPrompt, match="token id 300"):
        check_token_ids([0, 300, 400], 256)
