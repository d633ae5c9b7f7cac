"""--load-format dummy: random weights in a config's shapes, served from a directory without any."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from berth_common.cli import berth_command
from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.models.dummy_weights import write_dummy_model_dir
from berth_runtime.models.loader import SOURCE_FILE, ModelSourceError, resolve_model
from berth_runtime.server_args import ServerArgs
from tests.helpers import (
    REDUCED_DTYPE,
    RunningServer,
    embedded_model_dir,
    embedded_tokenizer,
    needs_bf16,
)
from tests.integration.runtime.engine_steps import prefill

# Two layers of a Llama with head_dim 64, so the berth_cpu attention kernels run as on real
# models; the embedded model's tokenizer, so its vocabulary.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("dummy-tiny")
    return write_dummy_model_dir(dst, TINY_CONFIG, Path(embedded_model_dir()))


def load_dummy(path: Path | str, **settings) -> ModelRunner:
    args = ServerArgs(model=str(path), load_format="dummy", max_total_tokens=256, **settings)
    return ModelRunner(str(path), args)


def first_logits(runner: ModelRunner) -> torch.Tensor:
    tokenizer = embedded_tokenizer()
    _, logits = prefill(runner, [tokenizer.encode(p) for p in PROMPTS])
    return logits


def test_the_directory_holds_what_its_source_does_but_the_weights(dummy_dir: Path):
    source = {p.name for p in Path(embedded_model_dir()).iterdir()}
    # Not the model: its weights, the GGUF's 4-bit groups, and the conversion cache's record of
    # the file it came from.
    not_model = {"model.safetensors", "q4", SOURCE_FILE}
    assert {p.name for p in dummy_dir.iterdir()} == source - not_model
    assert "chat_template.jinja" in source  # the chat API needs it


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16)])
def test_random_weights_give_finite_varied_logits(dummy_dir: Path, dtype: str):
    runner = load_dummy(dummy_dir, dtype=dtype)
    logits = first_logits(runner)
    assert logits.shape == (len(PROMPTS), TINY_CONFIG["vocab_size"])
    assert torch.isfinite(logits).all()
    assert (logits.std(dim=-1) > 0).all()  # not one value everywhere
    assert not torch.equal(logits[0], logits[1])  # the prompt matters
    model = runner.model
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert 0.01 < model.embed_tokens.weight.float().std().item() < 0.03  # normal(0, 0.02)


def test_the_seed_decides_the_weights(dummy_dir: Path):
    first, again, other = (
        load_dummy(dummy_dir, dtype="float32", random_seed=seed) for seed in (7, 7, 8)
    )
    embed = first.model.embed_tokens.weight
    assert torch.equal(embed, again.model.embed_tokens.weight)
    assert torch.equal(first_logits(first), first_logits(again))
    assert not torch.equal(embed, other.model.embed_tokens.weight)
    assert not torch.equal(first_logits(first), first_logits(other))


def test_a_gguf_source_keeps_its_shapes_but_not_its_4bit_weights():
    # The converted embedded model has its 4-bit groups on disk: they are real weights, and must
    # not run beside random ones (decode steps would then use the real model's projections).
    runner = load_dummy(embedded_model_dir(), dtype=REDUCED_DTYPE, gguf_q4_max_batch=8)
    assert runner.q4_bytes == 0
    assert runner.num_layers == 30
    assert torch.isfinite(first_logits(runner)).all()


def test_without_dummy_a_directory_without_weights_is_refused(dummy_dir: Path):
    with pytest.raises(ModelSourceError, match=r"has no \*\.safetensors weight files"):
        resolve_model(str(dummy_dir))
    assert resolve_model(str(dummy_dir), load_format="dummy").path == str(dummy_dir)
    result = subprocess.run(
        berth_command("serve", "--model", str(dummy_dir)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"berth serve: error: {dummy_dir} has no *.safetensors weight files"
    )


def test_a_server_answers_from_random_weights(dummy_dir: Path):
    srv = RunningServer(
        "--model",
        str(dummy_dir),
        "--load-format",
        "dummy",
        "--served-model-name",
        "dummy-tiny",
        "--max-total-tokens",
        "2048",
    ).wait_ready()
    try:
        resp = httpx.post(
            f"{srv.base_url}/v1/chat/completions",
            json={
                "model": "dummy-tiny",
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["message"]["content"]
        info = httpx.get(f"{srv.base_url}/get_server_info", timeout=10).json()
        assert info["server_args"]["load_format"] == "dummy"
    finally:
        srv.stop()
