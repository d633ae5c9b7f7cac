"""Incremental detokenization: UTF-8 safety, no leaked stop strings, equal to a full decode."""

from __future__ import annotations

import pytest

from berth_runtime.io_struct import FinishReason
from berth_runtime.managers.detokenizer_manager import IncrementalDetokenizer, _partial_stop_suffix
from berth_runtime.utils.token_bytes import vocab_bytes
from tests.helpers import embedded_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


@pytest.fixture
def detok(tokenizer) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), vocab_bytes(tokenizer)
    )


def stream(detok, ids, stops=(), finish_last=FinishReason("length")) -> list[str]:
    deltas = []
    for i, token in enumerate(ids):
        finish = finish_last if i == len(ids) - 1 else None
        deltas.append(detok.step("r", [token], finish, list(stops), True))
    return deltas


def test_token_by_token_equals_full_decode(tokenizer, detok):
    text = "Hello, wörld! 東京は日本の首都です。 Emoji: 🚀🎉 done."
    ids = tokenizer(text).input_ids
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas), "a partial UTF-8 character leaked"


def test_multibyte_character_is_held_until_complete(tokenizer, detok):
    ids = tokenizer("🚀").input_ids
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    deltas = stream(detok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🚀"


@pytest.mark.parametrize("text", ["日", "ab日本", "x 🚀"])
def test_an_answer_cut_inside_a_character_ends_before_it(tokenizer, detok, text):
    ids = tokenizer(text).input_ids
    for cut in range(1, len(ids) + 1):
        joined = "".join(stream(detok, ids[:cut]))
        assert "\ufffd" not in joined
        assert text.startswith(joined)
    assert "".join(stream(detok, ids)) == text


def test_stop_string_is_cut_and_never_streamed(tokenizer, detok):
    ids = tokenizer("The answer is 42. STOP here please").input_ids
    deltas = stream(
        detok, ids, stops=["STOP"], finish_last=FinishReason("stop", matched_str="STOP")
    )
    assert "".join(deltas) == "The answer is 42. "
    assert not any("S" in d for d in deltas), "part of the stop string was emitted early"


def test_text_resembling_a_stop_prefix_is_released_when_it_diverges(tokenizer, detok):
    ids = tokenizer("a STOrm came").input_ids
    deltas = stream(detok, ids, stops=["STOP"])
    assert "".join(deltas) == "a STOrm came"


def test_stop_token_is_not_part_of_the_text(tokenizer, detok):
    ids = tokenizer("Paris").input_ids + [2]  # 2 = <|im_end|>
    out = detok.step("r", ids, FinishReason("stop", matched_token=2), [], False)
    assert out == "Paris"


def test_state_is_dropped_when_finished(detok, tokenizer):
    detok.step("r", tokenizer("hi").input_ids, FinishReason("length"), [], True)
    assert "r" not in detok.states


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [("abc ST", ["STOP"], 2), ("abc", ["STOP"], 0), ("xx<|", ["<|end|>", "<"], 2), ("S", ["S"], 0)],
)
def test_partial_stop_suffix(text, stops, expected):
    assert _partial_stop_suffix(text, stops) == expected
