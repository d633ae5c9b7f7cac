"""Tiny random-weight models of each family Berth serves, built by transformers itself (2 layers,
seeded) and saved as Hugging Face directories with the embedded model's tokenizer: real
checkpoints of each architecture, with no download. Also transformers' own greedy decoding of
them, the reference Berth must equal."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

from berth_runtime.models.dummy_weights import TOKENIZER_FILES
from tests.helpers import embedded_model_dir

# Shared by every family: the embedded tokenizer's vocabulary and special ids; head dim 64 (one
# the CPU and Triton kernels are built for); two query heads per KV head (GQA).
COMMON: dict[str, Any] = {
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    # Far above transformers' 0.02: random logits then have clear leaders, so a greedy token is
    # never a near-tie that fp32 rounding could flip.
    "initializer_range": 0.2,
}

LONGROPE_ORIGINAL = 128  # the original context of the LongRoPE model

# name -> (transformers config class, its settings beyond COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "qwen3": ("Qwen3Config", {}),
    "qwen3-yarn": (
        "Qwen3Config",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],  # one dense layer among the sparse ones
        },
    ),
    # Every layer sparse, as the released Qwen3-MoE models (and their GGUFs) are.
    "qwen3-moe-sparse": (
        "Qwen3MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "sliding_window": None}),
    # Phi-3.5's and Phi-4-mini's LongRoPE, with partial rotary: short factors within 128 tokens,
    # long ones past them (the prompts here stay within; a decode crosses it in its own test).
    "phi3-longrope": (
        "Phi3Config",
        {
            "hidden_size": 256,  # Phi-3's config checks the factors against hidden / heads
            "partial_rotary_factor": 0.5,
            "sliding_window": None,
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(16)],
                "long_factor": [1.0 + 0.6 * i for i in range(16)],
                "original_max_position_embeddings": LONGROPE_ORIGINAL,
            },
        },
    ),
    "olmo2": ("Olmo2Config", {}),
    # Sliding windows of 24 tokens: the tests' prompts are longer.
    "mistral-sliding": ("MistralConfig", {"sliding_window": 24}),
    # Soft-capped attention scores and final logits: the scores' cap far below Gemma 2's 50, so
    # that it changes which tokens win.
    "gemma2": (
        "Gemma2Config",
        {"sliding_window": 24, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 1.0},
    ),
    # Six layers, Gemma 3's pattern: five slide over 24 tokens, the sixth attends to all.
    "gemma3": (
        "Gemma3TextConfig",
        {"num_hidden_layers": 6, "sliding_window": 24, "query_pre_attn_scalar": 64},
    ),
    # Gemma 3's multimodal checkpoint (as gemma-3-4b-it): the same language model, with a tiny
    # vision tower beside it that Berth does not load.
    "gemma3-multimodal": (
        "Gemma3Config",
        {
            "text_config": {
                "num_hidden_layers": 6,
                "sliding_window": 24,
                "query_pre_attn_scalar": 64,
            },
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            "mm_tokens_per_image": 4,
        },
    ),
}


@functools.cache
def tiny_model_dir(family: str) -> str:
    """The saved directory of `family`'s tiny model (made once per test session)."""
    import torch
    import transformers

    config_class, settings = FAMILIES[family]
    if "text_config" in settings:  # multimodal: the language model's settings go inside
        text = {**COMMON, **settings["text_config"]}
        shared = {key: COMMON[key] for key in ("initializer_range", "tie_word_embeddings")}
        config = getattr(transformers, config_class)(**{**settings, **shared, "text_config": text})
    else:
        config = getattr(transformers, config_class)(**{**COMMON, **settings})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(tempfile.mkdtemp(prefix=f"berth-tiny-{family}-"))
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    source = Path(embedded_model_dir())
    for name in TOKENIZER_FILES:
        if name != "generation_config.json" and (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    return str(path)


@functools.cache
def hf_model(family: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(family), dtype=getattr(torch, dtype)
    )
    return model.eval()


def hf_greedy(family: str, input_ids: list[int], num_tokens: int, dtype: str = "float32"):
    """transformers' argmax decoding with its KV cache, EOS ignored."""
    import torch

    model = hf_model(family, dtype)
    out: list[int] = []
    with torch.inference_mode():
        result = model(torch.tensor([input_ids]), use_cache=True)
        for _ in range(num_tokens):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), cache=result.past_key_values, use_cache=True)
    return out


# Families whose tiny model is also written as a GGUF file: llama.cpp's architecture name.
GGUF_ARCHITECTURES = {"qwen3": "qwen3", "gemma3": "gemma3", "qwen3-moe-sparse": "qwen3moe"}


@functools.cache
def tiny_gguf(family: str) -> str:
    """`family`'s tiny model as a GGUF file with F32 tensors, written by the `gguf` package as
    llama.cpp's converter lays it out (tensor names from gguf's own map; Gemma's norms stored as
    1 + w), with the embedded model's tokenizer: a GGUF of that architecture, no download."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from tests.helpers import embedded_gguf_dir

    arch = GGUF_ARCHITECTURES[family]
    config = hf_model(family).config
    weights = load_file(str(Path(tiny_model_dir(family)) / "model.safetensors"))
    path = Path(tempfile.mkdtemp(prefix=f"berth-tiny-gguf-{family}-")) / f"tiny-{family}.gguf"
    atexit.register(shutil.rmtree, path.parent, True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if family == "gemma3":  # llama.cpp's Gemma 3: one global layer in six (none to write)
        writer.add_sliding_window(config.sliding_window)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    source = gguf.GGUFReader(str(embedded_gguf_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), value_type, sub_type)
    model_arch = getattr(gguf.MODEL_ARCH, arch.upper())
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, tensor in weights.items():
        if ".mlp.experts." in hf_name:  # stacked below, as llama.cpp's ffn_*_exps
            continue
        base, _, suffix = hf_name.rpartition(".")
        if family == "gemma3" and base.endswith("norm"):
            tensor = tensor + 1  # llama.cpp stores Gemma's (1 + w)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.to(torch.float32).numpy())
    for layer in range(config.num_hidden_layers):
        for part in ("gate", "up", "down"):
            key = f"model.layers.{layer}.mlp.experts.{{}}.{part}_proj.weight"
            if key.format(0) in weights:
                experts = [weights[key.format(e)] for e in range(config.num_experts)]
                stacked = torch.stack(experts).to(torch.float32).numpy()
                writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
