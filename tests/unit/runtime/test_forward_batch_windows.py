"""What a sliding-window layer reads of a step: a decode's last positions, an extend's band."""

from __future__ import annotations

import torch

from berth_runtime.model_executor.forward_batch import ForwardBatch

# Request rows 1 and 2 of a slot table: sequence r's position p sits in slot 100 * r + p.
CPU = torch.device("cpu")
TABLE = torch.arange(3)[:, None] * 100 + torch.arange(16)[None, :]


def test_a_decode_step_reads_each_sequences_last_window_of_slots() -> None:
    # Sequences of 10 and 3 tokens after this step; a window of 4.
    batch = ForwardBatch.decode([7, 8], [9, 2], torch.tensor([109, 202]), [1, 2], TABLE, CPU)
    slots, lens = batch.window(4)
    assert lens.tolist() == [4, 3]
    assert slots[0].tolist() == [106, 107, 108, 109]
    assert slots[1, :3].tolist() == [200, 201, 202]  # shorter than the window: all of it
    assert batch.window(4)[0] is slots  # made once per step


def test_an_extend_masks_a_band_over_the_cached_prefix() -> None:
    # Row 1: 3 new tokens after 5 cached (positions 5..7); row 2: 2 new, nothing cached.
    batch = ForwardBatch.extend(
        [1, 2, 3, 4, 5], [5, 0], [3, 2], torch.arange(5), [1, 2], TABLE, CPU
    )
    mask = batch.band_mask(3)  # [B, 1, Q, L]
    assert mask.shape == (2, 1, 3, 8)
    allowed = [[k for k in range(8) if mask[0, 0, q, k]] for q in range(3)]
    assert allowed == [[3, 4, 5], [4, 5, 6], [5, 6, 7]]  # itself and the 2 before it
    assert [k for k in range(8) if mask[1, 0, 1, k]] == [0, 1]
    assert [k for k in range(8) if mask[1, 0, 2, k]] == [0]  # a padded row: anywhere, dropped
