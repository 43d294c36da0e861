"""`SWARadixCache`: the prefix cache over hybrid sliding-window memory (see
engine/mem_cache/swa_allocator.py; SGLang's SWARadixCache works the same way).

A node's full slots stay until the node is evicted, as in `RadixCache`. Its window-layer KV
(the swa pages of those slots) may go earlier: `evict_swa` frees it from unlocked nodes,
least recently used first, and a request frees its own tokens' swa pages once no query of
it will look back that far. A node whose swa pages are gone is a tombstone for the windowed
layers only.

A cached prefix is usable only if its last W - 1 tokens (W the window) still have swa
pages: the first new token looks back that far. `match_prefix` cuts a match to the longest
such prefix. When a request inserts tokens the tree already holds, swa pages the tree lacks
and the request has are moved to the tree's slots (their KV is the same).

Which pages hold swa KV is known on the host, so none of this reads the device: a node's live
swa pages are always its last `swa_live` tokens' (a node is made from a request's slots, whose
own live pages are those from its `swa_released` on; tombstoning takes a whole node; a split
cuts the suffix in two; adopting a request's pages extends it), and a request knows its own.
`check_integrity` compares the account with the device.

Locks: `inc_lock_ref(node)` locks the path's full KV as `RadixCache` does, and the swa KV of
the path's last tokens from `swa_lock_start(depth)` on (the window of the request's first
new token), splitting a node there so that this depth is a node boundary. Unlocking finds the
same nodes again: splits only subdivide, and nothing above the boundary is ever locked.
`swa_evictable_size` counts the swa tokens of nodes without swa locks. Once a request's
queries have moved a window past its cached prefix, the scheduler drops that window lock
early (`release_prefix_window`); it is taken again, for the bookkeeping, just before the
request's lock moves or goes.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from engine.mem_cache.base import CacheReq, TreeNode
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.radix_cache import RadixCache
from engine.mem_cache.swa_allocator import SWATokenToKVPoolAllocator


class SWARadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: SWATokenToKVPoolAllocator,
        page_size: int,
        sliding_window: int,
    ) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.allocator: SWATokenToKVPoolAllocator = allocator
        self.sliding_window = sliding_window
        self._swa_evictable = 0

    def swa_lock_start(self, depth: int) -> int:
        """First position the window of a query at `depth` reads, rounded down to a page."""
        start = max(0, depth - self.sliding_window + 1)
        return start - start % self.page_size

    def _live_pages(self, path: list[TreeNode]) -> np.ndarray:
        """Per page of the path's nodes, in order: whether it still has its swa page."""
        ps = self.page_size
        live = np.zeros(sum(len(n.key) for n in path) // ps, dtype=bool)
        end = 0
        for n in path:
            end += len(n.key) // ps
            live[end - n.swa_live // ps : end] = True
        return live

    # -- hooks ----------------------------------------------------------------------------------
    def _on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        upper.swa_lock_ref = lower.swa_lock_ref
        live = lower.swa_live  # the suffix of the whole node: the lower part's end of it
        lower.swa_live = min(live, len(lower.key))
        upper.swa_live = live - lower.swa_live

    def _on_evicted(self, node: TreeNode) -> None:
        assert node.swa_lock_ref == 0
        self._swa_evictable -= node.swa_live

    # -- match / insert -------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The longest cached prefix whose window (the last W - 1 tokens) has its swa KV."""
        path = self._walk(key)
        if not path:
            return self._empty, self.root_node
        slots, node = torch.cat([n.value for n in path]), path[-1]
        ps = self.page_size
        live = self._live_pages(path)
        idx = np.arange(live.size)
        last_dead = np.maximum.accumulate(np.where(live, -1, idx))  # per page k: last dead <= k
        ends = (idx + 1) * ps  # a prefix of k + 1 pages ends here
        first_needed = np.maximum(ends - self.sliding_window + 1, 0) // ps
        ok = np.flatnonzero(last_dead < first_needed)
        usable = (int(ok[-1]) + 1) * ps if ok.size else 0
        if usable == slots.numel():
            return slots, node
        return slots[:usable], self._node_at(node, slots.numel(), usable)

    def _node_at(self, node: TreeNode, depth: int, target: int) -> TreeNode:
        """The node ending at `target` on the path to `node` (which ends at `depth`),
        splitting one there if needed."""
        while depth > target:
            start = depth - len(node.key)
            if start < target:
                return self._split(node, target - start)
            assert node.parent is not None
            node, depth = node.parent, start
        return node

    def insert(
        self, key: list[int], slots: torch.Tensor, own_from: int = 0, live_from: int = 0
    ) -> int:
        """`RadixCache.insert`, with the caller's account of its `slots`: those before
        `own_from` are the tree's own (a request's cached prefix); of the others, those from
        `live_from` on still have swa pages (a request's `swa_released`). For tokens the tree
        holds already, the caller's swa pages go to the tree's pages that lack one, and its
        others are freed: none of its own slots before the returned count keeps a swa page."""
        ps = self.page_size
        src_from = -(-max(own_from, live_from) // ps) * ps
        in_tree, leaf = self._insert(key, slots)
        if leaf is not None:  # the caller's slots from the leaf's start on: live from src_from
            dead = min(len(leaf.key), max(0, src_from - (len(key) - len(leaf.key))))
            leaf.swa_live = len(leaf.key) - dead
            self._swa_evictable += leaf.swa_live
        if in_tree > src_from:
            self._adopt_swa(self._walk(key[:in_tree]), slots, src_from)
        return in_tree

    def _adopt_swa(self, path: list[TreeNode], slots: torch.Tensor, src_from: int) -> None:
        """The tree's `path` holds the tokens of `slots` (the caller's, for the same positions),
        whose pages from `src_from` on have swa pages: give them to the tree's pages without
        (each node's live suffix grows down to the caller's) and free the rest."""
        moved_src, moved_dst, dropped = [], [], []
        end = 0
        for n in path:
            start, end = end, end + len(n.key)
            lo = max(start, src_from)  # the caller's live pages here: lo .. end
            tree_from = end - n.swa_live  # the tree's: tree_from .. end
            if lo >= end:
                continue
            if lo < tree_from:
                moved_src.append(slots[lo:tree_from])
                moved_dst.append(n.value[lo - start : tree_from - start])
                n.swa_live += tree_from - lo
                if n.swa_lock_ref == 0:
                    self._swa_evictable += tree_from - lo
            dropped.append(slots[max(lo, tree_from) : end])
        if moved_src:
            self.allocator.move_swa_runs(moved_src, moved_dst)
        self.allocator.free_swa_runs(dropped)

    def _insert_req(self, req: CacheReq, key: list[int], kv: torch.Tensor) -> int:
        in_tree = self.insert(key, kv, own_from=req.prefix_indices.numel(),
                              live_from=getattr(req, "swa_released", 0))  # fmt: skip
        # its own slots before in_tree have no swa pages now (given to the tree or freed)
        req.swa_released = max(getattr(req, "swa_released", 0), in_tree)
        return in_tree

    # -- locks ----------------------------------------------------------------------------------
    def _window_nodes(self, node: TreeNode | None, split: bool) -> list[TreeNode]:
        """The nodes of the path to `node` that hold positions from `swa_lock_start` of its
        depth on; with `split`, first cut the node that straddles that position."""
        path = self._path(node)
        depth = sum(len(n.key) for n in path)
        start_at = self.swa_lock_start(depth)
        out: list[TreeNode] = []
        end = depth
        for n in path:
            start = end - len(n.key)
            if start < start_at:
                if split and end > start_at:
                    self._split(n, start_at - start)
                    out.append(n)  # the lower part keeps the object
                break
            out.append(n)
            end = start
        return out

    def _lock_window(self, node: TreeNode | None) -> None:
        for n in self._window_nodes(node, split=True):
            if n.swa_lock_ref == 0:
                self._swa_evictable -= n.swa_live
            n.swa_lock_ref += 1

    def _unlock_window(self, node: TreeNode | None) -> None:
        for n in self._window_nodes(node, split=False):
            if n.swa_lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: {n} has no swa lock")
            n.swa_lock_ref -= 1
            if n.swa_lock_ref == 0:
                self._swa_evictable += n.swa_live

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        super().inc_lock_ref(node)
        self._lock_window(node)

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        super().dec_lock_ref(node)
        self._unlock_window(node)

    # -- requests -------------------------------------------------------------------------------
    def release_prefix_window(self, req: CacheReq) -> None:
        """The request's queries no longer read its cached prefix: drop the window lock on
        the prefix's last tokens (its full lock stays until it finishes)."""
        if not getattr(req, "swa_prefix_released", False):
            self._unlock_window(req.last_node)
            req.swa_prefix_released = True

    def _retake_window(self, req: CacheReq) -> None:
        """Undo `release_prefix_window` before the request's lock is moved or dropped."""
        if getattr(req, "swa_prefix_released", False):
            self._lock_window(req.last_node)
            req.swa_prefix_released = False

    def cache_unfinished_req(self, req: CacheReq) -> None:
        self._retake_window(req)
        super().cache_unfinished_req(req)

    def cache_finished_req(self, req: CacheReq, insert: bool = True) -> None:
        self._retake_window(req)
        super().cache_finished_req(req, insert)

    def unlock_req(self, req: CacheReq) -> None:
        self._retake_window(req)
        super().unlock_req(req)

    # -- eviction -------------------------------------------------------------------------------
    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def evict_swa(self, num_tokens: int) -> int:
        """Tombstone least-recently-used nodes without swa locks until `num_tokens` swa
        tokens are freed (their full KV stays cached)."""
        if num_tokens <= 0:
            return 0
        heap = [
            (n.last_access_time, n.id, n)
            for n in self._nodes()
            if n.swa_lock_ref == 0 and n.swa_live > 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            freed += self._tombstone(heapq.heappop(heap)[2])
        return freed

    def _tombstone(self, node: TreeNode) -> int:
        """Free an unlocked node's swa pages (its live suffix); returns the tokens freed."""
        assert node.swa_lock_ref == 0
        freed = self.allocator.free_swa_runs([node.value[len(node.key) - node.swa_live :]])
        assert freed == node.swa_live, "swa accounting"
        node.swa_live = 0
        self._swa_evictable -= freed
        return freed

    def check_integrity(self) -> None:
        super().check_integrity()
        total = 0
        for n in self._nodes():
            live = self.allocator.has_swa(n.value[:: self.page_size]).tolist()
            dead = (len(n.key) - n.swa_live) // self.page_size
            assert live == [False] * dead + [True] * (len(live) - dead), f"{n}: swa pages"
            assert 0 <= n.swa_lock_ref <= n.lock_ref, f"{n}: swa lock without a lock"
            if n.swa_lock_ref == 0:
                total += n.swa_live
        assert total == self._swa_evictable, "swa evictable accounting"
        self.allocator.check_mapping()
