"""Text <-> token ids: a Tokenizer built from a GGUF file's metadata or a tokenizer.json, the model's
chat template, and incremental detokenization that never cuts a multi-byte character.

Imports allowed: the standard library, tokenizers, jinja2, stallfree.engine.errors.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.engine.errors import ModelLoadError

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# The split pattern of Llama 3's byte-level BPE (its tokenizer.json). SmolLM2 ("smollm") splits
# like GPT-2 after isolating every digit (its tokenizer.json: Digits(individual_digits=True)).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # GGUF tokenizer.ggml.token_type values


class Tokenizer:
    """Encode text to token ids and back, and render chat messages with the model's template.

    Args:
        backend: a `tokenizers.Tokenizer`.
        bos_token_id: the beginning-of-sequence id, or None.
        eos_token_ids: ids that end generation (EOS, end-of-turn), in tokens.
        add_bos: prepend BOS when encoding a prompt that does not already start with it.
        chat_template: a Jinja2 chat template, or None.
    """

    def __init__(
        self,
        backend: Any,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        # Byte-level BPE (GPT-2, Llama 3, SmolLM2) writes every byte as one printable character.
        self._byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
        self._special_ids = frozenset(i for i, t in added.items() if getattr(t, "special", False))

    def token_bytes(self, token_id: int) -> bytes | None:
        """Return the UTF-8 bytes `token_id` adds to decoded text, or None when they are not known.

        Special tokens give b"" (decode skips them). Byte-level BPE vocabularies map each byte to one
        printable character (the GPT-2 scheme); SentencePiece vocabularies spell a raw byte as
        "<0xAB>" and a space as U+2581. Any other piece is taken as its own UTF-8 text.
        """
        if token_id in self._special_ids:
            return b""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode("utf-8")
        m = _BYTE_PIECE.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_str(self, token_id: int | None) -> str:
        """Return the vocabulary string of `token_id` ("" for None or an unknown id)."""
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text`; special-token strings in it become their single ids.

        Tokenizes through encode_batch, which gives the same ids as encode but releases the GIL while
        it works: a 663,000-character prompt took 0.66 s either way, and through encode every other
        Python thread (the server's event loop and step loop) stood still for all of it.
        """
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Return the text of `ids`; incomplete UTF-8 at the end comes out as U+FFFD."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat messages as the prompt text the model was trained on.

        Args:
            messages: dicts with "role" and "content" (str).
            add_generation_prompt: end with the assistant turn's opening.

        Raises:
            ModelLoadError: the model has no chat template.
            ValueError: a message is not a dict with a "role" and a "content", or the template
                itself raised (raise_exception); the message says which.
        """
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template; send a plain prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        template = _compile_template(self.chat_template)
        return str(template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_str(self.bos_token_id),
            eos_token=self.token_str(self.eos_token_ids[0] if self.eos_token_ids else None),
        ))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build a byte-level BPE tokenizer from GGUF tokenizer.ggml.* metadata.

        Args:
            fields: metadata name -> decoded value (lists of str/int, str, int, bool).

        Raises:
            ModelLoadError: the vocabulary is not byte-level BPE ("gpt2"), or its pre-tokenizer
                kind is unknown.
        """
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "point the engine at a Hugging Face directory with tokenizer.json instead"
            )
        pre = fields.get("tokenizer.ggml.pre", "default")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        # Byte-level BPE: the GPT-2 split (built into ByteLevel with use_regex) unless the
        # vocabulary was trained with another split pattern.
        if pre in ("default", "gpt2", "smollm"):
            steps: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
            if pre == "smollm":
                steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        elif pre in ("llama-bpe", "llama3"):
            steps = [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        else:
            raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported "
                                 "(supported: default, gpt2, smollm, llama-bpe)")
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or []
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        backend.add_special_tokens(special)
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in (eos, eot) if i is not None],
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: Path, config: dict[str, Any]) -> Tokenizer:
        """Build from a Hugging Face directory: tokenizer.json, tokenizer_config.json and the
        EOS ids of config.json and generation_config.json.

        Raises:
            ModelLoadError: tokenizer.json is missing.
        """
        from tokenizers import Tokenizer as Backend

        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        backend = Backend.from_file(str(tj))
        tcfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos: list[int] = []
        for source in (gen.get("eos_token_id"), config.get("eos_token_id")):
            eos.extend([source] if isinstance(source, int) else list(source or []))
        named = token_id(tcfg.get("eos_token"))
        if named is not None:
            eos.append(named)
        bos = config.get("bos_token_id", token_id(tcfg.get("bos_token")))
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(backend, bos_token_id=bos, eos_token_ids=eos,
                   add_bos=bool(tcfg.get("add_bos_token", False)), chat_template=template)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_TABLE: dict[str, int] = {}


def _byte_level_decoder() -> dict[str, int]:
    """Printable character -> byte, the inverse of byte-level BPE's byte -> character map.

    Source: the GPT-2 encoder (Radford et al., 2019), also used by the `tokenizers` ByteLevel
    decoder: the bytes 0x21-0x7E, 0xA1-0xAC and 0xAE-0xFF stand for themselves; the other 68 bytes,
    in increasing order, are written as U+0100, U+0101, ...
    """
    if not _BYTE_TABLE:
        shift = 0
        for b in range(256):
            if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
                _BYTE_TABLE[chr(b)] = b
            else:
                _BYTE_TABLE[chr(0x100 + shift)] = b
                shift += 1
    return _BYTE_TABLE


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _compile_template(source: str) -> Any:
    """Compile a chat template in a sandbox, with the whitespace rules chat templates assume."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turn one request's generated ids into text deltas, holding back an incomplete character.

    It decodes a short window of ids twice: up to the ids already turned into text, and up to
    the newest id; the difference is the new text. Text that ends in a UTF-8 sequence still
    incomplete (a lead byte whose continuation bytes may come with the next ids) yields nothing
    until it is complete or can no longer be; bytes that can never become a character whatever
    follows (a stray continuation byte) come out at once as U+FFFD, as the tokenizer's own decode
    writes them, so invalid output never stalls a stream nor grows the window. `flush()` gives the
    rest. The concatenation of every push() and the flush() equals decoding all ids at once.
    Decoding a window rather than one id at a time keeps tokenizers whose pieces depend on their
    neighbours (a leading-space marker) right.

    Whether a trailing U+FFFD is incomplete is decided from the bytes of the ids since the window
    was last emitted (Tokenizer.token_bytes) with Python's incremental UTF-8 decoder, which holds
    back exactly the bytes that a continuation could still complete; so at most the ids of those
    (at most 3) bytes are held. When a token's bytes are not known, at most 3 ids are held (a UTF-8
    character has at most 4 bytes, and each id gives at least one).
    """

    __slots__ = ("_tok", "ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is the window already emitted as text
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        end = len(self.ids)
        after = self._tok.decode(self.ids[self._prefix:])
        if after.endswith("\ufffd"):
            end = self._decided_end()
            if end <= self._read:
                return ""
            if end < len(self.ids):
                after = self._tok.decode(self.ids[self._prefix:end])
        before = self._tok.decode(self.ids[self._prefix:self._read])
        if len(after) > len(before):
            self._prefix, self._read = self._read, end
            return after[len(before):]
        return ""

    def _decided_end(self) -> int:
        """The end (an index into ids) of the ids whose bytes are decided: complete characters or bytes
        that can never become one. Only a trailing UTF-8 sequence that later bytes may still complete is
        undecided; the ids from the one where it starts are held."""
        tail = self.ids[self._read:]
        parts = [self._tok.token_bytes(i) for i in tail]
        if any(p is None for p in parts):
            return len(self.ids) if len(tail) > 3 else self._read
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        data = b"".join(p for p in parts if p is not None)
        decoder.decode(data, final=False)
        start = len(data) - len(decoder.getstate()[0])  # where the undecided bytes begin
        end, seen = self._read, 0
        for part in parts:
            assert part is not None
            if seen + len(part) > start:
                break
            seen += len(part)
            end += 1
        return end

    def flush(self) -> str:
        """Return text held back (a trailing incomplete character comes out as U+FFFD)."""
        before = self._tok.decode(self.ids[self._prefix:self._read])
        after = self._tok.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
