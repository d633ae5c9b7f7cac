"""Each token's own bytes: what a byte-level or byte-fallback token adds, even half a character.

A token's decoded text cannot say this: on its own, a token holding the first two bytes of a
three-byte character decodes to U+FFFD, whose UTF-8 is three other bytes. OpenAI's
`logprobs.content[].bytes` exist so that a client can join tokens back into characters, and the
detokenizer must know whether a text ends inside a character.

Three kinds of vocabulary, told apart by the tokenizer's decoder as xgrammar tells them: byte-level
BPE (GPT-2's byte-to-character table), SentencePiece with byte fallback (`<0x0A>` tokens, `▁` for a
space) and raw text. Read here rather than through xgrammar, which imports torch: this runs in
the API and detokenizer processes (tests check the two readings agree).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from typing import Any, Literal

VocabKind = Literal["byte_level", "byte_fallback", "raw"]
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def vocab_kind(tokenizer: Any) -> VocabKind:
    """How this Hugging Face tokenizer's tokens spell bytes: from the vocabulary itself where it
    says so plainly, else from the decoder (xgrammar's order: a saved tokenizer's decoder does not
    always describe its vocabulary)."""
    from_vocab = _kind_from_vocab(tokenizer.get_vocab())
    if from_vocab is not None:
        return from_vocab
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow tokenizer has none
    if backend is None:
        return "raw"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return "raw"


def _kind_from_vocab(vocab: dict[str, int]) -> VocabKind | None:
    """Byte fallback: most of the 256 `<0xAB>` pieces are tokens. Byte level: most of GPT-2's
    byte alphabet are one-character tokens and nearly every token is spelt in it (added tokens
    such as chat markers may not be). None: the vocabulary alone does not say."""
    if sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        return "byte_fallback"
    alphabet = byte_level_alphabet()
    if sum(ch in vocab for ch in alphabet) < 128:
        return None
    spelt = sum(all(ch in alphabet for ch in token) for token in vocab)
    return "byte_level" if spelt >= 0.99 * len(vocab) else None


def token_to_bytes(token: str, kind: VocabKind) -> bytes:
    """One vocabulary entry's bytes (a special token, outside the byte alphabet: its text)."""
    if kind == "byte_level":
        alphabet = byte_level_alphabet()
        if all(ch in alphabet for ch in token):
            return bytes(alphabet[ch] for ch in token)
    elif kind == "byte_fallback":
        single = _BYTE_TOKEN.fullmatch(token)
        if single:
            return bytes([int(single.group(1), 16)])
        return token.replace("\u2581", " ").encode()
    return token.encode()


def vocab_bytes(tokenizer: Any) -> list[bytes]:
    """Every token id's bytes, by id (special tokens as their text; an unused id: b"")."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    kind = vocab_kind(tokenizer)
    out = [b""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        out[token_id] = token_to_bytes(token, kind)
    return out


def incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that is not complete yet."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-3:], final=False)  # a character has at most 4 bytes: 3 can be pending
    pending, _ = decoder.getstate()
    return len(pending)
