"""ModelFiles: what the scheduler reads of a model directory besides its weights (the config,
a tokenizer that decodes, the EOS ids), read with torch hidden from transformers where torch is
not loaded yet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from berth_runtime.models.registry import language_config
from berth_runtime.utils.decoding_tokenizer import load_decoding_tokenizer
from berth_runtime.utils.torch_free import torch_hidden


@dataclass
class ModelFiles:
    config: Any  # transformers' PretrainedConfig of the model Berth runs (`language_config`)
    tokenizer: Any  # decodes (see `load_decoding_tokenizer`); xgrammar loads its own
    eos_token_ids: set[int]


def read_model_files(model_path: str) -> ModelFiles:
    """The config, the tokenizer, and every EOS id the tokenizer, the config and the generation
    config name. Called before torch is imported, transformers loads without its torch parts
    (see `torch_hidden`); afterwards, as it comes."""
    with torch_hidden():
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(model_path)
        tokenizer = load_decoding_tokenizer(model_path)
        try:
            generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json
            generation_eos = None
    eos: set[int] = set()
    text_eos = getattr(language_config(config), "eos_token_id", None)
    for value in (
        tokenizer.eos_token_id,
        getattr(config, "eos_token_id", None),
        text_eos,
        generation_eos,
    ):
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(v for v in value if isinstance(v, int))
    return ModelFiles(language_config(config), tokenizer, eos)
