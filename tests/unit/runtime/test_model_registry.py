"""Which architecture a config names, and the sliding window a runner keeps sequences to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from berth_runtime.model_executor.model_runner import sliding_window_of
from berth_runtime.models.registry import SUPPORTED_ARCHITECTURES, architecture_of, model_class


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_supported_architecture_has_a_model_class(architecture: str) -> None:
    assert architecture_of({"architectures": [architecture]}) == architecture
    assert callable(getattr(model_class(architecture), "load_weights", None))


def test_the_first_supported_architecture_wins_and_model_type_stands_in() -> None:
    assert architecture_of({"architectures": ["Nope", "Qwen3ForCausalLM"]}) == "Qwen3ForCausalLM"
    assert architecture_of({"model_type": "qwen3_moe"}) == "Qwen3MoeForCausalLM"
    assert architecture_of(SimpleNamespace(architectures=None, model_type="olmo2")) == (
        "Olmo2ForCausalLM"
    )
    assert architecture_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}) is None


@pytest.mark.parametrize(
    ("settings", "window"),
    [
        ({"sliding_window": 4096}, 4096),  # Mistral 7B v0.1
        ({"sliding_window": None}, None),  # Mistral 7B v0.3
        ({"sliding_window": 32768, "use_sliding_window": False}, None),  # Qwen2/Qwen3
        ({}, None),  # Llama
    ],
)
def test_the_sliding_window_a_runner_keeps_to(settings: dict, window: int | None) -> None:
    assert sliding_window_of(SimpleNamespace(**settings)) == window
