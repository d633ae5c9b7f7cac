"""Drive a ModelRunner directly: one batched prefill, then batched decode steps."""

from __future__ import annotations

import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.model_runner import ModelRunner
from berth_runtime.server_args import ServerArgs
from tests.helpers import embedded_model_dir


def load_runner(**settings) -> ModelRunner:
    """The embedded model in a ModelRunner configured as `berth serve` with these settings."""
    return ModelRunner(embedded_model_dir(), ServerArgs(**settings))


def prefill(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
    """Prefill every prompt in one batch (request rows 1..B); returns each prompt's length and
    the logits of its last token."""
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, len(prompts) + 1))
    lens = [len(p) for p in prompts]
    slots = runner.kv_pool.alloc(sum(lens))
    offset = 0
    for row, n in zip(rows, lens):
        table[row, :n] = slots[offset : offset + n]
        offset += n
    ids = [t for p in prompts for t in p]
    batch = ForwardBatch.extend(ids, [0] * len(prompts), lens, slots, rows, table, runner.device)
    hidden = runner.forward(batch)
    return lens, runner.compute_logits(hidden[batch.last_token_index])


def decode_step(runner: ModelRunner, lens: list[int], feed: list[int]) -> torch.Tensor:
    """One decode step of the prefilled sequences (rows 1..B, `lens` tokens cached each, grown
    in place by one) on the tokens `feed`; returns their logits."""
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, len(lens) + 1))
    slots = runner.kv_pool.alloc(len(lens))
    table[torch.tensor(rows), torch.tensor(lens)] = slots
    batch = ForwardBatch.decode(feed, lens, slots, rows, table, runner.device)
    logits = runner.compute_logits(runner.forward(batch))
    lens[:] = [n + 1 for n in lens]
    return logits


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill every prompt in one batch, then decode them together; returns the prefill logits of
    each prompt's last token and every sequence's greedy tokens."""
    lens, logits = prefill(runner, prompts)
    first = logits.clone()
    tokens = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(steps):
        logits = decode_step(runner, lens, [seq[-1] for seq in tokens])
        for seq, t in zip(tokens, logits.argmax(-1).tolist()):
            seq.append(t)
    return first, tokens


def forced_decode_logits(
    runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]
) -> torch.Tensor:
    """Prefill the prompts, then decode them together feeding `tokens[b][i]` at step i (teacher
    forcing, so two runners see the same inputs); returns fp32 logits [steps + 1, B, V]."""
    lens, logits = prefill(runner, prompts)
    out = [logits.float()]
    for step in range(len(tokens[0])):
        out.append(decode_step(runner, lens, [seq[step] for seq in tokens]).float())
    return torch.stack(out)
