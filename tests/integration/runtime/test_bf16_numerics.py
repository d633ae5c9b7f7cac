"""bf16 that tracks fp32: Berth's bf16 engine, at the defaults and with the CUDA path's settings,
stays at least as close to the fp32 model as Hugging Face transformers' own bf16 does, on the
last-token logprobs of 22 chat prompts and of the README quick start's question."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from berth_runtime.models.layers.logits import EXACT_LOGIT_CANDIDATES
from berth_runtime.server_args import ServerArgs
from tests.helpers import embedded_model_dir, embedded_tokenizer, needs_bf16
from tests.integration.runtime.chat_prompts import QUESTIONS, prompt_ids
from tests.integration.runtime.engine_steps import load_runner, prefill

pytestmark = needs_bf16

# Measured on this model (mean |logprob error| over fp32's top five, 22 chat prompts; 2-core AMD
# EPYC with AVX512-BF16): HF bf16 0.051, Berth defaults 0.044, CUDA-path settings 0.041. The
# bounds allow Berth 5% more than HF, no more.
SLACK = 1.05
TOP = 5
# fp32 ranks (0-based) of tokens far below the leading candidates whose scores Berth recomputes
# with an fp32 result (`exact_top_logits`): theirs come straight from the bf16 forward pass, so
# hidden-state drift would show there. Measured: HF bf16 0.072, defaults 0.058, CUDA path 0.061.
TAIL = slice(100, 110)
# The README quick start: one user message and no system prompt (the chat template then adds
# SmolLM's own), the issue's case: fp32's first token is "The" by 0.08 nats over "L".
QUICK_START = "What is the capital of France?"
CHAT = slice(0, len(QUESTIONS))  # rows of the 22 chat prompts; the quick start's row comes last


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = embedded_tokenizer()
    chat = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    return [*chat, prompt_ids(tokenizer, QUICK_START, system=None)]


def hf_logprobs(prompts: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=dtype).eval()
    with torch.inference_mode():
        rows = [model(torch.tensor([p])).logits[0, -1].float() for p in prompts]
    return torch.log_softmax(torch.stack(rows), dim=-1)


def berth_logprobs(prompts: list[list[int]], **settings) -> torch.Tensor:
    runner = load_runner(max_total_tokens=1024, **settings)
    rows = []
    for prompt in prompts:
        runner.kv_pool.clear()
        rows.append(prefill(runner, [prompt])[1][0])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def errors(logprobs: torch.Tensor, reference: torch.Tensor, ranks: slice) -> torch.Tensor:
    """|logprob - fp32 logprob| [prompts, tokens] over the tokens of each prompt's fp32 `ranks`."""
    tokens = reference.argsort(dim=-1, descending=True)[:, ranks]
    return (logprobs.gather(1, tokens) - reference.gather(1, tokens)).abs()


def deviation(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean |logprob - fp32 logprob| over each prompt's fp32 top tokens."""
    return float(errors(logprobs, reference, slice(0, TOP)).mean())


def worst_prompt(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest per-prompt mean |logprob - fp32 logprob| over fp32's top tokens."""
    return float(errors(logprobs, reference, slice(0, TOP)).mean(dim=1).max())


def margin(logprobs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per prompt, logprob of fp32's first token minus that of its second."""
    top2 = reference.topk(2, dim=-1).indices
    return logprobs.gather(1, top2[:, :1])[:, 0] - logprobs.gather(1, top2[:, 1:])[:, 0]


@pytest.fixture(scope="module")
def fp32_reference(prompts) -> torch.Tensor:
    return hf_logprobs(prompts, torch.float32)


@pytest.fixture(scope="module")
def hf_bf16(prompts) -> torch.Tensor:
    return hf_logprobs(prompts, torch.bfloat16)


def decided(reference: torch.Tensor, noise: float) -> torch.Tensor:
    """Prompts whose fp32 top two tokens are more than twice `noise` apart: any bf16 engine
    should choose fp32's token there (closer ones are a coin toss for HF's bf16 as well)."""
    top2 = reference.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > 2 * noise


def test_fp32_engine_equals_hf_fp32(prompts, fp32_reference):
    got = berth_logprobs(prompts, dtype="float32")
    torch.testing.assert_close(got, fp32_reference, rtol=0, atol=2e-4)


DEFAULTS = ServerArgs()
SETTINGS = {
    "defaults": {
        "attention_backend": DEFAULTS.attention_backend,
        "gguf_q4_max_batch": DEFAULTS.gguf_q4_max_batch,
    },
    # What --device cuda runs (PyTorch's own attention, no 4-bit weights), here on CPU.
    "cuda_path": {"attention_backend": "torch_native", "gguf_q4_max_batch": 0},
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def berth_bf16(request, prompts) -> torch.Tensor:
    """Berth's bf16 last-token logprobs of every prompt, each prefilled alone, per setting."""
    return berth_logprobs(prompts, dtype="bfloat16", **SETTINGS[request.param])


def test_bf16_tracks_fp32_as_closely_as_hf_bf16(berth_bf16, fp32_reference, hf_bf16):
    got, ref, hf = berth_bf16[CHAT], fp32_reference[CHAT], hf_bf16[CHAT]
    ours, theirs = deviation(got, ref), deviation(hf, ref)
    assert ours <= SLACK * theirs, (ours, theirs)
    # Prompt by prompt too: no one prompt drifts further than HF's worst.
    assert worst_prompt(got, ref) <= SLACK * worst_prompt(hf, ref), (
        worst_prompt(got, ref),
        worst_prompt(hf, ref),
    )
    clear = decided(ref, theirs)
    assert int(clear.sum()) >= 18  # most prompts are not near-ties
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_bf16_tracks_fp32_beyond_the_recomputed_candidates(berth_bf16, fp32_reference, hf_bf16):
    """Scores Berth does not recompute in fp32 track fp32 as closely as HF's: the fp32 top
    logits cannot hide a drifting hidden state."""
    got, ref, hf = berth_bf16[CHAT], fp32_reference[CHAT], hf_bf16[CHAT]
    ranked = ref.sort(dim=-1, descending=True).values
    # These tokens are far (over a nat) below every prompt's last recomputed candidate: no bf16
    # rounding brings them among the candidates.
    assert float((ranked[:, EXACT_LOGIT_CANDIDATES - 1] - ranked[:, TAIL.start]).min()) > 1.0
    ours, theirs = float(errors(got, ref, TAIL).mean()), float(errors(hf, ref, TAIL).mean())
    assert ours <= SLACK * theirs, (ours, theirs)


def test_quick_start_first_token_is_fp32s(request, berth_bf16, fp32_reference, hf_bf16):
    """The issue's case: fp32 starts "The capital of France is Paris." by 0.08 nats over "L"
    (L'Étoile...). Berth's bf16 moves the margin no more than HF's bf16, and at the defaults
    picks fp32's token.

    With the CUDA path's settings (PyTorch's SDPA in bf16) the token is a coin toss as it is for
    HF: on a Xeon with AMX, HF's bf16 moves the margin by +0.17 and SDPA's by -0.11, which flips
    a 0.08 margin (on an AMD EPYC both keep "The")."""
    got, ref, hf = berth_bf16[-1], fp32_reference[-1], hf_bf16[-1]
    tokenizer = embedded_tokenizer()
    top2 = ref.topk(2).indices
    assert [tokenizer.decode([int(t)]).strip() for t in top2] == ["The", "L"]
    shift = (margin(got[None], ref[None]) - margin(ref[None], ref[None])).abs()
    hf_shift = (margin(hf[None], ref[None]) - margin(ref[None], ref[None])).abs()
    assert float(shift) <= SLACK * float(hf_shift), (float(shift), float(hf_shift))
    if "defaults" in request.node.callspec.id:
        assert int(got.argmax()) == int(ref.argmax())
