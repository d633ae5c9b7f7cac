"""A token's numbers do not depend on how its prompt reached the engine: prefilled whole, after a
cached prefix, in chunks of any size, next to other prompts, or (with the same weights) decoded.
Checked bit for bit on the engine at the defaults."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.server_args import ServerArgs
from tests.helpers import embedded_tokenizer, needs_bf16
from tests.integration.runtime.chat_prompts import QUESTIONS, prompt_ids
from tests.integration.runtime.engine_steps import load_runner

DEFAULTS = ServerArgs()


def load(**settings) -> ModelRunner:
    """The engine at `berth serve`'s defaults, but for `settings`."""
    return load_runner(max_total_tokens=2048, **settings)


# The defaults in both CPU dtypes (`--dtype auto` picks bf16 where the CPU has it), and what auto
# picks on CPUs without bf16 (AVX2): fp32 with the 4-bit decode path.
SETTINGS = {
    "bf16": {"dtype": "bfloat16"},
    "fp32": {"dtype": "float32"},
    "fp32+q4": {"dtype": "float32", "gguf_q4_max_batch": DEFAULTS.max_running_requests},
}


@pytest.fixture(
    scope="module",
    params=[pytest.param("bf16", marks=needs_bf16), "fp32", "fp32+q4"],
)
def runner(request) -> ModelRunner:
    runner = load(**SETTINGS[request.param])
    assert runner.attention_backend == "berth_cpu", "the defaults run Berth's CPU kernels here"
    assert runner.prepacked
    return runner


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = embedded_tokenizer()
    return [prompt_ids(tokenizer, q) for q in QUESTIONS[:6]]


def run_in_steps(runner: ModelRunner, prompts: list[list[int]], steps: list[list[int]]):
    """Prefill the prompts (rows 1..B) together, step by step: `steps[k][b]` new tokens of prompt
    b in step k (0 = none); returns each prompt's last-token logits from the step that ended it."""
    runner.kv_pool.clear()
    table = runner.req_to_token_pool.req_to_token
    done = [0] * len(prompts)
    last: dict[int, torch.Tensor] = {}
    for step in steps:
        live = [b for b, n in enumerate(step) if n > 0]
        lens = [step[b] for b in live]
        slots = runner.kv_pool.alloc(sum(lens))
        offset, ids = 0, []
        for b, n in zip(live, lens):
            table[b + 1, done[b] : done[b] + n] = slots[offset : offset + n]
            ids += prompts[b][done[b] : done[b] + n]
            offset += n
        batch = ForwardBatch.extend(
            ids, [done[b] for b in live], lens, slots, [b + 1 for b in live], table, runner.device
        )
        logits = runner.compute_logits(runner.forward(batch)[batch.last_token_index])
        for i, (b, n) in enumerate(zip(live, lens)):
            done[b] += n
            if done[b] == len(prompts[b]):
                last[b] = logits[i]
    assert done == [len(p) for p in prompts]
    return [last[b] for b in range(len(prompts))]


def splits(length: int) -> dict[str, list[int]]:
    """Ways to feed a prompt of `length` tokens: the step sizes."""
    return {
        "one-token extend after a cached prefix": [length - 1, 1],
        "three-token extend": [length - 3, 3],
        "half cached": [length // 2, length - length // 2],
        "chunks of 7": [7] * (length // 7) + ([length % 7] if length % 7 else []),
        "chunks of 2": [2] * (length // 2) + ([1] if length % 2 else []),
    }


def test_prefix_caching_and_chunking_give_identical_logits(runner, prompts):
    for prompt in prompts:
        (whole,) = run_in_steps(runner, [prompt], [[len(prompt)]])
        for name, sizes in splits(len(prompt)).items():
            (got,) = run_in_steps(runner, [prompt], [[n] for n in sizes])
            assert torch.equal(got, whole), name


def test_batch_mates_in_a_prefill_do_not_change_logits(runner, prompts):
    alone = [run_in_steps(runner, [p], [[len(p)]])[0] for p in prompts]
    together = run_in_steps(runner, prompts, [[len(p) for p in prompts]])
    # Ragged: one prompt's chunks beside another's whole prefill and a third's cached extend.
    a, b, c = prompts[:3]
    mixed = run_in_steps(runner, [a, b, c], [[10, 0, len(c) - 1], [len(a) - 10, len(b), 1]])
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    for got, want in zip(mixed, alone[:3]):
        assert torch.equal(got, want)


def test_decode_writes_the_kv_of_a_prefill_unless_on_4bit_weights(prompts):
    """Decoding token by token writes the K/V a prefill of the same tokens writes, so the radix
    cache may keep them; on the 4-bit weights of small CPU batches it does not, and says so."""
    prompt = prompts[0]
    for q4, expect_equal in ((0, True), (DEFAULTS.gguf_q4_max_batch, False)):
        runner = load(gguf_q4_max_batch=q4)
        if q4 and runner.q4_bytes == 0:
            pytest.skip("this CPU cannot run the 4-bit GGUF weights")
        assert runner.decode_matches_prefill(1) is expect_equal
        table = runner.req_to_token_pool.req_to_token
        n = len(prompt) - 4  # prefill n tokens, then decode the last 4 one by one
        run_in_steps(runner, [prompt[:n]], [[n]])
        for pos in range(n, len(prompt)):
            slot = runner.kv_pool.alloc(1)
            table[1, pos] = slot[0]
            batch = ForwardBatch.decode([prompt[pos]], [pos], slot, [1], table, runner.device)
            runner.forward(batch)
        decoded = [runner.kv_pool.kv_buffer[layer][table[1, n:]].clone() for layer in (0, 29)]
        run_in_steps(runner, [prompt], [[len(prompt)]])
        prefilled = [runner.kv_pool.kv_buffer[layer][table[1, n:]] for layer in (0, 29)]
        equal = all(torch.equal(d, p) for d, p in zip(decoded, prefilled))
        assert equal is expect_equal
    runner = load(gguf_q4_max_batch=DEFAULTS.gguf_q4_max_batch)
    assert runner.decode_matches_prefill(runner.gguf_q4_max_batch + 1)
    assert not load(attention_backend="torch_native", gguf_q4_max_batch=0).decode_matches_prefill(
        64
    )
