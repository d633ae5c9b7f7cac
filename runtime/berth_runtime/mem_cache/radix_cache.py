"""RadixCache: a token trie over cached KV slots, so requests reuse each other's prompt prefixes.

Each edge holds a run of token ids and the KV slots of those tokens. A request locks the path it
matched while it runs (locked entries are never evicted); finished requests insert their tokens, and
unlocked leaves are evicted least-recently-used first when the pool needs room.

K/V depends on the weights that computed it: each LoRA adapter caches under its own namespace, a
subtree of its own below the root (namespace 0, the base model's, is the root itself).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids on the edge from the parent
        self.value = value  # KV slots of those tokens
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap order for eviction
        return self.last_access < other.last_access


class RadixCache:
    """Prefix sharing over a KV pool; `free_slots` returns evicted slots to the pool."""

    def __init__(self, free_slots: Callable[[torch.Tensor], None]) -> None:
        self.free_slots = free_slots
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode(None, [], torch.empty(0, dtype=torch.int64))
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in nodes locked by running requests

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _top(self, namespace: int) -> TreeNode:
        """Where `namespace`'s entries hang: the root for the base model, else an empty node below
        it (made on first use, keyed by a negative id no token has, never evicted)."""
        if namespace == 0:
            return self.root
        anchor = self.root.children.get(-namespace)
        if anchor is None:
            anchor = TreeNode(self.root, [], torch.empty(0, dtype=torch.int64))
            anchor.lock_ref = 1
            self.root.children[-namespace] = anchor
        return anchor

    def drop_namespace(self, namespace: int) -> None:
        """Free every entry of a namespace (an unloaded adapter's; no request holds any)."""
        anchor = self.root.children.pop(-namespace, None)
        stack = list(anchor.children.values()) if anchor is not None else []
        while stack:
            node = stack.pop()
            assert node.lock_ref == 0, "an entry of a dropped namespace is in use"
            self.free_slots(node.value)
            self.evictable_size -= len(node.key)
            stack.extend(node.children.values())

    def match_prefix(self, key: list[int], namespace: int = 0) -> tuple[torch.Tensor, TreeNode]:
        """KV slots of the longest cached prefix of `key`, and the node where it ends."""
        node = self._top(namespace)
        values: list[torch.Tensor] = []
        now = next(self._clock)
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            shared = _common_prefix_len(child.key, key, pos)
            child.last_access = now
            if shared < len(child.key):
                child = self._split(child, shared)
                values.append(child.value)
                node = child
                break
            values.append(child.value)
            pos += shared
            node = child
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return slots, node

    def insert(self, key: list[int], value: torch.Tensor, namespace: int = 0) -> int:
        """Cache `key` with its KV slots; return how many leading tokens were cached already
        (the caller still owns, and must free, its own slots for those)."""
        node = self._top(namespace)
        now = next(self._clock)
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                new = TreeNode(node, key[pos:], value[pos:].clone())
                new.last_access = now
                node.children[key[pos]] = new
                self.evictable_size += len(new.key)
                return pos
            shared = _common_prefix_len(child.key, key, pos)
            child.last_access = now
            if shared < len(child.key):
                child = self._split(child, shared)
            pos += shared
            node = child
        return pos

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens; return the new upper node."""
        upper = TreeNode(child.parent, child.key[:at], child.value[:at])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        assert child.parent is not None
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
        upper.children[child.key[0]] = child
        return upper

    def lock(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (a request is using it)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, oldest first; return how many."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i
