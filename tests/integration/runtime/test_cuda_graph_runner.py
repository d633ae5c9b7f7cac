"""The decode graph runner (`model_executor.cuda_graph_runner`): its buckets, and its bookkeeping
(padding to a bucket, static buffers, the slot table gathered inside the step) through its eager
replay on CPU: the same logits and K/V as the plain decode path, bit for bit, and greedy's tokens
from inside the step. On a GPU (marked gpu), captured graphs replay what the same steps compute
eagerly."""

from __future__ import annotations

import pytest
import torch

from berth_runtime.model_executor.cuda_graph_runner import DecodeGraphRunner, graph_buckets
from berth_runtime.model_executor.forward_batch import ForwardBatch
from tests.integration.runtime.engine_steps import load_runner, prefill

MAX_BS = 16


def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match=">= 1"):
        graph_buckets(0)


@pytest.fixture(scope="module")
def runner():
    """The defaults of a CPU: on one with native bf16, steps of up to 8 sequences (and buckets up
    to 8) on the 4-bit weights, larger ones on bf16."""
    return load_runner(max_total_tokens=2048, max_running_requests=MAX_BS)


def test_a_batch_beyond_the_largest_bucket_is_refused(runner):
    graphs = DecodeGraphRunner(
        runner.model, runner.kv_pool, runner.req_to_token_pool.req_to_token, 4, capture=False
    )
    assert graphs.bucket(3) == 4
    with pytest.raises(ValueError, match="exceeds the graphs' 4"):
        graphs.bucket(5)


@pytest.mark.parametrize("batch_size", [1, 3, 5, 9])
def test_eager_replay_equals_the_plain_decode(runner, batch_size):
    """Ragged sequences decode three steps both ways on the same cache (padded to 1, 4, 8 and
    16 rows): the same logits, greedy's first maxima among them, the same K/V in their slots,
    and nothing written anywhere else but the padding slot."""
    table = runner.req_to_token_pool.req_to_token
    graphs = DecodeGraphRunner(runner.model, runner.kv_pool, table, MAX_BS, capture=False)
    runner.kv_pool.clear()
    runner.kv_pool.kv_buffer.zero_()  # the pool is uninitialised: NaN != NaN would show as a change
    prompts = [[7 + (11 * i + j) % 800 for j in range(5 + 4 * i)] for i in range(batch_size)]
    lens, logits = prefill(runner, prompts)
    feed = logits.argmax(-1).tolist()
    rows = list(range(1, batch_size + 1))
    kv = runner.kv_pool.kv_buffer
    for _ in range(3):
        slots = runner.kv_pool.alloc(batch_size)
        table[torch.tensor(rows), torch.tensor(lens)] = slots
        plain = runner.forward(ForwardBatch.decode(feed, lens, slots, rows, table, runner.device))
        plain_logits = runner.compute_logits(plain)
        after_plain = kv.clone()
        kv[:, slots] = 0
        replayed = graphs.run(feed, lens, slots, rows)
        assert torch.equal(replayed.logits, plain_logits)
        changed = (kv != after_plain).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= {0}, f"slots other than the padding slot changed: {changed}"
        feed = plain_logits.argmax(-1).tolist()
        assert replayed.greedy_ids.tolist() == feed
        lens = [n + 1 for n in lens]


def test_forward_decode_takes_the_graphs_up_to_their_largest_bucket(runner, monkeypatch):
    """ModelRunner.forward_decode replays a graph where one holds the batch and runs larger
    batches eagerly."""
    table = runner.req_to_token_pool.req_to_token
    graphs = DecodeGraphRunner(runner.model, runner.kv_pool, table, 2, capture=False)
    monkeypatch.setattr(runner, "graph_runner", graphs)
    replayed = []
    monkeypatch.setattr(
        graphs,
        "_forward",
        lambda bucket, run=graphs._forward: replayed.append(bucket) or run(bucket),
    )
    for batch_size in (1, 2, 3):
        runner.kv_pool.clear()
        prompts = [[9 + i, 40 + i, 300] for i in range(batch_size)]
        lens, logits = prefill(runner, prompts)
        slots = runner.kv_pool.alloc(batch_size)
        rows = list(range(1, batch_size + 1))
        table[torch.tensor(rows), torch.tensor(lens)] = slots
        decoded = runner.forward_decode(logits.argmax(-1).tolist(), lens, slots, rows)
        assert decoded.logits.shape == (batch_size, runner.config.vocab_size)
        # Greedy's tokens come from the graph's step; an eager step leaves them to the sampler.
        assert (decoded.greedy_ids is None) == (batch_size > 2)
    assert replayed == [1, 2]  # the batch of 3 ran eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_the_eager_steps():
    """On CUDA at its defaults (Triton attention, graphs captured at start): each bucket's
    replay gives what the same padded step computes eagerly through the same buffers."""
    gpu = load_runner(device="cuda", max_total_tokens=4096, max_running_requests=MAX_BS)
    graphs = gpu.graph_runner
    assert gpu.attention_backend == "triton" and graphs is not None
    assert sorted(graphs.graphs) == graph_buckets(MAX_BS)
    table = gpu.req_to_token_pool.req_to_token
    eager = DecodeGraphRunner(gpu.model, gpu.kv_pool, table, MAX_BS, capture=False)
    for batch_size in (1, 3, 9, MAX_BS):
        gpu.kv_pool.clear()
        prompts = [[7 + (11 * i + j) % 800 for j in range(5 + 4 * i)] for i in range(batch_size)]
        lens, logits = prefill(gpu, prompts)
        feed = logits.argmax(-1).tolist()
        rows = list(range(1, batch_size + 1))
        slots = gpu.kv_pool.alloc(batch_size)
        table[torch.tensor(rows, device="cuda"), torch.tensor(lens, device="cuda")] = slots
        replayed = graphs.run(feed, lens, slots, rows)
        replayed_logits, replayed_greedy = replayed.logits.clone(), replayed.greedy_ids.clone()
        expected = eager.run(feed, lens, slots, rows)
        torch.testing.assert_close(replayed_logits, expected.logits, rtol=0, atol=0)
        assert torch.equal(replayed_greedy, expected.greedy_ids)
