"""RadixCache: insert, match, edge splits, locking and LRU eviction, with exact slot accounting."""

from __future__ import annotations

import torch

from berth_runtime.mem_cache.radix_cache import RadixCache


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make() -> tuple[RadixCache, list[int]]:
    freed: list[int] = []
    return RadixCache(lambda t: freed.extend(t.tolist())), freed


def test_match_returns_the_longest_cached_prefix():
    tree, _ = make()
    assert tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    found, _ = tree.match_prefix([1, 2, 3, 9])
    assert found.tolist() == [10, 11, 12]
    assert tree.match_prefix([7])[0].tolist() == []
    assert tree.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [10, 11, 12, 13]


def test_insert_reports_what_was_already_cached_and_splits_edges():
    tree, _ = make()
    tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    assert tree.insert([1, 2, 8, 9], slots(20, 21, 22, 23)) == 2
    assert tree.match_prefix([1, 2, 8, 9])[0].tolist() == [10, 11, 22, 23]
    assert tree.match_prefix([1, 2, 3, 4])[0].tolist() == [10, 11, 12, 13]
    assert sorted(tree.root.children[1].children) == [3, 8]  # the [1,2,3,4] edge was split
    assert tree.total_size == 6


def test_locked_paths_are_never_evicted():
    tree, freed = make()
    tree.insert([1, 2, 3], slots(10, 11, 12))
    tree.insert([5, 6], slots(15, 16))
    _, node = tree.match_prefix([1, 2, 3])
    tree.lock(node)
    assert (tree.evictable_size, tree.protected_size) == (2, 3)
    assert tree.evict(100) == 2
    assert sorted(freed) == [15, 16]
    assert tree.match_prefix([1, 2, 3])[0].tolist() == [10, 11, 12]
    tree.unlock(node)
    assert (tree.evictable_size, tree.protected_size) == (3, 0)
    assert tree.evict(1) == 3
    assert tree.total_size == 0


def test_eviction_is_least_recently_used_first_and_climbs_to_parents():
    tree, freed = make()
    tree.insert([1, 2], slots(10, 11))
    tree.insert([1, 2, 3], slots(10, 11, 12))
    tree.insert([7, 8], slots(17, 18))
    tree.match_prefix([1, 2, 3])  # touch: [7, 8] is now the oldest
    assert tree.evict(1) == 2 and freed == [17, 18]
    assert tree.evict(1) == 1 and freed[-1] == 12  # the leaf under [1, 2]
    assert tree.evict(1) == 2 and sorted(freed[-2:]) == [10, 11]  # then its parent
    assert tree.total_size == 0


def test_lock_survives_a_split_below_it():
    tree, _ = make()
    tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.lock(node)
    tree.insert([1, 2, 9], slots(30, 31, 32))  # splits the locked edge
    assert tree.protected_size == 4 and tree.evictable_size == 1
    tree.unlock(node)
    assert tree.protected_size == 0 and tree.evictable_size == 5


def test_namespaces_never_share_entries():
    """A LoRA adapter's namespace caches apart from the base's and from other adapters'; its
    entries lock, evict and count as the base's do, and dropping it frees exactly its slots."""
    tree, freed = make()
    tree.insert([1, 2, 3], slots(10, 11, 12))
    tree.insert([1, 2, 3], slots(20, 21, 22), namespace=7)
    assert tree.match_prefix([1, 2, 3])[0].tolist() == [10, 11, 12]
    assert tree.match_prefix([1, 2, 3], namespace=7)[0].tolist() == [20, 21, 22]
    assert tree.match_prefix([1, 2, 3], namespace=8)[0].tolist() == []
    assert tree.total_size == 6
    _, node = tree.match_prefix([1, 2, 3], namespace=7)
    tree.lock(node)
    assert tree.evict(10) == 3 and sorted(freed) == [10, 11, 12]  # the locked one stays
    assert tree.match_prefix([1, 2, 3], namespace=7)[0].tolist() == [20, 21, 22]
    tree.unlock(node)
    freed.clear()
    tree.drop_namespace(7)
    assert sorted(freed) == [20, 21, 22] and tree.total_size == 0
    assert tree.match_prefix([1, 2, 3], namespace=7)[0].tolist() == []
