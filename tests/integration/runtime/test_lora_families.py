"""LoRA adapters on every kind of architecture Berth serves, with tiny random-weight checkpoints
(`tests.tiny_models`): Llama 3, Qwen3 (QK-norm), Phi-3 (q/k/v and gate/up fused in the
checkpoint, so PEFT targets the fused projections), Gemma 3's multimodal checkpoint (the language
model under `language_model.`, the vision tower's LoRA weights left out) and Qwen3-MoE (attention
only; its experts refused). Greedy tokens equal transformers + PEFT's; Llama 3 also on Triton,
through its interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import RunningServer
from tests.lora_adapters import make_adapter, peft_greedy_ids
from tests.tiny_models import tiny_model_dir

PROMPT = [1, 504, 3067, 282, 260, 2451, 30, 346, 4301, 314]
TOKENS = 12
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {
    "llama3": (*ATTENTION, "gate_proj", "up_proj", "down_proj"),
    "qwen3": (*ATTENTION, "gate_proj", "up_proj", "down_proj"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gemma3-multimodal": (*ATTENTION, "gate_proj", "up_proj", "down_proj"),
    "qwen3-moe": ATTENTION,
}


def generate(server: RunningServer, model: str | None) -> list[int]:
    body: dict = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
    }
    if model is not None:
        body["lora_path"] = model
    response = httpx.post(f"{server.base_url}/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def check_family(family: str, adapter: Path, *args: str, env: dict | None = None) -> None:
    model_dir = tiny_model_dir(family)
    expected = peft_greedy_ids(model_dir, adapter, PROMPT, TOKENS)
    assert expected != peft_greedy_ids(model_dir, None, PROMPT, TOKENS), (
        "the adapter changes nothing"
    )
    server = RunningServer(
        "--model", model_dir, "--dtype", "float32", "--device", "cpu",
        "--lora-paths", f"a={adapter}", *args, env=env,
    ).wait_ready()  # fmt: skip
    try:
        assert generate(server, "a") == expected
        assert generate(server, None) == peft_greedy_ids(model_dir, None, PROMPT, TOKENS)
    finally:
        server.stop()


@pytest.mark.parametrize("family", list(TARGETS))
def test_an_adapter_answers_as_peft(family: str, tmp_path: Path) -> None:
    adapter = make_adapter(
        tmp_path / family,
        seed=7,
        targets=TARGETS[family],
        std=0.2,
        model_dir=tiny_model_dir(family),
    )
    check_family(family, adapter)


def test_on_triton_through_the_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    model_dir = tiny_model_dir("llama3")
    adapter = make_adapter(
        tmp_path / "a", seed=7, targets=TARGETS["llama3"], std=0.2, model_dir=model_dir
    )
    check_family("llama3", adapter, "--attention-backend", "triton", env={"TRITON_INTERPRET": "1"})


def test_moe_experts_are_refused(tmp_path: Path) -> None:
    """An adapter on a MoE model's experts (per-expert projections, as PEFT wrote them before
    transformers fused experts) cannot be served: the server says so at start."""
    model_dir = tiny_model_dir("qwen3-moe")
    adapter = tmp_path / "experts"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    weights = {
        f"{prefix}.lora_A.weight": torch.ones(4, 128),
        f"{prefix}.lora_B.weight": torch.ones(64, 4),
    }
    save_file(weights, adapter / "adapter_model.safetensors")
    server = RunningServer("--model", model_dir, "--device", "cpu", "--lora-paths", f"a={adapter}")
    try:
        with pytest.raises(Exception, match="targets MoE experts"):
            server.wait_ready(timeout=120)
    finally:
        server.stop()
