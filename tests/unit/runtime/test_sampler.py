"""The vectorized sampler: greedy, top-k/top-p/min-p filtering, seeded rows, penalties."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from berth_runtime.model_executor.sampler import (
    SamplingBatchInfo,
    apply_penalties,
    sample,
    sample_rows,
)
from berth_runtime.sampling_params import SamplingParams

VOCAB = 8


def info(params, generators=None):
    gens = generators or [None] * len(params)
    return SamplingBatchInfo.build(params, gens, VOCAB, torch.device("cpu"))


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.tensor([[0.0, 5, 1, 0, 0, 0, 0, 0]] * 2)
    params = [
        SamplingParams(temperature=0.0).normalized(),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    assert sample(logits.clone(), info(params)).tolist() == [1, 1]


@dataclass
class Row:
    """What `sample_rows` reads of a request."""

    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    origin_input_ids: list[int] = field(default_factory=lambda: [1])
    matcher: object = None


def test_greedy_tokens_computed_by_the_step_are_taken_only_for_plain_greedy_rows():
    """A CUDA graph's argmax stands for the sampler's only when every row is plain greedy: a row
    asking for logprobs, or a sampled one, makes the sampler read the logits itself."""
    logits = torch.tensor([[0.0, 5, 1, 0, 0, 0, 0, 0], [0.0, 1, 5, 0, 0, 0, 0, 0]])
    from_step = torch.tensor([3, 4])  # not the logits' argmax: shows which source was read
    greedy = SamplingParams(temperature=0.0).normalized()
    plain = [Row(greedy), Row(greedy)]
    assert sample_rows(logits.clone(), plain, set(), from_step).token_ids == [3, 4]
    assert sample_rows(logits.clone(), plain, set()).token_ids == [1, 2]
    with_logprobs = [Row(greedy), Row(greedy, return_logprob=True)]
    out = sample_rows(logits.clone(), with_logprobs, set(), from_step)
    assert out.token_ids == [1, 2] and out.logprobs[1] is not None
    sampled = [Row(greedy), Row(SamplingParams(temperature=1.0, top_k=2))]
    first, second = sample_rows(logits.clone(), sampled, set(), from_step).token_ids
    assert first == 1 and second in (1, 2)


def test_top_k_never_samples_outside_the_top_k():
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 200
    picked = set(sample(logits, info(params)).tolist())
    assert picked <= {6, 7} and len(picked) == 2


def test_top_p_keeps_the_smallest_set_covering_p():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 0, 0, 0, 0, 0]]) + 1e-9).repeat(300, 1)
    params = [SamplingParams(temperature=1.0, top_p=0.8)] * 300
    assert set(sample(logits, info(params)).tolist()) == {0, 1}


def test_min_p_filters_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05, 0, 0, 0, 0, 0]]) + 1e-9).repeat(300, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * 300
    assert set(sample(logits, info(params)).tolist()) == {0, 1}


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = torch.zeros(3, VOCAB)
    p = SamplingParams(temperature=1.0, seed=42)

    def draw(batch_rows: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        out = []
        for _ in range(10):
            gens = [gen] + [None] * (batch_rows - 1)
            out.append(sample(logits[:batch_rows].clone(), info([p] * batch_rows, gens))[0].item())
        return out

    assert draw(1) == draw(3)


def test_penalties():
    logits = torch.zeros(1, VOCAB)
    apply_penalties(
        logits, 0, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [3, 3, 4], [1]
    )
    assert logits[0, 3].item() == -2.0 and logits[0, 4].item() == -1.5 and logits[0, 1].item() == 0
    logits = torch.tensor([[2.0, -2.0, 2.0, 0, 0, 0, 0, 0]])
    apply_penalties(logits, 0, SamplingParams(repetition_penalty=2.0), [], [0, 1])
    assert logits[0, :3].tolist() == [1.0, -4.0, 2.0]
