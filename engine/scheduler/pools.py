"""The scheduler's handle on memory: request rows, KV slots and the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.scheduler.req import Req


@dataclass
class MemoryPools:
    req_to_token_pool: Any  # engine.mem_cache.memory_pool.ReqToTokenPool
    allocator: Any  # engine.mem_cache.allocator.TokenToKVPoolAllocator
    tree_cache: Any  # RadixCache or NoRadixCache
    page_size: int

    def alloc_kv(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor:
        """KV slots for positions prefix_len..seq_len-1 of each request, evicting unlocked
        cache entries if the free pages do not suffice."""
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out is None:
            pages = sum(
                self.allocator.num_pages_needed(p, s) for p, s in zip(prefix_lens, seq_lens)
            )
            self.tree_cache.evict(pages * self.page_size - self.allocator.available_size())
            out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out is None:
            raise MemoryError(
                "KV cache exhausted although the scheduler's budget admitted the batch"
            )
        return out

    def release_req(self, req: Req) -> None:
        """Give back everything a request holds without caching it (retraction): its private
        slots, its lock on the shared prefix and its row."""
        row = req.req_pool_idx
        shared = len(req.prefix_indices)
        if req.kv_allocated_len > shared:
            slots = self.req_to_token_pool.req_to_token[row, shared : req.kv_allocated_len]
            self.allocator.free(slots.to(torch.int64))
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)

    def token_usage(self) -> float:
        total = self.allocator.size
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return 1.0 - free / total if total else 0.0
