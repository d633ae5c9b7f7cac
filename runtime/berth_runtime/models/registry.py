"""The architectures Berth serves: a config's `architectures` entry -> the family's module and
class, importable without torch (the API process checks a model before any weight loads)."""

from __future__ import annotations

import copy
import importlib

# `architectures` in config.json -> (module under berth_runtime.models, class).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    # Gemma 3 4B, 12B and 27B: multimodal checkpoints, served text in, text out.
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
}
# Multimodal architectures whose language model Berth serves: its config is `text_config`.
MULTIMODAL = {"Gemma3ForConditionalGeneration"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# For configs without `architectures`: model_type -> architecture.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def architecture_of(config: dict | object) -> str | None:
    """The first supported architecture a config (config.json's dict, or a transformers config)
    names, or None."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    names = list(get("architectures") or [])
    by_type = ARCHITECTURE_BY_MODEL_TYPE.get(get("model_type") or "")
    if not names and by_type:
        names = [by_type]
    return next((name for name in names if name in ARCHITECTURES), None)


def language_config(config):
    """The config of the model Berth runs: a multimodal checkpoint's `text_config` (naming the
    checkpoint's architecture, whose weights it loads), else `config` itself."""
    architecture = architecture_of(config)
    text = getattr(config, "text_config", None)
    if architecture not in MULTIMODAL or text is None:
        return config
    text = copy.deepcopy(text)
    text.architectures = [architecture]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def model_class(architecture: str) -> type:
    """The CausalLM subclass that serves `architecture` (imports torch)."""
    module, cls = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"berth_runtime.models.{module}"), cls)
