"""Text that would get past the pre-tokenization bound: a prompt of multi-byte characters is bounded by
its UTF-8 bytes, and a text long in bytes is tokenized in bounded pieces that stop past the context,
so no prompt costs much more than a context's worth of tokenizing before its 400."""

from __future__ import annotations

import dataclasses

import pytest

from server.fake_engine import FakeEngine
from server.helpers import asgi_client, run
from stallfree.server.app import _PIECE_CHARS

CJK = "\u4e2d"  # three UTF-8 bytes


def _spy(engine: FakeEngine) -> list[int]:
    """Record the length in characters of every text the engine is asked to tokenize."""
    lengths: list[int] = []
    encode = engine.encode

    def spying(text: str) -> list[int]:
        lengths.append(len(text))
        return encode(text)

    engine.encode = spying  # type: ignore[method-assign]
    return lengths


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_multibyte_text_past_the_context_in_bytes_is_refused_untokenized(route):
    """3 x context characters of a three-byte character pass the characters-per-token bound (4 per
    token: 0.75 x context) but not the bytes-per-token one (2.25 x context): a 400 before any tokenizing."""
    eng = FakeEngine(max_model_len=512)
    lengths = _spy(eng)
    text = CJK * (3 * 512)

    async def go():
        async with asgi_client(eng) as c:
            if route == "completions":
                r = await c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
            else:
                r = await c.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})
            return r

    r = run(go())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "at least 1152 tokens" in err["message"] and "4 UTF-8 bytes" in err["message"]
    assert lengths == []


def test_text_past_the_context_is_tokenized_in_bounded_pieces():
    """With no byte bound known (max_token_bytes 0) a 100,000-character prompt is counted in pieces of
    at most _PIECE_CHARS characters and refused once they hold more than the context: it is never
    tokenized whole, and no more than one piece past the context is tokenized."""
    eng = FakeEngine(max_model_len=512)
    eng._info = dataclasses.replace(eng.info, max_token_chars=1000, max_token_bytes=0)
    lengths = _spy(eng)
    text = ("word " * 20_000)

    async def go():
        async with asgi_client(eng) as c:
            return await c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})

    r = run(go())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "already hold at least" in err["message"]
    # one piece, cut after its last space (8,190 characters), already holds 8,190 tokens > 512
    assert lengths == [8190] and lengths[0] <= _PIECE_CHARS


def test_long_in_bytes_text_that_fits_is_served_with_its_exact_tokens():
    """A prompt longer than a piece and of more bytes than the context has tokens, but fewer tokens
    (9,000 three-byte characters, 27,000 bytes, context 10,000), is counted in two pieces, then tokenized
    whole: 200, 9,000 prompt tokens."""
    eng = FakeEngine(max_model_len=10_000, kv_tokens=20_000)
    lengths = _spy(eng)

    async def go():
        async with asgi_client(eng) as c:
            return await c.post("/v1/completions", json={"prompt": CJK * 9000, "max_tokens": 2})

    r = run(go())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 9000
    assert lengths == [_PIECE_CHARS, 9000 - _PIECE_CHARS, 9000]
