"""Each token's own bytes: what a byte-level or byte-fallback token adds, even half a character.

A token's decoded text cannot say this: on its own, a token holding the first two bytes of a
three-byte character decodes to U+FFFD, whose UTF-8 is three other bytes. OpenAI's
`logprobs.content[].bytes` exist so that a client can join tokens back into characters, and the
detokenizer must know whether a text ends inside a character. The vocabulary as bytes comes from
xgrammar's tokenizer reading (byte-level BPE, SentencePiece byte fallback and raw vocabularies).
"""

from __future__ import annotations

import codecs
from typing import Any


def vocab_bytes(tokenizer: Any) -> list[bytes]:
    """Every token id's bytes, by id (special tokens as their text)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    return [bytes(piece) for piece in info.decoded_vocab]


def incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that is not complete yet."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-3:], final=False)  # a character has at most 4 bytes: 3 can be pending
    pending, _ = decoder.getstate()
    return len(pending)
