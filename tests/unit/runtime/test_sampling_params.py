"""SamplingParams validation and normalization."""

from __future__ import annotations

import pytest

from berth_runtime.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 100


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_new_tokens": -1}, "max_tokens"),
        ({"min_new_tokens": -1}, "min_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ],
)
def test_invalid_values_name_the_field(fields, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**fields).verify(VOCAB)
    assert info.value.param == param


def test_valid_params_pass():
    SamplingParams(
        max_new_tokens=10,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        stop=["x"],
        stop_token_ids=[1],
        logit_bias={5: -100.0},
        presence_penalty=1,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        seed=3,
    ).verify(VOCAB)


def test_zero_temperature_normalizes_to_greedy():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=10).normalized()
    assert params.is_greedy
    assert (params.top_k, params.top_p) == (1, 1.0)


def test_stop_strings_are_deduplicated_and_empty_ones_dropped():
    assert SamplingParams(stop=["a", "", "b", "a"]).normalized().stop == ["a", "b"]


def test_penalty_flags():
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
