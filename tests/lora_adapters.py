"""PEFT LoRA adapters for the embedded model, made in the test with non-zero random weights, and
the greedy answers transformers + PEFT give with them (the reference Berth must match)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.helpers import embedded_model_dir

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    out_dir: Path,
    seed: int,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    std: float = 0.05,
    model_dir: str | None = None,
) -> Path:
    """Save a LoRA adapter of `model_dir` (default: the embedded model) in `out_dir` (PEFT's own
    format): PEFT zeroes lora_B at init, so every LoRA weight is drawn again, seeded, for the
    adapter to change the answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir or embedded_model_dir(), dtype=torch.float32
    )
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def chat_ids(prompt: str) -> list[int]:
    """The token ids `berth serve` prefills for a chat request of one user message."""
    messages = [{"role": "user", "content": prompt}]
    text = _tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _tokenizer().encode(text, add_special_tokens=False)


def peft_greedy(adapter: Path | None, prompts: list[str], max_new_tokens: int) -> list[str]:
    """transformers' greedy answers (fp32) to each chat prompt, with `adapter` applied (None:
    the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    answers = []
    for prompt in prompts:
        ids = torch.tensor([chat_ids(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
        answers.append(_tokenizer().decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def peft_greedy_ids(
    model_dir: str, adapter: Path | None, input_ids: list[int], num_tokens: int
) -> list[int]:
    """transformers + PEFT's argmax decoding of `model_dir` with `adapter` (fp32, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = torch.tensor([input_ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
