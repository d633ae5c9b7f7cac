"""KVManager: where each request's K/V lives: its slots, its table row, and the prefix cache."""

from __future__ import annotations

import numpy as np
import torch

from berth_runtime.managers.schedule_batch import Req
from berth_runtime.mem_cache.kv_pool import ReqToTokenPool, TokenToKVPool
from berth_runtime.mem_cache.radix_cache import RadixCache
from berth_runtime.model_executor.host_inputs import upload


class KVManager:
    """Admits requests to KV memory (a table row and their longest cached prefix), gives them
    slots for each step, shares what they computed through the radix cache, and takes it all
    back when they leave. The scheduling policy decides who runs; this decides nothing."""

    def __init__(
        self, kv_pool: TokenToKVPool, req_to_token: ReqToTokenPool, prefix_cache: bool
    ) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.tree = RadixCache(kv_pool.free) if prefix_cache else None

    @property
    def capacity(self) -> int:
        """KV slots in all."""
        return self.kv_pool.size

    # --- admission ---------------------------------------------------------------------------

    def admit(self, req: Req) -> bool:
        """Give `req` a table row and its longest cached prefix (locked); False if no row."""
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.req_row = row
        if self.tree is None or req.return_prompt_logprobs:
            return True  # prompt logprobs need every prompt position computed
        # Leave at least one token to run: its logits give the next token.
        slots, node = self.tree.match_prefix(req.fill_ids(0, req.fill_len - 1), req.lora_namespace)
        n = len(slots)
        if n:
            self.req_to_token.req_to_token[row, :n] = slots
        self.tree.lock(node)
        req.last_node = node
        req.kv_len = req.prefix_len = req.exact_len = n
        return True

    def undo_admission(self, req: Req) -> None:
        """Admission failed after the prefix was taken: give the row and the lock back."""
        if self.tree is not None and req.last_node is not None:
            self.tree.unlock(req.last_node)
        self.req_to_token.free(req.req_row)
        req.req_row, req.last_node = None, None
        req.kv_len = req.prefix_len = req.exact_len = 0

    def cached_prefix_len(self, tokens: list[int], namespace: int = 0) -> int:
        """How many leading `tokens` the prefix cache holds (0 without one)."""
        if self.tree is None:
            return 0
        return len(self.tree.match_prefix(tokens, namespace)[0])

    # --- capacity ----------------------------------------------------------------------------

    def free_capacity(self) -> int:
        """Slots that can be had now: free ones plus unlocked cache entries."""
        return self.kv_pool.available_size() + self.evictable_size()

    def available(self) -> int:
        """Free slots, without evicting anything."""
        return self.kv_pool.available_size()

    def evictable_size(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    def cached_size(self) -> int:
        return self.tree.total_size if self.tree is not None else 0

    def ensure_free(self, need: int) -> None:
        """Evict unlocked cache entries until `need` slots are free (or nothing is left)."""
        short = need - self.kv_pool.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)

    # --- slots for a step --------------------------------------------------------------------

    def alloc_extend(self, spans: list[tuple[Req, int, int]]) -> torch.Tensor:
        """Slots for positions [start, end) of each request, written into their table rows."""
        total = sum(end - start for _, start, end in spans)
        self.ensure_free(total)
        slots = self.kv_pool.alloc(total)
        assert slots is not None, "admission checked the pool"
        table = self.req_to_token.req_to_token
        offset = 0
        for req, start, end in spans:
            table[req.req_row, start:end] = slots[offset : offset + end - start]
            offset += end - start
        return slots

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor:
        """One slot for each request's next position."""
        slots = self.kv_pool.alloc(len(reqs))
        assert slots is not None, "retraction made room"
        rows, positions = upload(
            self.kv_pool.device,
            np.array([r.req_row for r in reqs], dtype=np.int64),
            np.array([r.kv_len for r in reqs], dtype=np.int64),
        )
        self.req_to_token.req_to_token[rows, positions] = slots
        return slots

    # --- sharing and release -----------------------------------------------------------------

    def cache_prefilled(self, req: Req) -> None:
        """Share a request's prompt with later requests as soon as it is prefilled, not only
        when it finishes (SGLang's cache_unfinished_req): concurrent requests with a common
        prefix then reuse it."""
        if self.tree is None or req.req_row is None or req.kv_len == req.prefix_len:
            return
        table = self.req_to_token.req_to_token
        key = req.fill_ids(0, req.kv_len)
        slots = table[req.req_row, : req.kv_len].clone()
        cached = self.tree.insert(key, slots, req.lora_namespace)
        self.kv_pool.free(slots[req.prefix_len : cached])  # duplicates of what was cached
        tree_slots, node = self.tree.match_prefix(key, req.lora_namespace)
        table[req.req_row, : req.kv_len] = tree_slots
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        self.tree.lock(node)
        req.last_node = node
        req.prefix_len = req.kv_len

    def release(self, req: Req) -> None:
        """Give a request's table row back; its KV goes into the radix cache (or is freed).

        Only K/V that a prefill of the same tokens would compute bit for bit are cached
        (`exact_len`): a later request that reuses them then gets the answer it would get
        without the cache. K/V written by decode steps whose weights or kernels differ from
        the prefill's (the 4-bit GGUF weights of small CPU batches, or torch_native attention)
        are freed, and a conversation's next turn computes its previous answer again."""
        if req.req_row is None:
            return
        slots = self.req_to_token.req_to_token[req.req_row, : req.kv_len].clone()
        if self.tree is None:
            self.kv_pool.free(slots)
        else:
            # Tokens the cache already holds (inserted by another request meanwhile) are
            # duplicates: free our copies. The rest of the exact part now belongs to the cache.
            cached = self.tree.insert(
                req.fill_ids(0, req.exact_len), slots[: req.exact_len], req.lora_namespace
            )
            self.kv_pool.free(slots[req.prefix_len : cached])
            self.kv_pool.free(slots[req.exact_len :])
            if req.last_node is not None:
                self.tree.unlock(req.last_node)
        self.req_to_token.free(req.req_row)
        req.req_row, req.last_node = None, None
        req.kv_len = req.prefix_len = req.exact_len = 0

    def drop_namespace(self, namespace: int) -> None:
        """Free the cached K/V of an unloaded adapter."""
        if self.tree is not None:
            self.tree.drop_namespace(namespace)

    def flush(self) -> None:
        """Forget every cached prefix and slot (only when no request holds any)."""
        if self.tree is not None:
            self.tree.reset()
        self.kv_pool.clear()
        self.req_to_token.clear()
