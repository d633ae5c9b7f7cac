"""Benchmark workloads: exact token counts, seeded reproducibility, prefixes really shared."""

from __future__ import annotations

import pytest

from berth_runtime.bench.workload import (
    build_workload,
    chat_ids,
    completion_ids,
    parse_len_range,
    word_pool,
)
from tests.helpers import embedded_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


def test_parse_len_range():
    assert parse_len_range("48") == (48, 48)
    assert parse_len_range(7) == (7, 7)
    assert parse_len_range("32:64") == (32, 64)
    for bad in ("0", "64:32", "a", "1:b", "-3"):
        with pytest.raises(ValueError):
            parse_len_range(bad)


def test_word_pool_tokens_round_trip(tokenizer):
    pool = word_pool(tokenizer)
    assert len(pool) > 10_000
    assert list(pool) == sorted(pool)
    for token_id in pool[:: len(pool) // 50]:
        text = tokenizer.decode([token_id])
        assert text.startswith(" ") and text[1:].isalpha()
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_random_fixed_lengths_are_exact(tokenizer, api):
    requests = build_workload(
        "random", tokenizer, 12, api=api, input_len=(100, 100), output_len=(7, 7), seed=3
    )
    assert len(requests) == 12
    for r in requests:
        assert r.prompt_len == 100 and r.output_len == 7
        if api == "completions":
            assert r.messages is None
            assert completion_ids(tokenizer, r.prompt) == r.prompt_ids
        else:
            assert r.messages == [{"role": "user", "content": r.prompt}]
            # What the server prefills: the rendered template, exactly 100 tokens.
            assert chat_ids(tokenizer, r.messages) == r.prompt_ids
    assert len({tuple(r.prompt_ids) for r in requests}) == 12


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_random_ranges_are_exact_and_uniform(tokenizer, api):
    requests = build_workload(
        "random", tokenizer, 60, api=api, input_len=(40, 90), output_len=(1, 20), seed=1
    )
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    assert min(ins) >= 40 and max(ins) <= 90 and len(set(ins)) > 10
    assert min(outs) >= 1 and max(outs) <= 20 and len(set(outs)) > 5
    for r in requests:
        ids = (
            completion_ids(tokenizer, r.prompt)
            if api == "completions"
            else chat_ids(tokenizer, r.messages)
        )
        assert ids == r.prompt_ids


def test_chat_workload_is_48_token_chat_prompts(tokenizer):
    requests = build_workload("chat", tokenizer, 8, seed=0)
    assert {r.prompt_len for r in requests} == {48}
    assert {r.output_len for r in requests} == {128}
    assert all(chat_ids(tokenizer, r.messages) == r.prompt_ids for r in requests)


def test_chat_prompt_shorter_than_template_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="exactly 5 tokens"):
        build_workload("random", tokenizer, 1, api="chat", input_len=(5, 5))


def test_seed_reproduces_and_varies(tokenizer):
    def ids(seed: int) -> list[tuple[int, ...]]:
        requests = build_workload(
            "random",
            tokenizer,
            5,
            api="completions",
            input_len=(20, 60),
            output_len=(4, 9),
            seed=seed,
        )
        return [(*r.prompt_ids, -r.output_len) for r in requests]

    assert ids(11) == ids(11)
    assert ids(11) != ids(12)
    a = build_workload("shared-prefix", tokenizer, 4, num_groups=2, prefix_len=50, seed=5)
    b = build_workload("shared-prefix", tokenizer, 4, num_groups=2, prefix_len=50, seed=5)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_shared_prefix_really_shared(tokenizer, api):
    prefix_len, question_len = 300, 20
    requests = build_workload(
        "shared-prefix",
        tokenizer,
        6,
        api=api,
        num_groups=2,
        prefix_len=prefix_len,
        question_len=question_len,
        output_len=(3, 3),
        seed=0,
    )
    assert [r.group for r in requests] == [0, 0, 0, 1, 1, 1]
    by_group = {g: [r for r in requests if r.group == g] for g in (0, 1)}

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    head = len(chat_ids(tokenizer, [{"role": "system", "content": ""}])) if api == "chat" else 0
    for group in by_group.values():
        first = group[0].prompt_ids
        for other in group[1:]:
            # The whole prefix (plus, for chat, the template around it) is token-identical ...
            assert common(first, other.prompt_ids) >= prefix_len
            assert first != other.prompt_ids  # ... and the questions differ.
        if api == "completions":
            for r in group:
                assert r.prompt_len == prefix_len + question_len
                assert completion_ids(tokenizer, r.prompt) == r.prompt_ids
        else:
            for r in group:
                assert r.messages[0]["role"] == "system"
                assert r.prompt_len >= prefix_len + question_len
                assert chat_ids(tokenizer, r.messages) == r.prompt_ids
    # Different groups have different prefixes.
    shared_across = common(by_group[0][0].prompt_ids, by_group[1][0].prompt_ids)
    assert shared_across < head + 5


def test_shared_prefix_needs_whole_groups(tokenizer):
    with pytest.raises(ValueError):
        build_workload("shared-prefix", tokenizer, 5, num_groups=2)
    with pytest.raises(ValueError):
        build_workload("nope", tokenizer, 1)
