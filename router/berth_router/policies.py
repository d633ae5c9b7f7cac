"""Routing policies: pick one rank among the healthy candidates for a request's text.

Pure logic, no I/O and no clock: `cache_aware` (an approximate prefix tree of recent request texts,
each node tagged with the ranks that served text through it, as in SGLang's router), `least_load`
and `round_robin`, plus the rendezvous hash that maps a routing key to a rank.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Decisions, as counted in `berth:router_policy_decisions_total{decision}`.
PREFIX_HIT = "prefix_hit"
LOAD_FALLBACK_MISS = "load_fallback_miss"  # cache_aware: no prefix covers enough of the prompt
LOAD_FALLBACK_IMBALANCED = "load_fallback_imbalanced"  # cache_aware: loads are too uneven
LEAST_LOAD = "least_load"
ROUND_ROBIN = "round_robin"

# Eviction forgets down to this fraction of the budget, so that a rank at its budget does not
# walk its whole subtree on every insert.
EVICT_TO_FRACTION = 0.9


@dataclass(frozen=True)
class Candidate:
    """A rank that may take the request, and its load (requests in flight or queued there)."""

    rank: int
    load: float = 0.0


@dataclass(frozen=True)
class Decision:
    rank: int
    decision: str
    match_rate: float = 0.0


# --- the prefix tree ---------------------------------------------------------------------------


class _Node:
    __slots__ = ("text", "children", "parent", "tenants")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.parent = parent
        # rank -> tick of its last access. Invariant: a child's ranks are a subset of its parent's.
        self.tenants: dict[int, int] = {}


def common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the longest common prefix of `edge` and `text[start:]` (C-speed comparisons)."""
    if text.startswith(edge, start):
        return len(edge)
    lo, hi = 0, min(len(edge), len(text) - start)
    while lo < hi:  # the largest m with edge[:m] == text[start:start + m]
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """A radix tree over characters shared by all ranks; each node says which ranks hold it.

    Approximate by design: it records what the router sent where, not what each rank's KV cache
    still holds, and it forgets per rank (least recently used first) beyond `max_chars_per_rank`.
    """

    def __init__(self, max_chars_per_rank: int = 4_000_000) -> None:
        self.max_chars_per_rank = max_chars_per_rank
        self.root = _Node("", None)
        self._chars: dict[int, int] = {}
        self._tick = itertools.count(1)

    def chars(self, rank: int) -> int:
        """Characters of text the tree remembers for `rank`."""
        return self._chars.get(rank, 0)

    def ranks(self) -> set[int]:
        return {rank for rank, n in self._chars.items() if n > 0}

    def insert(self, text: str, rank: int) -> None:
        """Remember that `rank` has served `text` (and so every prefix of it)."""
        if not text:
            return
        tick = next(self._tick)
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                new = _Node(text[i:], node)
                new.tenants[rank] = tick
                node.children[text[i]] = new
                self._chars[rank] = self._chars.get(rank, 0) + len(new.text)
                break
            k = common_prefix_len(child.text, text, i)
            if k < len(child.text):
                child = self._split(child, k)
            if rank not in child.tenants:
                self._chars[rank] = self._chars.get(rank, 0) + len(child.text)
            child.tenants[rank] = tick
            node, i = child, i + k
        if self._chars.get(rank, 0) > self.max_chars_per_rank:
            self.evict(rank, int(self.max_chars_per_rank * EVICT_TO_FRACTION))

    def match(self, text: str, allowed: Iterable[int] | None = None) -> tuple[int, dict[int, int]]:
        """The longest prefix of `text` some allowed rank holds: (its length, {rank: last use})."""
        allow = None if allowed is None else set(allowed)
        node, i = self.root, 0
        best_len, best = 0, {}
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            live = {r: t for r, t in child.tenants.items() if allow is None or r in allow}
            if not live:
                break
            k = common_prefix_len(child.text, text, i)
            best_len, best = i + k, live
            if k < len(child.text):
                break
            node, i = child, i + k
        return best_len, best

    def evict(self, rank: int, target_chars: int) -> None:
        """Forget `rank`'s least recently used leaves until it holds at most `target_chars`."""
        heap = [
            (node.tenants[rank], id(node), node)
            for node in self._nodes_of(rank)
            if not any(rank in c.tenants for c in node.children.values())
        ]
        heapq.heapify(heap)
        while heap and self._chars.get(rank, 0) > target_chars:
            _, _, node = heapq.heappop(heap)
            del node.tenants[rank]
            self._chars[rank] -= len(node.text)
            parent = node.parent
            assert parent is not None
            if not node.tenants:
                del parent.children[node.text[0]]
            if (
                parent is not self.root
                and rank in parent.tenants
                and not any(rank in c.tenants for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.tenants[rank], id(parent), parent))

    def remove_rank(self, rank: int) -> None:
        """Forget everything `rank` served (it left, or restarted with an empty cache)."""
        for node in self._nodes_of(rank):
            del node.tenants[rank]
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                if child.tenants:
                    stack.append(child)
                else:
                    del node.children[key]
        self._chars.pop(rank, None)

    def clear(self) -> None:
        self.root = _Node("", None)
        self._chars.clear()

    def _nodes_of(self, rank: int) -> list[_Node]:
        found, stack = [], [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if rank in child.tenants:
                    found.append(child)
                    stack.append(child)
        return found

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node`'s edge after k characters; return the new upper node."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.text[:k], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.text[0]] = upper
        node.text = node.text[k:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper


# --- policies ----------------------------------------------------------------------------------


class Policy(ABC):
    name: str

    @abstractmethod
    def select(self, text: str, candidates: Sequence[Candidate]) -> Decision:
        """Pick one of `candidates` (non-empty) for a request whose routing text is `text`."""

    def forget_rank(self, rank: int) -> None:
        """`rank` left or restarted: whatever the policy remembers about it is void."""
        return None

    def reset(self) -> None:
        """Every rank's cache was flushed."""
        return None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, text: str, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.rank)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(chosen.rank, ROUND_ROBIN)


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, text: str, candidates: Sequence[Candidate]) -> Decision:
        low = min(c.load for c in candidates)
        tied = sorted(c.rank for c in candidates if c.load == low)
        # Equal loads take turns, so that an idle set of ranks is still spread over.
        rank = tied[self._turn % len(tied)]
        self._turn += 1
        return Decision(rank, LEAST_LOAD)


# The shortest prefix match that routes a request to its holder: about a dozen tokens.
MIN_MATCH_CHARS = 48


class CacheAware(Policy):
    """SGLang's cache-aware policy (sgl-model-gateway `cache_aware.rs`) over a shared tree.

    Imbalanced loads (max - min > abs threshold and max > min * rel threshold) go to the
    least-loaded rank. Otherwise the rank holding the longest matching prefix wins when the
    match covers more than `cache_threshold` of the text and at least MIN_MATCH_CHARS characters
    (a few shared characters save no work worth a worse placement: short distinct prompts
    spread by load); else the least-loaded rank (equal loads
    take turns, so unrelated prompts spread). Either way the text is then remembered under the
    chosen rank.
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_chars: int = 4_000_000,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_chars)
        self._turn = 0

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        if len(candidates) < 2:
            return False
        high = max(c.load for c in candidates)
        low = min(c.load for c in candidates)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def select(self, text: str, candidates: Sequence[Candidate]) -> Decision:
        loads = {c.rank: c.load for c in candidates}
        if self.imbalanced(candidates):
            rank = self._least_loaded(candidates)
            decision = Decision(rank, LOAD_FALLBACK_IMBALANCED)
        else:
            matched, holders = self.tree.match(text, loads)
            rate = matched / len(text) if text else 0.0
            if holders and rate > self.cache_threshold and matched >= MIN_MATCH_CHARS:
                # Several ranks hold it: the least loaded, then the most recently used.
                rank = min(holders, key=lambda r: (loads[r], -holders[r], r))
                decision = Decision(rank, PREFIX_HIT, rate)
            else:
                decision = Decision(self._least_loaded(candidates), LOAD_FALLBACK_MISS, rate)
        self.tree.insert(text, decision.rank)
        return decision

    def _least_loaded(self, candidates: Sequence[Candidate]) -> int:
        low = min(c.load for c in candidates)
        tied = sorted(c.rank for c in candidates if c.load == low)
        # Equal loads take turns, so that unrelated prompts spread over idle ranks.
        rank = tied[self._turn % len(tied)]
        self._turn += 1
        return rank

    def forget_rank(self, rank: int) -> None:
        self.tree.remove_rank(rank)

    def reset(self) -> None:
        self.tree.clear()


def make_policy(
    name: str,
    *,
    cache_threshold: float = 0.3,
    balance_abs_threshold: float = 32,
    balance_rel_threshold: float = 1.5,
    max_tree_chars: int = 4_000_000,
) -> Policy:
    if name == "cache_aware":
        return CacheAware(
            cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_chars
        )
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown policy {name!r}")


# --- routing keys ------------------------------------------------------------------------------


def rendezvous_order(key: str, ranks: Iterable[int]) -> list[int]:
    """Ranks in the order a routing key prefers them (highest random weight first).

    The first rank is a function of the key and the set of ranks only, and adding or removing a
    rank moves only the keys that preferred that rank.
    """

    def weight(rank: int) -> int:
        digest = hashlib.blake2b(f"{rank}\x00{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(ranks, key=lambda r: (weight(r), -r), reverse=True)
