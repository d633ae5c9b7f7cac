"""The KV pool's slot accounting: exact counts, all-or-nothing allocation, lowest slots first."""

from __future__ import annotations

import torch

from berth_runtime.mem_cache.kv_pool import TokenToKVPool


def pool(size: int = 16) -> TokenToKVPool:
    return TokenToKVPool(size, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                         device=torch.device("cpu"))  # fmt: skip


def test_counts_and_all_or_nothing():
    p = pool(16)
    assert p.available_size() == 16
    a = p.alloc(10)
    assert a.tolist() == list(range(1, 11))  # slot 0 is padding, never handed out
    assert p.available_size() == 6
    assert p.alloc(7) is None and p.available_size() == 6  # nothing taken
    p.free(a[:4])
    assert p.available_size() == 10
    p.clear()
    assert p.available_size() == 16


def test_lowest_free_slots_first_after_churn():
    p = pool(16)
    first = p.alloc(12)
    p.free(first[torch.tensor([9, 2, 6, 4])])  # slots 10, 3, 7, 5 come back out of order
    assert p.alloc(3).tolist() == [3, 5, 7]
    assert p.alloc(3).tolist() == [10, 13, 14]


def test_double_free_does_not_create_slots():
    p = pool(8)
    taken = p.alloc(4)
    p.free(taken)
    p.free(taken)
    assert p.available_size() == 8
    assert sorted(p.alloc(8).tolist()) == list(range(1, 9))  # every slot exactly once


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert pool().bytes_per_token == 2 * 2 * 1 * 4 * 4  # K+V x layers x heads x dim x fp32
