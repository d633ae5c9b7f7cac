"""Drive a ModelRunner directly: one batched prefill, then batched greedy decode steps."""

from __future__ import annotations

import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch
from berth_runtime.model_executor.model_runner import ModelRunner


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill every prompt in one batch, then decode them together; returns the prefill logits of
    each prompt's last token and every sequence's greedy tokens."""
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, len(prompts) + 1))
    lens = [len(p) for p in prompts]
    slots = runner.kv_pool.alloc(sum(lens))
    offset = 0
    for row, n in zip(rows, lens):
        table[row, :n] = slots[offset : offset + n]
        offset += n
    ids = [t for p in prompts for t in p]
    batch = ForwardBatch.build(ids, [0] * len(prompts), lens, slots, rows, table, runner.device)
    hidden = runner.forward(batch)
    logits = runner.compute_logits(hidden[batch.last_token_index])
    first = logits.clone()
    tokens = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(steps):
        slots = runner.kv_pool.alloc(len(prompts))
        table[torch.tensor(rows), torch.tensor(lens)] = slots
        last = [seq[-1] for seq in tokens]
        ones = [1] * len(prompts)
        batch = ForwardBatch.build(last, lens, ones, slots, rows, table, runner.device)
        logits = runner.compute_logits(runner.forward(batch))
        lens = [n + 1 for n in lens]
        for seq, t in zip(tokens, logits.argmax(-1).tolist()):
            seq.append(t)
    return first, tokens


def forced_decode_logits(
    runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]
) -> torch.Tensor:
    """Prefill the prompts, then decode them together feeding `tokens[b][i]` at step i (teacher
    forcing, so two runners see the same inputs); returns fp32 logits [steps + 1, B, V]."""
    table = runner.req_to_token_pool.req_to_token
    rows = list(range(1, len(prompts) + 1))
    lens = [len(p) for p in prompts]
    slots = runner.kv_pool.alloc(sum(lens))
    offset = 0
    for row, n in zip(rows, lens):
        table[row, :n] = slots[offset : offset + n]
        offset += n
    ids = [t for p in prompts for t in p]
    batch = ForwardBatch.build(ids, [0] * len(prompts), lens, slots, rows, table, runner.device)
    hidden = runner.forward(batch)
    out = [runner.compute_logits(hidden[batch.last_token_index]).float()]
    for step in range(len(tokens[0])):
        slots = runner.kv_pool.alloc(len(prompts))
        table[torch.tensor(rows), torch.tensor(lens)] = slots
        feed = [seq[step] for seq in tokens]
        ones = [1] * len(prompts)
        batch = ForwardBatch.build(feed, lens, ones, slots, rows, table, runner.device)
        out.append(runner.compute_logits(runner.forward(batch)).float())
        lens = [n + 1 for n in lens]
    return torch.stack(out)
