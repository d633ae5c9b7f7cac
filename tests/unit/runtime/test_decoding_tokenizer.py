"""The decode-only tokenizer (`utils.decoding_tokenizer`) decodes exactly as transformers does,
and falls back to transformers wherever its code or config could make the two differ."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from berth_runtime.utils.decoding_tokenizer import (
    TokenizerJson,
    clean_up_tokenization,
    load_decoding_tokenizer,
    tokenizer_json,
)
from berth_runtime.utils.token_bytes import vocab_bytes
from tests.helpers import embedded_model_dir, embedded_tokenizer


@pytest.fixture(scope="module")
def embedded() -> TokenizerJson:
    tokenizer = tokenizer_json(embedded_model_dir())
    assert isinstance(tokenizer, TokenizerJson)
    return tokenizer


def test_embedded_model_decodes_as_transformers_does(embedded):
    hf = embedded_tokenizer()
    rng = random.Random(0)
    vocab = len(hf.get_vocab())
    specials = sorted(hf.all_special_ids)
    texts = ["The capital of France is Paris.", "naïve café 中文 🙂\n\tcode:  x = 1", " a  b "]
    cases = [hf.encode(t, add_special_tokens=False) for t in texts]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    cases += [[*specials, *case, specials[0]] for case in cases[:50]]
    for ids in cases:
        for skip in (False, True):
            assert embedded.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
    assert embedded.get_vocab() == hf.get_vocab()
    assert embedded.eos_token_id == hf.eos_token_id == 2
    assert vocab_bytes(embedded) == vocab_bytes(hf)


def copy_model_tokenizer(tmp_path: Path, **config_changes) -> Path:
    source = Path(embedded_model_dir())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_tokenizer_class_with_code_of_its_own_loads_through_transformers(tmp_path):
    path = copy_model_tokenizer(tmp_path, tokenizer_class="GPT2Tokenizer")
    assert tokenizer_json(str(path)) is None
    assert not isinstance(load_decoding_tokenizer(str(path)), TokenizerJson)


def test_special_tokens_the_file_does_not_mark_load_through_transformers(tmp_path):
    # transformers would add "Paris" as a special token and skip it when decoding.
    path = copy_model_tokenizer(tmp_path, additional_special_tokens=["Paris"])
    assert tokenizer_json(str(path)) is None
    path = copy_model_tokenizer(
        tmp_path, added_tokens_decoder={"7": {"content": "not-the-token-7", "special": True}}
    )
    assert tokenizer_json(str(path)) is None


def test_no_tokenizer_json_means_no_tokenizer_json(tmp_path):
    assert tokenizer_json(str(tmp_path)) is None


def test_cleanup_follows_the_config_and_is_never_applied_to_bpe(tmp_path):
    # A WordPiece-style tokenizer whose config asks for transformers' cleanup.
    vocab = {"[UNK]": 0, "hello": 1, ",": 2, "world": 3, "!": 4, "don": 5, "'": 6, "t": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(cleanup=False)
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True, "tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [1, 2, 3, 4]
    raw = backend.decode(ids)
    assert raw == "hello , world !"
    tokenizer = tokenizer_json(str(tmp_path))
    assert tokenizer is not None and tokenizer.decode(ids) == "hello, world!"

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path)).decode(ids) == "hello, world!"
    # The embedded model is BPE: the same config flag changes nothing there, as in transformers.
    (tmp_path / "bpe").mkdir()
    bpe = copy_model_tokenizer(tmp_path / "bpe", clean_up_tokenization_spaces=True)
    ids = embedded_tokenizer().encode("Hello , world !", add_special_tokens=False)
    assert tokenizer_json(str(bpe)).decode(ids) == "Hello , world !"


def test_clean_up_tokenization_rejoins_contractions_and_punctuation():
    assert clean_up_tokenization("I do n't know , it 's fine .") == "I don't know, it's fine."
