"""The scheduler's handle on memory: request rows, KV slots and the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.mem_cache.base import free_own
from engine.scheduler.req import Req


@dataclass
class MemoryPools:
    req_to_token_pool: Any  # engine.mem_cache.memory_pool.ReqToTokenPool
    allocator: Any  # engine.mem_cache.allocator.TokenToKVPoolAllocator
    tree_cache: Any  # RadixCache, SWARadixCache or NoRadixCache
    page_size: int
    # hybrid sliding-window memory (engine/mem_cache/swa_allocator.py): the longest window;
    # None without it
    sliding_window: int | None = None

    def alloc_kv(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_locs: list[int] | torch.Tensor | None,
    ) -> torch.Tensor:
        """KV slots for positions prefix_len..seq_len-1 of each request, evicting unlocked
        cache entries if the free pages do not suffice (`TokenToKVPoolAllocator.alloc_extend`;
        `last_locs` may be a device tensor)."""
        return self._alloc_evicting(
            lambda: self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs),
            prefix_lens, seq_lens,
        )  # fmt: skip

    def alloc_decode(
        self, prefix_lens: list[int], last_locs: torch.Tensor | None
    ) -> torch.Tensor:
        """One KV slot per request for a decode step (`TokenToKVPoolAllocator.alloc_decode`),
        evicting unlocked cache entries if the free pages do not suffice."""
        return self._alloc_evicting(
            lambda: self.allocator.alloc_decode(prefix_lens, last_locs), prefix_lens, None
        )

    def _alloc_evicting(
        self,
        alloc: Callable[[], torch.Tensor | None],
        prefix_lens: list[int],
        seq_lens: list[int] | None,
    ) -> torch.Tensor:
        """`alloc()`, again after evicting the pages it needs (requests growing from
        prefix_lens to seq_lens; None: by one token) if it found too few."""
        out = alloc()
        if out is None:
            ends = seq_lens if seq_lens is not None else [n + 1 for n in prefix_lens]
            pages = sum(map(self.allocator.num_pages_needed, prefix_lens, ends))
            self.make_room(pages * self.page_size)
            out = alloc()
        if out is None:
            raise MemoryError(
                "KV cache exhausted although the scheduler's budget admitted the batch"
            )
        return out

    def make_room(self, tokens: int) -> bool:
        """Evict unlocked cache until `tokens` can be allocated (in both pools, with hybrid
        sliding-window memory); whether they can."""
        a = self.allocator
        if a.available_size() < tokens:
            self.tree_cache.evict(tokens - a.available_size())
        if self.sliding_window is None:
            return a.available_size() >= tokens
        if a.swa_available_size() < tokens:
            self.tree_cache.evict_swa(tokens - a.swa_available_size())
        return min(a.available_size(), a.swa_available_size()) >= tokens

    def release_swa_window(self, reqs: list[Req], positions: list[int] | None) -> None:
        """Free the sliding-window KV of each request's own tokens that no query will read
        again, then (with `positions`, the first new position of each request in the batch
        being prepared) remember where that batch starts.

        The bound comes from the batch prepared before for the request (`swa_batch_start`):
        the only one of its batches that may still be running on the device (the overlap
        scheduler runs one batch ahead), and the one reading furthest back. Its first query
        reads positions from start - W + 1 on; whole pages before that are freed. Tokens the
        tree holds are left to the tree (`SWARadixCache.evict_swa`); once they are all before
        that position, the request's window lock on them goes."""
        window = self.sliding_window
        if window is None:
            return
        rows = self.req_to_token_pool.req_to_token
        ps = self.page_size
        parts = []
        for i, r in enumerate(reqs):
            if r.swa_batch_start is not None:
                end = max(0, r.swa_batch_start - window + 1)
                if end >= len(r.prefix_indices) > 0:
                    self.tree_cache.release_prefix_window(r)
                end -= end % ps
                start = max(len(r.prefix_indices), r.swa_released)
                if end > start:
                    parts.append(rows[r.req_pool_idx, start:end])
                    r.swa_released = end
            if positions is not None:
                r.swa_batch_start = positions[i]
        if parts:  # (the request's own pages, each freed once: no read of the device)
            self.allocator.free_swa_runs(parts)

    def release_req(self, req: Req) -> None:
        """Give back everything a request holds without caching it (retraction): its private
        slots, its lock on the shared prefix and its row."""
        row = req.req_pool_idx
        shared = len(req.prefix_indices)
        slots = self.req_to_token_pool.req_to_token[row]
        free_own(self.allocator, req, slots, [(shared, req.kv_allocated_len)])  # (aligned)
        if req.last_node is not None:
            self.tree_cache.unlock_req(req)
        self.req_to_token_pool.free(row)

    def token_usage(self) -> float:
        total = self.allocator.size
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return 1.0 - free / total if total else 0.0
