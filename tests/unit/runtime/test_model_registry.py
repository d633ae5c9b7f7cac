"""Which architecture a config names, and which layers of it slide over a window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from berth_runtime.models.layers.attention import layer_window
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
    ("settings", "windows"),
    [
        ({"sliding_window": 4096}, [4096, 4096]),  # Mistral 7B v0.1, Phi-3: every layer
        ({"sliding_window": None}, [None, None]),  # Mistral 7B v0.3
        ({"sliding_window": 32768, "use_sliding_window": False}, [None, None]),  # Qwen2
        (
            {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]},
            [512, None],
        ),
        ({}, [None, None]),  # Llama
    ],
)
def test_the_layers_that_slide(settings: dict, windows: list[int | None]) -> None:
    config = SimpleNamespace(**settings)
    assert [layer_window(config, layer) for layer in range(2)] == windows
