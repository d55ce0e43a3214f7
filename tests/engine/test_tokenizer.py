"""The tokenizer built from GGUF metadata agrees with transformers' GGUF tokenizer, and incremental
detokenization never cuts a multi-byte character."""

from __future__ import annotations

import pytest

from stallfree.engine.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\tand\ttabs\n\nnew lines",
    "naïve café — déjà vu, 東京, Привет, 🎉🚀",
    "<|im_start|>user\nHi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # it's squared, isn't it?",
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_transformers(checkpoint, hf_tokenizer, text):
    """Token ids equal transformers' for prose, digits, whitespace, Unicode, special tokens and code."""
    ours = checkpoint.tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert checkpoint.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(checkpoint):
    """SmolLM2's pre-tokenizer isolates every digit: "2024" is four tokens."""
    tok = checkpoint.tokenizer
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


def test_incremental_detokenizer_holds_partial_characters(checkpoint):
    """Feeding an emoji's byte tokens one at a time yields "" until the character is whole."""
    tok = checkpoint.tokenizer
    ids = tok.encode("a🎉b")
    assert len(ids) > 3  # the emoji is spelled with byte tokens
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    assert pieces[0] == "a" and pieces[-1] == "b"
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + det.flush() == "a🎉b"
    assert "" in pieces  # at least one step held an incomplete character back


def test_flush_returns_incomplete_tail_as_replacement(checkpoint):
    """A stream that ends inside a character flushes it as U+FFFD."""
    tok = checkpoint.tokenizer
    ids = tok.encode("🎉")
    det = IncrementalDetokenizer(tok)
    assert [det.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.flush() == "\ufffd"


def test_chat_template_rejects_malformed_messages(checkpoint):
    """A message without "content" is refused naming its index."""
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])
