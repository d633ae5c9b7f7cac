"""DecodeGraphRunner: decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is bound by its host work and kernel launches, not by the
GPU: several hundred small kernels, each launched from Python. Captured once into a CUDA graph,
the whole step is one launch. A graph replays fixed kernels on fixed memory, so a step's inputs
go through static buffers, and each batch size needs its own graph: batches are padded up to the
next bucket (1, 2, 4, 8, then steps of 8), as in SGLang's CudaGraphRunner.

Per step the host fills one staging buffer (pinned on CUDA) from the scheduler's lists and copies
it to the device in one transfer; each sequence's KV slots are gathered from the request-to-slot
table inside the graph. Nothing is allocated per step. Padding rows decode token 0 at position 0
of request row 0 and write their K/V into the padding slot 0: attention computes every row alone,
so they never touch a real row, and their outputs are dropped.

Without `capture` the runner runs the same steps eagerly through the same buffers and padding:
how CI tests this bookkeeping without a GPU (its outputs equal the plain decode path's).
Graphs need attention that reads K/V in place with no host sync (`triton` on CUDA, `berth_cpu`
in those tests). The graph ends with the lm_head (exact top logits included) and greedy's argmax:
a batch of plain greedy requests takes its tokens straight from the graph, any other sampling
runs after it on the graph's logits.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from berth_runtime.mem_cache.kv_pool import TokenToKVPool
from berth_runtime.model_executor.forward_batch import DecodeLogits, ForwardBatch

logger = logging.getLogger(__name__)

# Rows of the staging and input buffers.
_INPUT_IDS, _POSITIONS, _SEQ_LENS, _REQ_ROWS = range(4)
# What a padding row holds in each: token 0 at position 0 (one slot long) of request row 0.
_PADDING = (0, 0, 1, 0)
_PADDING_COLUMN = np.array(_PADDING, dtype=np.int64)[:, None]  # made once, not per step


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 8, and `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"the largest graph batch must be >= 1, got {max_bs}")
    sizes = {s for s in (1, 2, 4, 8) if s < max_bs} | set(range(16, max_bs, 8)) | {max_bs}
    return sorted(sizes)


class DecodeGraphRunner:
    """Decode steps of up to `max_bs` sequences, padded to a bucket and run through static
    buffers: replayed from CUDA graphs captured at start-up (`capture`), or run eagerly."""

    def __init__(
        self,
        model: nn.Module,
        kv_pool: TokenToKVPool,
        req_to_token: torch.Tensor,
        max_bs: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.buckets = graph_buckets(max_bs)
        self.max_bs = max_bs
        device = req_to_token.device
        self.host = torch.zeros((4, max_bs), dtype=torch.int64, pin_memory=capture)
        self.host_view: np.ndarray = self.host.numpy()  # filled from lists without tensors
        self.inputs = torch.zeros((4, max_bs), dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.row_index = torch.arange(max_bs, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeLogits] = {}
        # Set after each step's copy: the next step must not refill the pinned buffer before
        # the device has read it.
        self.copied: torch.cuda.Event | None = torch.cuda.Event() if capture else None
        self.capture_time_s = 0.0
        if capture:
            self._capture()

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket that holds `batch_size` sequences."""
        for size in self.buckets:
            if size >= batch_size:
                return size
        raise ValueError(f"a decode batch of {batch_size} exceeds the graphs' {self.max_bs}")

    def run(
        self,
        input_ids: list[int] | torch.Tensor,
        cached_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_rows: list[int],
    ) -> DecodeLogits:
        """Logits and greedy tokens of a decode step: one new token after the `cached_lens[b]`
        tokens of each sequence, written to KV slot `out_cache_loc[b]`. The new tokens come
        from the host, or from a device tensor (the previous step's, not yet read back: the
        overlap scheduler). Views of the graph's output buffers: valid until the next step (the
        sampler may change them in place)."""
        batch_size = len(input_ids)
        bucket = self.bucket(batch_size)
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host_view
        on_device = isinstance(input_ids, torch.Tensor)
        host[_INPUT_IDS, :batch_size] = 0 if on_device else input_ids
        host[_POSITIONS, :batch_size] = cached_lens
        host[_SEQ_LENS, :batch_size] = host[_POSITIONS, :batch_size] + 1
        host[_REQ_ROWS, :batch_size] = req_rows
        host[:, batch_size:bucket] = _PADDING_COLUMN
        self.inputs[:, :bucket].copy_(self.host[:, :bucket], non_blocking=True)
        self.out_cache_loc[:batch_size].copy_(out_cache_loc, non_blocking=True)
        self.out_cache_loc[batch_size:bucket].zero_()  # the padding slot
        if on_device:
            self.inputs[_INPUT_IDS, :batch_size].copy_(input_ids)  # after the host copy
        if self.copied is not None:
            self.copied.record()
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            out = self.outputs[bucket]
        else:
            out = self._forward(bucket)
        assert out.greedy_ids is not None
        return DecodeLogits(out.logits[:batch_size], out.greedy_ids[:batch_size])

    def _forward(self, bucket: int) -> DecodeLogits:
        """The model, its lm_head and greedy's argmax over the first `bucket` rows of the static
        buffers (what a graph holds)."""
        input_ids, positions, seq_lens, req_rows = (row[:bucket] for row in self.inputs)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=self.out_cache_loc[:bucket],
            kv_indices=self.req_to_token.index_select(0, req_rows),
            attn_mask=None,  # paged attention reads each sequence's slots through kv_indices
            last_token_index=self.row_index[:bucket],
            is_decode=True,
            seq_lens=seq_lens,
        )
        logits = self.model.compute_logits(self.model(batch, self.kv_pool))
        # max().indices, like argmax, takes the first maximum: what the sampler's greedy takes.
        return DecodeLogits(logits, logits.max(dim=-1).indices)

    def _capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its memory pool), each
        after an eager run on a side stream so that Triton compiles and cuBLAS picks its
        kernels outside the capture."""
        start = time.perf_counter()
        padding = torch.tensor(_PADDING, dtype=torch.int64)[:, None]
        self.inputs.copy_(padding.expand(-1, self.max_bs))  # valid indices for the captures
        pool = torch.cuda.graph_pool_handle()
        warmup = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            warmup.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warmup):
                self._forward(bucket)
            torch.cuda.current_stream().wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - start
        logger.info(
            "Captured %d CUDA graphs for decode batches of 1 to %d sequences in %.2fs",
            len(self.graphs),
            self.max_bs,
            self.capture_time_s,
        )
