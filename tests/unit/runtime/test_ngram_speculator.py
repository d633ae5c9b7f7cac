"""Prompt-lookup drafts: the tokens after the latest earlier occurrence of the longest tail."""

from __future__ import annotations

import random

from berth_runtime.managers.ngram_speculator import NgramIndex


def naive(tokens: list[int], limit: int, lo: int = 2, hi: int = 4) -> list[int]:
    """The same rule by brute force: longest n first, latest earlier occurrence."""
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + limit]
    return []


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_tail():
    index = NgramIndex(2, 4)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    # Tail (6, 7): latest earlier occurrence ends at 8 -> [1, 2, 6]; (5, 6, 7) is not the tail.
    assert index.propose(tokens[:5], tokens[5:], 3) == [1, 2, 6]
    # Now the tail (5, 6, 7) occurred before (ending at 3 and at 8): the latest one wins.
    assert index.propose(tokens[:5], [*tokens[5:], 5, 6, 7], 2) == [1, 2]


def test_no_draft_without_a_repeated_tail_and_the_limit_holds():
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4], [], 4) == []
    assert index.propose([1, 2, 3, 4], [1, 2], 1) == [3]
    assert NgramIndex(2, 4).propose([1, 2], [], 4) == []
    assert NgramIndex(2, 4).propose([1, 2], [1, 2], 0) == []


def test_growing_one_token_at_a_time_equals_brute_force():
    rng = random.Random(0)
    prompt = [rng.randrange(6) for _ in range(20)]  # a small alphabet: many repeats
    output: list[int] = []
    index = NgramIndex(2, 4)
    for _ in range(400):
        output.append(rng.randrange(6))
        assert index.propose(prompt, output, 3) == naive(prompt + output, 3)
