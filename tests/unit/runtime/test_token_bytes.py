"""Each token's bytes, read without xgrammar, equal xgrammar's reading for all three vocabulary
kinds; and the API's tokenizer-only processes really run without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import xgrammar
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from berth_runtime.utils.token_bytes import vocab_bytes, vocab_kind
from tests.helpers import embedded_model_dir


def xgrammar_bytes(tokenizer: PreTrainedTokenizerBase) -> list[bytes]:
    return [bytes(p) for p in xgrammar.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A small SentencePiece-style BPE: `▁` for spaces, `<0xAB>` tokens for the other bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁the", "▁cat", "é", "▁", "at", "c", "▁café", "中"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def byte_fallback_tokenizer_without_decoder() -> PreTrainedTokenizerFast:
    """The same vocabulary saved without its decoder: the vocabulary alone must tell."""
    tokenizer = byte_fallback_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()
    return tokenizer


def raw_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "hello": 1, "wörld": 2, "中文": 3, " spaced": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_byte_level_vocabulary_equals_xgrammars_reading(tokenizer: PreTrainedTokenizerBase):
    assert vocab_kind(tokenizer) == "byte_level"
    ours = vocab_bytes(tokenizer)
    assert ours == xgrammar_bytes(tokenizer)
    space_the = tokenizer.convert_tokens_to_ids("Ġthe")
    assert ours[space_the] == b" the"
    assert ours[tokenizer.convert_tokens_to_ids("<|im_start|>")] == b"<|im_start|>"


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (byte_fallback_tokenizer, "byte_fallback"),
        (byte_fallback_tokenizer_without_decoder, "byte_fallback"),
        (raw_tokenizer, "raw"),
    ],
)
def test_other_vocabularies_equal_xgrammars_reading(make, kind):
    tokenizer = make()
    assert vocab_kind(tokenizer) == kind
    ours = vocab_bytes(tokenizer)
    assert ours == xgrammar_bytes(tokenizer)
    if kind == "byte_fallback":
        assert ours[tokenizer.convert_tokens_to_ids("<0x0A>")] == b"\n"
        assert ours[tokenizer.convert_tokens_to_ids("▁café")] == " café".encode()


def test_a_tokenizer_only_process_never_imports_torch():
    """What the API and detokenizer processes do at start, in a fresh interpreter."""
    code = f"""
import sys
from berth_runtime.utils.torch_free import forbid_torch, torch_is_loaded
forbid_torch()
from transformers import AutoTokenizer
from berth_runtime.managers.tokenizer_manager import TokenizerManager
from berth_runtime.utils.token_bytes import vocab_bytes
tokenizer = AutoTokenizer.from_pretrained({str(embedded_model_dir())!r})
chat = [{{"role": "user", "content": "hi"}}]
assert tokenizer.apply_chat_template(chat, add_generation_prompt=True)
assert len(vocab_bytes(tokenizer)) == 49152
assert not torch_is_loaded()
try:
    import torch
except ImportError:
    print("refused")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"
    assert "PyTorch was not found" not in result.stderr
