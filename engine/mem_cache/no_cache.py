"""`NoRadixCache`: the prefix cache turned off (`--disable-radix-cache`).

Same interface as `RadixCache`, so the scheduler does not branch on it. Nothing is ever shared:
every match is empty, `prefix_indices` stays empty, and each request owns all the slots of its
row until `cache_finished_req` frees them.
"""

from __future__ import annotations

import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.base import CacheReq, PrefixCache, TreeNode, free_own
from engine.mem_cache.memory_pool import ReqToTokenPool


class NoRadixCache(PrefixCache):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int
    ) -> None:
        if allocator.page_size != page_size:
            raise ValueError(f"NoRadixCache: page_size {page_size} != {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self._empty = torch.empty(
            0, dtype=torch.int64, device=req_to_token_pool.req_to_token.device
        )
        self.root_node = TreeNode(value=self._empty)  # every match ends here; never has children

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        return self._empty, self.root_node

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Takes nothing: reports every token as already held, so the caller, which frees its
        own slots for those, keeps ownership of all of them."""
        return len(key)

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Nothing to share: the request keeps every slot of its row."""
        req.prefix_indices = self._empty
        req.last_node = self.root_node

    def cache_finished_req(self, req: CacheReq, insert: bool = True) -> None:
        """Free all `kv_allocated_len` slots of the row, then the row."""
        if req.kv_allocated_len < len(req.fill_ids):
            raise ValueError("cache_finished_req: kv_allocated_len < len(fill_ids)")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        free_own(self.allocator, req, row, [(0, req.kv_allocated_len)])
        self.req_to_token_pool.free(req.req_pool_idx)

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        self.allocator.verify()
        assert not self.root_node.children, "NoRadixCache: the root must stay empty"
