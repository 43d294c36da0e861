"""`RadixCache`: shares the KV of common prompt prefixes between requests (SGLang's design).

The tree maps token sequences to KV slots. Keys are matched a page at a time: every node's key
length is a multiple of page_size, and a node's children are keyed by the first page of their
key (a token id when page_size is 1, else a tuple of page_size ids), so a match or an insert
never ends inside a page. The tree owns the slots in its nodes' values; freeing them is its job
(eviction, reset). Requests lock the path to the node their shared prefix ends at; locked
nodes are never evicted.

Sizes: `evictable_size` is the total key length of unlocked nodes, `protected_size` that of
locked ones; both are updated at every lock transition, split, insert and eviction.
LRU: a logical clock ticks once per match or insert and every node on the path gets the same
time, so a parent is never older than its children and the oldest unlocked leaf goes first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.base import CacheReq, PrefixCache, TreeNode, free_own, namespaced
from engine.mem_cache.memory_pool import ReqToTokenPool


class RadixCache(PrefixCache):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int
    ) -> None:
        if allocator.page_size != page_size:
            raise ValueError(f"RadixCache: page_size {page_size} != {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = req_to_token_pool.req_to_token.device  # where node values live
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.root_node = TreeNode(value=self._empty)
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    # -- keys -----------------------------------------------------------------------------------
    def _child_key(self, key: list[int], start: int) -> int | tuple[int, ...]:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], start: int) -> int:
        """Common prefix length of node_key and key[start:], rounded down to whole pages."""
        n = min(len(node_key), len(key) - start)
        if node_key[:n] == key[start : start + n]:
            return n  # both page aligned
        i = 0
        while node_key[i] == key[start + i]:
            i += 1
        return i - i % self.page_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- match / insert -------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `key` cut to whole pages: (its slots, int64; the deepest
        node covering it). A match ending inside a node splits the node there."""
        return self._match(key)

    def _match(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        path = self._walk(key)
        slots = torch.cat([n.value for n in path]) if path else self._empty
        return slots, path[-1] if path else self.root_node

    def _walk(self, key: list[int]) -> list[TreeNode]:
        """The nodes of the longest page-aligned prefix of `key` in the tree, root first
        (excluded), splitting the last one where the match ends inside it; touches them."""
        key = key[: len(key) - len(key) % self.page_size]
        now = self._tick()
        node, pos, path = self.root_node, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            path.append(child)
            node, pos = child, pos + n
        return path

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Add a page-aligned key with its slots; the tree takes ownership of the slots it did
        not hold. Returns how many leading tokens it already held (their `slots` stay the
        caller's to free; with a hierarchical cache, up to the first node the tree had only in
        host memory: from there on it takes the caller's slots)."""
        return self._insert(key, slots)[0]

    def _insert(self, key: list[int], slots: torch.Tensor) -> tuple[int, TreeNode | None]:
        """`insert`, also returning the leaf it added for the key's tail (None if the tree
        held the whole key)."""
        if len(key) % self.page_size or len(key) != slots.numel():
            raise ValueError(f"insert: key of {len(key)} tokens, {slots.numel()} slots")
        now = self._tick()
        node, pos, held = self.root_node, 0, None
        while pos < len(key):
            child_key = self._child_key(key, pos)
            child = node.children.get(child_key)
            if child is None:
                value = slots[pos:].to(self.device, torch.int64).clone()
                child = node.children[child_key] = TreeNode(key[pos:], value, node, now)
                self._evictable += len(key) - pos
                self._on_new_node(child)
                return (pos if held is None else held), child
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            if self._on_reused(child, slots[pos : pos + n]) and held is None:
                held = pos
            node, pos = child, pos + n
        return (pos if held is None else held), None

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; the new upper part inherits its lock and access time,
        so the sizes do not change."""
        parent = child.parent
        assert parent is not None
        value = child.value  # None: evicted to host memory (hierarchical cache)
        upper = TreeNode(child.key[:n], None, parent, child.last_access_time)
        upper.value = None if value is None else value[:n]
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.parent = child.key[n:], upper
        child.value = None if value is None else value[n:]
        upper.children[self._child_key(child.key, 0)] = child
        self._on_split(upper, child)
        return upper

    # hooks of the hybrid sliding-window and hierarchical caches (swa_radix_cache.py,
    # hiradix_cache.py)
    def _on_new_node(self, node: TreeNode) -> None:
        pass

    def _on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        pass

    def _on_evicted(self, node: TreeNode) -> None:
        pass

    def _on_reused(self, node: TreeNode, slots: torch.Tensor) -> bool:
        """An insert passes through `node`, which the tree holds already (the caller's
        `slots` have the same K/V). True if the tree takes `slots` for it (a hierarchical
        cache's node that was in host memory only)."""
        return False

    # -- locks ----------------------------------------------------------------------------------
    def _path(self, node: TreeNode | None) -> list[TreeNode]:
        """Nodes from `node` up to (excluding) the root; raises for an evicted node."""
        path: list[TreeNode] = []
        if node is None or node.parent is None:
            return path
        if node.parent.children.get(self._child_key(node.key, 0)) is not node:
            raise RuntimeError("lock on a node that is no longer in the tree (evicted?)")
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        """Lock root..node against eviction (the root or None: nothing to lock)."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        for n in self._path(node):
            if n.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: {n} is not locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._protected -= len(n.key)

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves (a parent left childless becomes a leaf)
        until at least `num_tokens` are freed or nothing unlocked is left."""
        if num_tokens <= 0:
            return 0
        freed: list[torch.Tensor] = []
        live_from: list[int] = []  # (a node's window KV: its last swa_live tokens')

        def evict_one(node: TreeNode) -> bool:
            live_from.append(len(node.key) - node.swa_live)
            return self._evict_node(node, freed)

        num_freed = self._evict_lru(self._evict_candidates(), num_tokens, evict_one)
        if freed:
            self.allocator.free_runs(freed, live_from)  # (node values: whole pages)
            self.epoch += 1
        self._evictable -= num_freed
        return num_freed

    def _evict_candidates(self) -> list[TreeNode]:
        return [n for n in self._leaves() if n.lock_ref == 0]

    def _evict_node(self, node: TreeNode, freed: list[torch.Tensor]) -> bool:
        """Evict one candidate, adding its device slots to `freed`; whether its parent has
        become a candidate."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]
        freed.append(node.value)
        self._on_evicted(node)
        return not parent.children and parent.lock_ref == 0

    @staticmethod
    def _evict_lru(
        candidates: list[TreeNode], num_tokens: int, evict_one: Callable[[TreeNode], bool]
    ) -> int:
        """Evict `candidates`, least recently used first, until `num_tokens` are evicted or
        none is left; `evict_one(node)` evicts one and says whether its parent (unless the
        root) has become a candidate. Returns the tokens evicted."""
        heap = [(n.last_access_time, n.id, n) for n in candidates]
        heapq.heapify(heap)
        num = 0
        while num < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            num += len(node.key)
            if evict_one(node) and parent is not None and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return num

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        return self._subtree(self.root_node)[1:]

    @staticmethod
    def _subtree(top: TreeNode) -> list[TreeNode]:
        """`top` and every node below it, parents before children."""
        out, stack = [], [top]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if not n.children]

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> None:
        """Free every unlocked node (all of them when no request is running)."""
        self.evict(self._evictable)

    # -- requests -------------------------------------------------------------------------------
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Share the page-aligned part of `fill_ids`; the request then uses the tree's slots
        for it (its own duplicates are freed) and locks the new deepest node. Slots past the
        aligned length stay the request's."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        aligned = len(req.fill_ids) - len(req.fill_ids) % self.page_size
        key = namespaced(req.fill_ids[:aligned], getattr(req, "cache_namespace", 0))
        kv = row[:aligned].to(torch.int64)
        shared = req.prefix_indices.numel()
        in_tree = self._insert_req(req, key, kv)
        assert in_tree >= shared, "the request's locked prefix left the tree"
        free_own(self.allocator, req, kv, [(shared, in_tree)])
        slots, node = self._match(key)
        assert slots.numel() == aligned
        row[shared:aligned] = slots[shared:].to(row.dtype)
        self.inc_lock_ref(node)  # before the unlock, so the shared path never looks evictable
        self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = slots, node

    def cache_finished_req(self, req: CacheReq, insert: bool = True) -> None:
        """Share the page-aligned part of `fill_ids` (if `insert`), free every slot the
        request still owns up to `kv_allocated_len`, unlock and free its row."""
        if req.kv_allocated_len < len(req.fill_ids):
            raise ValueError("cache_finished_req: kv_allocated_len < len(fill_ids)")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        kv = row[: req.kv_allocated_len].to(torch.int64)
        shared = req.prefix_indices.numel()
        own_from = shared
        to_free = []
        if insert:
            aligned = len(req.fill_ids) - len(req.fill_ids) % self.page_size
            key = namespaced(req.fill_ids[:aligned], getattr(req, "cache_namespace", 0))
            in_tree = self._insert_req(req, key, kv[:aligned])
            to_free.append((shared, in_tree))
            own_from = max(aligned, shared)
        to_free.append((own_from, kv.numel()))
        free_own(self.allocator, req, kv, to_free)  # (each from a page boundary)
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)

    def _insert_req(self, req: CacheReq, key: list[int], kv: torch.Tensor) -> int:
        """`insert` of a request's page-aligned KV `kv` (its row from position 0); returns how
        many tokens the tree held (the caller frees the request's own slots for them)."""
        return self.insert(key, kv)

    # -- integrity ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.allocator.verify()
        ps = self.page_size
        nodes = self._nodes()
        evictable = protected = 0
        for node in nodes:
            parent = node.parent
            assert parent is not None and len(node.key) > 0, f"{node}: empty or detached"
            assert len(node.key) % ps == 0 and node.value.numel() == len(node.key), f"{node}"
            assert node.value.dtype == torch.int64
            assert parent.children.get(self._child_key(node.key, 0)) is node, f"{node}: bad key"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
            if parent.parent is not None:
                assert node.last_access_time <= parent.last_access_time, f"{node}: LRU order"
            assert node.last_access_time <= self._clock
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self._evictable, self._protected), "size accounting"
        if nodes:
            self._check_owned(torch.cat([n.value for n in nodes]), self.allocator)

    def _check_owned(self, slots: torch.Tensor, allocator: TokenToKVPoolAllocator) -> None:
        """Slots the tree holds: each once, allocated, in whole contiguous pages."""
        ps = self.page_size
        assert torch.unique(slots).numel() == slots.numel(), "a slot is owned twice"
        assert bool(allocator.is_allocated(slots).all()), "the tree holds a free slot"
        pages = slots.view(-1, ps)  # node values are whole pages, in order
        assert bool((pages[:, 0] % ps == 0).all()), "a page does not start at its first slot"
        offsets = torch.arange(ps, device=slots.device)
        assert bool((pages - pages[:, :1] == offsets).all()), "a page is not contiguous"
