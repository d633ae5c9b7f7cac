"""Router policies: the approximate prefix tree, cache_aware decisions, least_load, round_robin,
and the rendezvous hash behind routing keys."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from berth_router.policies import (
    LEAST_LOAD,
    LOAD_FALLBACK_IMBALANCED,
    LOAD_FALLBACK_MISS,
    MIN_MATCH_CHARS,
    PREFIX_HIT,
    ROUND_ROBIN,
    CacheAware,
    Candidate,
    LeastLoad,
    PrefixTree,
    RoundRobin,
    common_prefix_len,
    make_policy,
    rendezvous_order,
)
from berth_router.signals import routing_text


def idle(*ranks: int) -> list[Candidate]:
    return [Candidate(r, 0.0) for r in ranks]


# --- prefix tree -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edge", "text", "start", "expected"),
    [
        ("abc", "abc", 0, 3),
        ("abc", "xxabcd", 2, 3),
        ("abcdef", "abcxyz", 0, 3),
        ("abc", "ab", 0, 2),
        ("abc", "zzz", 0, 0),
        ("a" * 1000 + "b", "a" * 1000 + "c", 0, 1000),
        ("", "abc", 0, 0),
    ],
)
def test_common_prefix_len(edge: str, text: str, start: int, expected: int) -> None:
    assert common_prefix_len(edge, text, start) == expected


def test_common_prefix_len_agrees_with_a_naive_loop() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        naive = 0
        while naive < min(len(a), len(b)) and a[naive] == b[naive]:
            naive += 1
        assert common_prefix_len(a, b, 0) == naive


def test_match_finds_the_longest_prefix_and_who_holds_it() -> None:
    tree = PrefixTree()
    tree.insert("the quick brown fox", 0)
    tree.insert("the quick red fox", 1)
    assert tree.match("the quick brown dog")[0] == len("the quick brown ")
    length, holders = tree.match("the quick brown dog")
    assert set(holders) == {0}
    length, holders = tree.match("the quick ")
    assert length == len("the quick ") and set(holders) == {0, 1}
    assert tree.match("a lazy dog") == (0, {})
    assert tree.match("") == (0, {})
    # A rank that may not take the request does not count as a match.
    length, holders = tree.match("the quick brown dog", allowed={1})
    assert length == len("the quick ") and set(holders) == {1}
    assert tree.match("the quick brown dog", allowed={2}) == (0, {})


def test_chars_count_each_rank_once_per_character_it_holds() -> None:
    tree = PrefixTree()
    tree.insert("abcdef", 0)
    tree.insert("abcxyz", 0)  # splits "abcdef": still one copy of "abc" for rank 0
    assert tree.chars(0) == len("abcdef") + len("xyz")
    tree.insert("abcdef", 1)
    assert tree.chars(1) == 6
    tree.insert("abcdef", 1)  # again: nothing new
    assert tree.chars(1) == 6
    assert tree.ranks() == {0, 1}


def test_eviction_forgets_the_least_recently_used_text_of_that_rank_only() -> None:
    tree = PrefixTree(max_chars_per_rank=100)
    old, new = "o" * 40, "n" * 40
    tree.insert(old, 0)
    tree.insert(old, 1)
    tree.insert(new, 0)
    tree.insert(old, 0)  # touch: `old` is now the most recent for rank 0
    tree.insert("x" * 40, 0)  # 120 > 100: evict down to 90
    assert tree.chars(0) <= 100
    assert tree.match(old, allowed={0})[0] == 40  # recently used: kept
    assert tree.match(new, allowed={0})[0] == 0  # least recently used: forgotten
    assert tree.match(old, allowed={1})[0] == 40  # rank 1 is untouched
    assert tree.chars(1) == 40


def test_eviction_trims_leaves_before_the_prefix_they_share() -> None:
    tree = PrefixTree(max_chars_per_rank=1000)
    shared = "s" * 50
    for i in range(10):
        tree.insert(shared + str(i) * 20, 0)
    tree.evict(0, target_chars=60)
    assert tree.chars(0) <= 60
    # The shared prefix (used by every request) outlives the leaves.
    assert tree.match(shared + "9", allowed={0})[0] == 50


def test_remove_rank_forgets_only_that_rank_and_prunes_empty_nodes() -> None:
    tree = PrefixTree()
    tree.insert("hello world", 0)
    tree.insert("hello there", 1)
    tree.remove_rank(0)
    assert tree.chars(0) == 0
    length, holders = tree.match("hello world")
    assert length == len("hello ") and set(holders) == {1}
    tree.remove_rank(1)
    assert tree.root.children == {}


def test_tree_invariant_a_child_is_held_only_by_ranks_holding_its_parent() -> None:
    rng = random.Random(3)
    tree = PrefixTree(max_chars_per_rank=300)
    words = ["alpha ", "beta ", "gamma ", "delta "]
    for _ in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        tree.insert(text, rng.randrange(3))
        if rng.random() < 0.02:
            tree.remove_rank(rng.randrange(3))
    stack = [tree.root]
    totals: Counter[int] = Counter()
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.text and child.text[0] == key
            assert child.tenants, "empty nodes are pruned"
            if node is not tree.root:
                assert set(child.tenants) <= set(node.tenants)
            for rank in child.tenants:
                totals[rank] += len(child.text)
            stack.append(child)
    for rank in range(3):
        assert tree.chars(rank) == totals[rank] <= 300


# --- cache_aware -------------------------------------------------------------------------------

SYSTEM = "You are a meticulous assistant for a shipping company. " * 20


def test_cache_aware_sends_a_shared_long_prefix_to_the_same_rank() -> None:
    policy = CacheAware(cache_threshold=0.5)
    first = policy.select(SYSTEM + "Question 0?", idle(0, 1, 2))
    assert first.decision == LOAD_FALLBACK_MISS
    for i in range(1, 6):
        d = policy.select(SYSTEM + f"Question {i}?", idle(0, 1, 2))
        assert (d.rank, d.decision) == (first.rank, PREFIX_HIT)
        assert d.match_rate > 0.9


def test_cache_aware_spreads_unrelated_prompts_over_idle_ranks() -> None:
    policy = CacheAware()
    ranks = [
        policy.select(f"{i}: an unrelated prompt about {i * 37}", idle(0, 1, 2)).rank
        for i in range(6)
    ]
    assert sorted(Counter(ranks).values()) == [2, 2, 2]


def test_short_distinct_chat_prompts_spread_instead_of_piling_on_one_rank() -> None:
    # Every chat shares its template's role markers, and short prompts share a letter or two;
    # neither is a prefix worth following, so idle ranks take turns.
    policy = CacheAware()
    prompts = ["Hi", "Hello", "Hey there", "How are you?", "Help", "Hm", "Hola", "Howdy", "Hiya"]
    decisions = [
        policy.select(
            routing_text("/v1/chat/completions", {"messages": [{"role": "user", "content": p}]}),
            idle(0, 1, 2),
        )
        for p in prompts
    ]
    assert {d.decision for d in decisions} == {LOAD_FALLBACK_MISS}
    assert sorted(Counter(d.rank for d in decisions).values()) == [3, 3, 3]


def test_a_prefix_match_under_min_match_chars_never_decides() -> None:
    policy = CacheAware(cache_threshold=0.3)
    policy.select("x" * (MIN_MATCH_CHARS - 1) + "-first", idle(0, 1))
    short = policy.select("x" * (MIN_MATCH_CHARS - 1) + "+", idle(0, 1))
    assert short.decision == LOAD_FALLBACK_MISS and short.match_rate > 0.9
    policy.select("y" * MIN_MATCH_CHARS + "-first", idle(0, 1))
    long = policy.select("y" * MIN_MATCH_CHARS + "+", idle(0, 1))
    assert long.decision == PREFIX_HIT


def test_cache_aware_below_threshold_takes_the_least_loaded_rank() -> None:
    policy = CacheAware(cache_threshold=0.5)
    policy.select("shared-" + "x" * 10, idle(0, 1))  # remembered under some rank
    holder = policy.tree.match("shared-")[1]
    (rank,) = holder
    other = 1 - rank
    # "shared-" covers 7 of 40 characters: not enough, so load decides.
    d = policy.select("shared-" + "y" * 33, [Candidate(rank, 3.0), Candidate(other, 1.0)])
    assert (d.rank, d.decision) == (other, LOAD_FALLBACK_MISS)
    assert d.match_rate == pytest.approx(7 / 40)


def test_cache_aware_falls_back_to_least_load_when_loads_are_imbalanced() -> None:
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = policy.select(SYSTEM + "a", idle(0, 1)).rank
    other = 1 - first
    # The holder has 10 more requests than the other (> 4 and > 1.5x): imbalanced.
    busy = [Candidate(first, 12.0), Candidate(other, 2.0)]
    d = policy.select(SYSTEM + "b", busy)
    assert (d.rank, d.decision) == (other, LOAD_FALLBACK_IMBALANCED)
    # Both ranks now hold the prefix; within the thresholds, the prefix wins again and the less
    # loaded of its holders takes it.
    d = policy.select(SYSTEM + "c", [Candidate(first, 3.0), Candidate(other, 1.0)])
    assert (d.rank, d.decision) == (other, PREFIX_HIT)
    # Imbalance needs both conditions: a big absolute gap but a small ratio is not imbalance.
    assert not policy.imbalanced([Candidate(0, 100.0), Candidate(1, 90.0)])
    assert policy.imbalanced([Candidate(0, 10.0), Candidate(1, 0.0)])
    assert not policy.imbalanced([Candidate(0, 10.0)])


def test_cache_aware_only_follows_a_match_to_an_allowed_rank() -> None:
    policy = CacheAware()
    holder = policy.select(SYSTEM + "1", idle(0, 1, 2)).rank
    others = [r for r in (0, 1, 2) if r != holder]
    d = policy.select(SYSTEM + "2", idle(*others))  # the holder is down (or already tried)
    assert d.rank in others and d.decision == LOAD_FALLBACK_MISS


def test_forget_rank_and_reset_clear_what_cache_aware_remembers() -> None:
    policy = CacheAware()
    holder = policy.select(SYSTEM + "1", idle(0, 1)).rank
    policy.forget_rank(holder)
    assert policy.select(SYSTEM + "2", idle(0, 1)).decision == LOAD_FALLBACK_MISS
    policy.reset()
    assert policy.tree.ranks() == set()


# --- least_load, round_robin ------------------------------------------------------------------


def test_least_load_picks_the_least_loaded_and_rotates_ties() -> None:
    policy = LeastLoad()
    d = policy.select("x", [Candidate(0, 5.0), Candidate(1, 2.0), Candidate(2, 9.0)])
    assert (d.rank, d.decision) == (1, LEAST_LOAD)
    picks = [policy.select("x", idle(0, 1, 2)).rank for _ in range(6)]
    assert Counter(picks) == {0: 2, 1: 2, 2: 2}


def test_round_robin_cycles_in_rank_order_over_whatever_is_healthy() -> None:
    policy = RoundRobin()
    assert [policy.select("", idle(2, 0, 1)).rank for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    picks = [policy.select("", idle(0, 2)) for _ in range(4)]
    assert {p.rank for p in picks} == {0, 2} and {p.decision for p in picks} == {ROUND_ROBIN}


def test_make_policy_knows_the_three_names() -> None:
    assert isinstance(make_policy("cache_aware"), CacheAware)
    assert isinstance(make_policy("least_load"), LeastLoad)
    assert isinstance(make_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


# --- routing keys ------------------------------------------------------------------------------


def test_routing_key_order_is_deterministic_and_a_permutation() -> None:
    for key in ("user-1", "tenant/a", ""):
        order = rendezvous_order(key, [0, 1, 2, 3])
        assert sorted(order) == [0, 1, 2, 3]
        assert order == rendezvous_order(key, [3, 2, 1, 0])  # input order does not matter


def test_routing_keys_spread_and_only_the_removed_ranks_keys_move() -> None:
    keys = [f"session-{i}" for i in range(600)]
    before = {k: rendezvous_order(k, range(4))[0] for k in keys}
    assert all(count > 100 for count in Counter(before.values()).values())  # spread
    after = {k: rendezvous_order(k, [0, 1, 3])[0] for k in keys}  # rank 2 left
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)
    # A key whose rank is gone goes to its second choice, which is what the router uses when
    # the first choice is out of rotation.
    for k in moved:
        assert after[k] == rendezvous_order(k, range(4))[1]
