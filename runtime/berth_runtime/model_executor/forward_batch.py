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
    attn_mask: torch.Tensor  # [B, 1, Q, L] bool, True = may attend (Q = 1 for decode)
    last_token_index: torch.Tensor  # [B] row in T of each sequence's last new token
    is_decode: bool
    seq_lens: torch.Tensor  # [B] tokens of each sequence in the KV cache after this step
    # Extend only: where each of the T rows sits in the padded [B, Q] query layout.
    query_batch_index: torch.Tensor | None = None
    query_pos_index: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.kv_indices.shape[0])

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_rows: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
    ) -> ForwardBatch:
        """Assemble a step from the scheduler's per-sequence numbers (one Python pass over B)."""
        batch_size = len(extend_lens)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        max_len = max(seq_lens)
        rows = torch.tensor(req_rows, dtype=torch.int64, device=device)
        kv_indices = req_to_token[rows, :max_len]
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        key_pos = torch.arange(max_len, device=device)
        input_ids_t = torch.tensor(input_ids, dtype=torch.int64, device=device)
        is_decode = all(e == 1 for e in extend_lens)
        if is_decode:
            positions = seq_lens_t - 1
            attn_mask = (key_pos[None, :] < seq_lens_t[:, None])[:, None, None, :]
            last = torch.arange(batch_size, device=device)
            return cls(
                input_ids_t, positions, out_cache_loc, kv_indices, attn_mask, last, True, seq_lens_t
            )

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
        last = torch.cumsum(extend_t, 0) - 1
        return cls(
            input_ids_t,
            positions,
            out_cache_loc,
            kv_indices,
            attn_mask[:, None],
            last,
            False,
            seq_lens_t,
            query_batch_index,
            query_pos_index,
        )
