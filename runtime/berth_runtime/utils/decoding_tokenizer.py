"""A tokenizer for the processes that only turn token ids back into text.

The detokenizer and the scheduler (stop strings) need `decode` and the vocabulary, nothing else.
A transformers tokenizer holds its `tokenizers` backend plus about 40 MB more in each process
(its modules, and Python-side copies of the vocabulary), measured on the embedded model. Where a
model directory's `tokenizer.json` is the whole tokenizer, as for the generic classes
transformers loads it into unchanged, `TokenizerJson` decodes exactly as transformers does:
the backend's decode, then the cleanup a config may ask for. Any other class (one whose Python
code may rebuild the backend from its config) loads through transformers as before.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer

# Tokenizer classes that take tokenizer.json as it is: decoding is the backend's decode.
_GENERIC_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class TokenizerJson:
    """`decode` and `get_vocab` of a transformers fast tokenizer, from its backend alone."""

    def __init__(self, backend: Tokenizer, config: dict[str, Any]) -> None:
        self.backend_tokenizer = backend
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # transformers ignores the cleanup for BPE (it would strip real spaces) unless told to.
        if type(backend.model).__name__ == "BPE" and not config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
        ):
            self._clean_up_spaces = False
        eos = _token_text(config.get("eos_token"))
        self.eos_token_id: int | None = backend.token_to_id(eos) if eos else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


def load_decoding_tokenizer(model_path: str) -> Any:
    """`TokenizerJson` where the model's tokenizer.json decodes as transformers would, else the
    transformers tokenizer (call with torch hidden or forbidden: see `utils.torch_free`)."""
    tokenizer = tokenizer_json(model_path)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def tokenizer_json(model_path: str) -> TokenizerJson | None:
    """The model's tokenizer.json, or None where transformers could decode differently: a
    tokenizer class with code of its own, or special tokens the config names that the file does
    not mark special (transformers would add them, and skip them in decoding)."""
    path = os.path.join(model_path, "tokenizer.json")
    config_path = os.path.join(model_path, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    if config.get("tokenizer_class") not in _GENERIC_CLASSES:
        return None
    backend = Tokenizer.from_file(path)
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    named = [_token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        named += [_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    if any(text and text not in special for text in named):
        return None
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        if entry.get("special") and special.get(entry.get("content")) != int(token_id):
            return None
    return TokenizerJson(backend, config)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: English contractions and punctuation rejoined."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def _token_text(token: Any) -> str | None:
    """A special token as a config spells it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None
