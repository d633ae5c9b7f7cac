"""ForwardBatch: the tensors of one model step (tokens, positions, KV slots, attention mask), and
DecodeLogits, what a decode step hands the sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from berth_runtime.model_executor.host_inputs import upload


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over B sequences whose new tokens are flattened to T rows.

    A decode step has one new token per sequence (T == B); an extend (prefill) step has
    `extend_lens[b]` new tokens after `prefix_lens[b]` tokens already in the KV cache.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each new token writes
    kv_indices: torch.Tensor  # [B, L] KV slots of every position of each sequence (0 = padding)
    # [B, 1, Q, L] bool, True = may attend (Q = 1 for decode); read by SDPA only (None in
    # CUDA graph steps, whose attention reads each sequence's slots in place).
    attn_mask: torch.Tensor | None
    last_token_index: torch.Tensor  # [B] row in T of each sequence's last new token
    is_decode: bool
    seq_lens: torch.Tensor  # [B] tokens of each sequence in the KV cache after this step
    # Extend only: where each of the T rows sits in the padded [B, Q] query layout, and how many
    # slots each attends to (its position + 1).
    query_batch_index: torch.Tensor | None = None
    query_pos_index: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    # An extend that verifies speculative drafts: its projections take decode's weights.
    verify: bool = False
    # What sliding-window layers read, by window size: made once per step (see `window`).
    _windows: dict[tuple[str, int], tuple[torch.Tensor, ...]] = field(
        default_factory=dict, repr=False
    )

    @property
    def batch_size(self) -> int:
        return int(self.kv_indices.shape[0])

    @property
    def decode_seqs(self) -> int:
        """The sequences of a step that runs on decode's weights (decode or verify); 0 else."""
        return self.batch_size if self.is_decode or self.verify else 0

    def window(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's last `size` positions: their slots [B, min(L, size)] (rows shorter
        than that padded with their last slot) and how many there are [B]; what a decode step of
        a sliding-window layer attends to, through the same kernels as a full one."""
        key = ("slots", size)
        if key not in self._windows:
            length = self.kv_indices.shape[1]
            starts = (self.seq_lens - size).clamp(min=0)
            offsets = torch.arange(min(length, size), device=self.kv_indices.device)
            columns = (starts[:, None] + offsets[None, :]).clamp(max=length - 1)
            self._windows[key] = (self.kv_indices.gather(1, columns), self.seq_lens - starts)
        slots, lens = self._windows[key]
        return slots, lens

    def band_mask(self, size: int | None) -> torch.Tensor:
        """[B, 1, Q, L] True where an extend's query may attend in a sliding window of `size`:
        keys at its position and the `size - 1` before it (cached prefix included); None: every
        key up to its position (causal)."""
        key = ("band", size or 0)
        if key not in self._windows:
            assert self.query_batch_index is not None and self.query_pos_index is not None
            max_q = int(self.query_pos_index.max()) + 1
            device = self.kv_indices.device
            q_pos = torch.full((self.batch_size, max_q), -1, dtype=torch.long, device=device)
            q_pos[self.query_batch_index, self.query_pos_index] = self.positions
            key_pos = torch.arange(self.kv_indices.shape[1], device=device)[None, None, :]
            mask = key_pos <= q_pos[..., None]
            if size is not None:
                mask &= key_pos > q_pos[..., None] - size
            mask[:, :, 0] |= q_pos < 0  # padded query rows attend somewhere (dropped after)
            self._windows[key] = (mask[:, None],)
        return self._windows[key][0]

    @classmethod
    def decode(
        cls,
        input_ids: list[int],
        cached_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_rows: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
        with_mask: bool = True,
    ) -> ForwardBatch:
        """A decode step: one new token after the `cached_lens[b]` tokens of each sequence
        (`with_mask`: build the attention mask, which only SDPA reads)."""
        seq_lens = np.asarray(cached_lens, dtype=np.int64) + 1
        ids, positions, seq_lens_t, rows = upload(
            device,
            np.asarray(input_ids, dtype=np.int64),
            seq_lens - 1,
            seq_lens,
            np.asarray(req_rows, dtype=np.int64),
        )
        max_len = int(seq_lens.max())
        kv_indices = req_to_token[rows, :max_len]
        mask = None
        if with_mask:
            key_pos = torch.arange(max_len, device=device)
            mask = (key_pos[None, :] < seq_lens_t[:, None])[:, None, None, :]
        return cls(
            input_ids=ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            kv_indices=kv_indices,
            attn_mask=mask,
            last_token_index=torch.arange(len(input_ids), device=device),
            is_decode=True,
            seq_lens=seq_lens_t,
        )

    @classmethod
    def extend(
        cls,
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_rows: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
        verify: bool = False,
        with_mask: bool = True,
    ) -> ForwardBatch:
        """A prefill (extend) step: `extend_lens[b]` new tokens after `prefix_lens[b]` cached
        ones. One new token per sequence is still an extend, not a decode: the two may run on
        different weights (see `models.layers.linear.run_linear`), unless `verify` (speculative
        drafts: each token computed as decoding it would). `with_mask`: build the attention mask,
        which only SDPA reads."""
        extend = np.asarray(extend_lens, dtype=np.int64)
        prefix = np.asarray(prefix_lens, dtype=np.int64)
        seq_lens = prefix + extend
        ends = np.cumsum(extend)
        query_batch_index = np.repeat(np.arange(len(extend), dtype=np.int64), extend)
        query_pos_index = (
            np.arange(len(input_ids), dtype=np.int64) - (ends - extend)[query_batch_index]
        )
        positions = prefix[query_batch_index] + query_pos_index
        ids, positions_t, seq_lens_t, rows, batch_index, pos_index, last, prefix_t = upload(
            device,
            np.asarray(input_ids, dtype=np.int64),
            positions,
            seq_lens,
            np.asarray(req_rows, dtype=np.int64),
            query_batch_index,
            query_pos_index,
            ends - 1,
            prefix,
        )
        max_len = int(seq_lens.max())
        mask = None
        if with_mask:
            key_pos = torch.arange(max_len, device=device)
            q_pos = prefix_t[:, None] + torch.arange(int(extend.max()), device=device)[None, :]
            mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L], causal incl. prefix
            mask[:, :, 0] = True  # padded query rows must attend somewhere (results are dropped)
            mask = mask[:, None]
        return cls(
            input_ids=ids,
            positions=positions_t,
            out_cache_loc=out_cache_loc,
            kv_indices=req_to_token[rows, :max_len],
            attn_mask=mask,
            last_token_index=last,
            is_decode=False,
            seq_lens=seq_lens_t,
            query_batch_index=batch_index,
            query_pos_index=pos_index,
            query_lens=positions_t + 1,
            verify=verify,
        )


@dataclass
class DecodeLogits:
    """A decode step's fp32 scores [B, V], and its greedy tokens [B] where the step computed
    them (a CUDA graph's last op); the sampler may change `logits` in place."""

    logits: torch.Tensor
    greedy_ids: torch.Tensor | None = None
