"""Dummy weights (`--load-format dummy`): random values in the shapes a config.json gives.

For benchmarks and capacity tests of models too large to download: the step times and memory
are the real model's, the answers are noise. `write_dummy_model_dir` makes a directory to serve
them from: a config and a tokenizer, no weight files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where weights are made: writing a directory needs none
    from torch import nn

# What a model directory holds besides its config and weights: the tokenizer, its chat template
# and the generation defaults (EOS ids), whichever the source has.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# Hugging Face's default `initializer_range`, for configs that do not give one.
DEFAULT_INIT_STD = 0.02


def init_dummy_weights(model: nn.Module, seed: int, std: float = DEFAULT_INIT_STD) -> None:
    """Fill every parameter of `model` in place, on its device and in its dtype, as a freshly
    initialized Hugging Face model: matrices (projections, embeddings) normal(0, std), norm
    scales 1, biases 0. The same seed gives the same weights on the same device."""
    import torch

    # A generator of its own: the weights depend on the seed alone, not on what drew before.
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # the only 1-D weights in a decoder are RMSNorm scales
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)


def llama_1b_config() -> dict[str, Any]:
    """A Llama-shaped model of 1.07B parameters (Llama 3.2 1B's layers, in bf16) with the SmolLM2
    tokenizer's vocabulary, so that the embedded model's tokenizer serves it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }


def write_dummy_model_dir(dst: Path, config: dict[str, Any], tokenizer_from: Path) -> Path:
    """Make `dst` a model directory for `--load-format dummy`: `config` as its config.json, and
    the tokenizer files of the Hugging Face directory `tokenizer_from` (never its weights).
    The config's vocab_size must cover the tokenizer's ids."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copyfile(tokenizer_from / name, dst / name)
    return dst
