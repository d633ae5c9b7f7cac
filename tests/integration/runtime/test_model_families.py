"""Every family Berth serves, as a user serves it: `berth serve --model DIR --dtype float32` on a
tiny random-weight checkpoint that transformers wrote (tests/tiny_models.py) gives transformers'
own greedy tokens, for a prompt prefilled in chunks, then again with that prompt as a cached
prefix, with sliding windows shorter than the prompts where the family has them. An MoE family and
a sliding-window one also run the CUDA path's attention (Triton, interpreted on CPU) and PyTorch's
SDPA. In bf16, each family stays as close to fp32 as transformers' own bf16 does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.server_args import ServerArgs
from berth_runtime.utils import cpu_isa
from tests.helpers import RunningServer
from tests.integration.runtime.engine_steps import prefill
from tests.tiny_models import (
    FAMILIES,
    GGUF_ARCHITECTURES,
    hf_greedy,
    hf_model,
    tiny_gguf,
    tiny_model_dir,
)

CHUNK = 32  # --chunked-prefill-size: the long prompt is prefilled in several chunks
LONG_PROMPT = [(7919 * i) % 40000 + 100 for i in range(100)]
FOLLOW_UP = LONG_PROMPT + [(104729 * i) % 40000 + 100 for i in range(12)]
NUM_TOKENS = 16

# (family, --attention-backend, extra environment)
INTERPRETED = {"TRITON_INTERPRET": "1"}
CASES = [(family, "auto", {}) for family in FAMILIES] + [
    ("qwen3-moe", "triton", INTERPRETED),
    ("mixtral", "triton", INTERPRETED),
    ("gemma3", "triton", INTERPRETED),
    ("gemma3", "torch_native", {}),
    ("mistral-sliding", "torch_native", {}),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-{case[1]}")
def served(request) -> Iterator[tuple[str, str, RunningServer]]:
    family, backend, env = request.param
    if backend == "triton":
        pytest.importorskip("triton")
    server = RunningServer(
        "--model",
        tiny_model_dir(family),
        "--dtype",
        "float32",
        "--chunked-prefill-size",
        str(CHUNK),
        "--attention-backend",
        backend,
        "--device",
        "cpu",
        env=env,
    )
    try:
        yield family, backend, server.wait_ready()
    finally:
        server.stop()


def generate(base_url: str, input_ids: list[int]) -> dict:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(f"{base_url}/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_tokens_equal_transformers_chunked_then_cached(served) -> None:
    family, _, server = served
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
    assert info["server_args"]["chunked_prefill_size"] == CHUNK

    first = generate(server.base_url, LONG_PROMPT)
    assert first["output_ids"] == hf_greedy(family, LONG_PROMPT, NUM_TOKENS)

    again = generate(server.base_url, FOLLOW_UP)
    assert again["meta_info"]["cached_tokens"] >= len(LONG_PROMPT) - CHUNK  # the prefix, reused
    assert again["output_ids"] == hf_greedy(family, FOLLOW_UP, NUM_TOKENS)


def test_the_server_names_its_architecture_and_backend(served) -> None:
    family, backend, server = served
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
    config = json.loads((Path(tiny_model_dir(family)) / "config.json").read_text())
    assert info["engine"]["architecture"] == config["architectures"][0]
    if backend != "auto":
        assert info["engine"]["attention_backend"] == backend
    moe = "num_experts" in config or "num_local_experts" in config
    # MoE experts run fused on Triton (CUDA, or its interpreter here), grouped elsewhere.
    expected = ("fused" if backend == "triton" else "grouped") if moe else None
    assert info["engine"]["moe_experts"] == expected


# Berth's bf16 may round differently from transformers' bf16 (fused norms, prepacked oneDNN
# projections, its own attention kernels), but no worse: its distance from the fp32 reference is
# held to HF bf16's own, with this much slack (measured on a Zen 4: at most 1.3x).
BF16_DRIFT_SLACK = 1.5


@pytest.mark.skipif(cpu_isa.bf16_problem() is not None, reason="bf16 needs AVX-512 on CPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_drifts_from_fp32_no_more_than_transformers_bf16(family: str) -> None:
    directory = tiny_model_dir(family)
    runner = ModelRunner(directory, ServerArgs(model=directory, dtype="bfloat16"))
    prompts = [LONG_PROMPT[:40], LONG_PROMPT[40:90], FOLLOW_UP[-30:]]
    _, logits = prefill(runner, prompts)
    ours, theirs = [], []
    with torch.inference_mode():
        for prompt, row in zip(prompts, logits):
            ids = torch.tensor([prompt])
            exact = hf_model(family, "float32")(ids).logits[0, -1].float()
            bf16 = hf_model(family, "bfloat16")(ids).logits[0, -1].float()
            ours.append((row.float() - exact).abs().max().item())
            theirs.append((bf16 - exact).abs().max().item())
    assert max(ours) <= BF16_DRIFT_SLACK * max(theirs), (ours, theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_scores_equal_transformers(family: str) -> None:
    """Not just the winners: every vocabulary score of a prompt's last token, soft-capped where
    the family caps them (Gemma 2), equals transformers' to fp32 rounding."""
    directory = tiny_model_dir(family)
    runner = ModelRunner(directory, ServerArgs(model=directory, dtype="float32"))
    _, logits = prefill(runner, [LONG_PROMPT])
    with torch.inference_mode():
        expected = hf_model(family, "float32")(torch.tensor([LONG_PROMPT])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected.float(), atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("family", GGUF_ARCHITECTURES)
def test_a_gguf_of_the_family_serves_transformers_greedy_tokens(family: str, tmp_path) -> None:
    """`berth serve --model FILE.gguf`: a GGUF written by the `gguf` package (F32 tensors, as
    llama.cpp's converter names them) is converted once and served as the family it is."""
    server = RunningServer(
        "--model",
        tiny_gguf(family),
        "--model-cache-dir",
        str(tmp_path),
        "--dtype",
        "float32",
        "--device",
        "cpu",
    )
    try:
        server.wait_ready()
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
        config = json.loads((Path(tiny_model_dir(family)) / "config.json").read_text())
        assert info["engine"]["architecture"] == config["architectures"][0]
        got = generate(server.base_url, LONG_PROMPT)["output_ids"]
        assert got == hf_greedy(family, LONG_PROMPT, NUM_TOKENS)
    finally:
        server.stop()


def test_longrope_decodes_past_the_original_context_as_transformers_does() -> None:
    """A prompt within LongRoPE's original context (128), decoded past it: the positions beyond
    rotate with the long factors, as transformers rotates them when it decodes there."""
    prompt = LONG_PROMPT[:110]
    server = RunningServer(
        "--model", tiny_model_dir("phi3-longrope"), "--dtype", "float32", "--device", "cpu"
    ).wait_ready()
    try:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
        }
        response = httpx.post(f"{server.base_url}/generate", json=body, timeout=600)
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == hf_greedy("phi3-longrope", prompt, 40)
    finally:
        server.stop()
