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


@pytest.mark.slow  # loads transformers' tokenizer
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


def _byte_token_ids(tok):
    """byte -> the id of the single-byte token for it (every byte has one in byte-level BPE)."""
    ids = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b is not None and len(b) == 1 and b[0] not in ids:
            ids[b[0]] = i
    return ids


def test_token_bytes_spell_the_emoji(checkpoint):
    """The byte tokens of "🎉" spell its UTF-8 bytes F0 9F 8E 89; a special token is b""."""
    tok = checkpoint.tokenizer
    assert b"".join(tok.token_bytes(i) for i in tok.encode("🎉")) == "🎉".encode()
    assert tok.token_bytes(tok.eos_token_ids[0]) == b""


def test_b35_stray_continuation_bytes_are_released_at_once(checkpoint):
    """Case B35: id 227 (byte 0x89, a continuation byte) pushed 8 times gives U+FFFD each time, not a
    stall; then " ok" comes out, and the whole stream equals decoding all ids at once."""
    tok = checkpoint.tokenizer
    assert tok.token_bytes(227) == b"\x89"
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(227) for _ in range(8)]
    assert pieces == ["\ufffd"] * 8
    ok = tok.encode(" ok")
    pieces += [det.push(i) for i in ok]
    pieces.append(det.flush())
    assert "".join(pieces[8:]) == " ok"
    assert "".join(pieces) == tok.decode([227] * 8 + ok)


def test_incomplete_character_after_invalid_bytes_is_still_held(checkpoint):
    """A stray byte is released, but a lead byte after it (F0, the start of "🎉") is held until the
    character is whole; then the emoji comes out in one piece."""
    tok = checkpoint.tokenizer
    byte_id = _byte_token_ids(tok)
    det = IncrementalDetokenizer(tok)
    assert det.push(byte_id[0x89]) == "\ufffd"
    out = [det.push(byte_id[b]) for b in "🎉".encode()]
    assert out == ["", "", "", "🎉"]


def test_random_byte_streams_equal_whole_decode(checkpoint):
    """Seeded random byte-token streams (valid, truncated and stray bytes mixed): the concatenation
    equals the tokenizer's decode of all ids, and no push holds more than 3 ids back."""
    import random

    tok = checkpoint.tokenizer
    byte_id = _byte_token_ids(tok)
    rng = random.Random(35)
    pool = ["a", "é", "東", "🎉", " ok"]
    for _ in range(60):
        data = b""
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.5:
                data += rng.choice(pool).encode()
            elif kind < 0.75:
                data += bytes([rng.randint(0x80, 0xBF)])  # a stray continuation byte
            else:
                data += rng.choice(pool[1:]).encode()[:-1]  # a truncated character
        ids = [byte_id[b] for b in data]
        det = IncrementalDetokenizer(tok)
        text, held = "", 0
        for i in ids:
            piece = det.push(i)
            held = 0 if piece else held + 1
            assert held <= 3, (data, ids)
            text += piece
        assert text + det.flush() == tok.decode(ids), data
