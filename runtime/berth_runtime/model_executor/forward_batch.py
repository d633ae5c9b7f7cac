"""ForwardBatch: the tensors of one model step (tokens, positions, KV slots, attention mask)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def batch_size(self) -> int:
        return int(self.kv_indices.shape[0])

    @property
    def decode_seqs(self) -> int:
        """The sequences of a step that runs on decode's weights (decode or verify); 0 else."""
        return self.batch_size if self.is_decode or self.verify else 0

    @classmethod
    def decode(
        cls,
        input_ids: list[int],
        cached_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_rows: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
    ) -> ForwardBatch:
        """A decode step: one new token after the `cached_lens[b]` tokens of each sequence."""
        batch_size = len(input_ids)
        seq_lens = [n + 1 for n in cached_lens]
        kv_indices = _kv_indices(req_rows, max(seq_lens), req_to_token, device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        key_pos = torch.arange(kv_indices.shape[1], device=device)
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=seq_lens_t - 1,
            out_cache_loc=out_cache_loc,
            kv_indices=kv_indices,
            attn_mask=(key_pos[None, :] < seq_lens_t[:, None])[:, None, None, :],
            last_token_index=torch.arange(batch_size, device=device),
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
    ) -> ForwardBatch:
        """A prefill (extend) step: `extend_lens[b]` new tokens after `prefix_lens[b]` cached
        ones. One new token per sequence is still an extend, not a decode: the two may run on
        different weights (see `models.llama.run_linear`), unless `verify` (speculative drafts:
        each token computed as decoding it would)."""
        batch_size = len(extend_lens)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        max_len = max(seq_lens)
        kv_indices = _kv_indices(req_rows, max_len, req_to_token, device)
        key_pos = torch.arange(max_len, device=device)
        extend_t = torch.tensor(extend_lens, dtype=torch.int64, device=device)
        prefix_t = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
        query_batch_index = torch.repeat_interleave(
            torch.arange(batch_size, device=device), extend_t
        )
        starts = torch.cumsum(extend_t, 0) - extend_t
        query_pos_index = torch.arange(len(input_ids), device=device) - starts[query_batch_index]
        positions = prefix_t[query_batch_index] + query_pos_index
        max_extend = max(extend_lens)
        q_pos = prefix_t[:, None] + torch.arange(max_extend, device=device)[None, :]  # [B, Q]
        attn_mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L], causal incl. prefix
        attn_mask[:, :, 0] = True  # padded query rows must attend somewhere (results are dropped)
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions,
            out_cache_loc=out_cache_loc,
            kv_indices=kv_indices,
            attn_mask=attn_mask[:, None],
            last_token_index=torch.cumsum(extend_t, 0) - 1,
            is_decode=False,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_batch_index=query_batch_index,
            query_pos_index=query_pos_index,
            query_lens=positions + 1,
            verify=verify,
        )


def _kv_indices(
    req_rows: list[int], max_len: int, req_to_token: torch.Tensor, device: torch.device
) -> torch.Tensor:
    rows = torch.tensor(req_rows, dtype=torch.int64, device=device)
    return req_to_token[rows, :max_len]
