"""How tensor parallelism splits a model: even shares, heads that follow their KV heads (also
unevenly, and replicated KV heads when there are more processes than KV heads), and a clear
refusal where no split exists."""

from __future__ import annotations

import pytest

from berth_runtime.model_executor.tensor_parallel import TPGroup


def parts(total: int, size: int) -> list[range]:
    return [TPGroup(rank, size).part(total) for rank in range(size)]


def test_shares_cover_everything_once_and_differ_by_at_most_one() -> None:
    for total, size in [(49152, 2), (1536, 2), (10, 3), (7, 4)]:
        shares = parts(total, size)
        assert [i for share in shares for i in share] == list(range(total))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "expected"),
    [
        (9, 3, 2, [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]),  # SmolLM2-135M
        (32, 8, 4, [(range(8 * r, 8 * r + 8), range(2 * r, 2 * r + 2)) for r in range(4)]),
        # More processes than KV heads: each KV head twice, its four queries split in two.
        (8, 2, 4, [(range(2 * r, 2 * r + 2), range(r // 2, r // 2 + 1)) for r in range(4)]),
    ],
)
def test_query_heads_follow_their_kv_heads(heads, kv_heads, size, expected) -> None:
    split = [TPGroup(rank, size).heads(heads, kv_heads) for rank in range(size)]
    assert split == expected
    assert sorted(i for q, _ in split for i in q) == list(range(heads))  # every query once
    group = heads // kv_heads
    for q, kv in split:  # each process's queries read only the KV heads it holds
        assert {i // group for i in q} <= set(kv)


def test_a_size_that_cannot_split_the_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 9 attention heads with 3 KV heads"):
        TPGroup(0, 4).heads(9, 3)
