"""`HiRadixCache`: the radix prefix cache over two tiers, device memory and a larger host
pool (SGLang's HiCache, `--enable-hierarchical-cache`; vLLM's CPU KV offloading).

A node's K/V may be on the device (`value`), backed up in host memory (`host_value`), or
both. Device eviction no longer forgets a prefix: a backed-up node only gives back its device
slots and stays in the tree as a host node (`value` None); a later request that matches it
loads it back (`load_back`) instead of computing its prefill again. Host memory is evicted
in turn, least recently used host-only leaves first, and only then is a prefix forgotten.

Write policies (`--hicache-write-policy`, SGLang's): `write_through` backs up every node
when it is inserted; `write_through_selective` when it is reused (its second hit);
`write_back` when it is evicted from the device. A node that is not backed up when it is
evicted (under a write-through policy: never reused, or host memory was full of backed-up
device nodes) is forgotten, as in SGLang.

Invariants (`check_integrity`), besides `RadixCache`'s for the device part:
* device residency is closed under prefixes: a node off the device has no child on it, so a
  match is some device nodes followed by some host nodes;
* a node off the device is backed up and unlocked (requests lock device nodes only);
* host slots are owned once, allocated in the host allocator, in whole pages.
`evictable_size` and `protected_size` count device tokens.

The copies themselves are queued (`TransferQueue`) and run by the device before the next
forward (engine/mem_cache/host_pool.py says why that order is safe).
"""

from __future__ import annotations

import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.base import CacheReq, PrefixMatch, TreeNode
from engine.mem_cache.host_pool import HICACHE_WRITE_POLICIES, LOAD, STORE, TransferQueue
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.radix_cache import RadixCache

# A host hit shorter than this is computed again rather than loaded (SGLang's default).
LOAD_BACK_THRESHOLD = 10
# When host memory is full, at least 1/this of it is freed at once.
HOST_EVICT_SLACK = 64


class HiRadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        page_size: int,
        host_allocator: TokenToKVPoolAllocator,
        write_policy: str = "write_through",
        load_back_threshold: int = LOAD_BACK_THRESHOLD,
    ) -> None:
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(
                f"hicache_write_policy: {write_policy!r} not in {HICACHE_WRITE_POLICIES}"
            )
        if host_allocator.page_size != page_size:
            raise ValueError("HiRadixCache: the host pool's page size differs")
        super().__init__(req_to_token_pool, allocator, page_size)
        self.host = host_allocator
        self.write_policy = write_policy
        # hits (an insert, or a request reusing the node) before a node is backed up
        self.write_threshold = 2 if write_policy == "write_through_selective" else 1
        self.load_back_threshold = max(load_back_threshold, 1)
        self.transfers = TransferQueue()
        self.host_hit_tokens = 0  # tokens requests loaded back instead of computing

    # -- hooks ----------------------------------------------------------------------------------
    def _on_new_node(self, node: TreeNode) -> None:
        node.hit_count = 1
        self._maybe_backup(node)

    def _on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        n = len(upper.key)
        if lower.host_value is not None:
            upper.host_value, lower.host_value = lower.host_value[:n], lower.host_value[n:]
        upper.hit_count = lower.hit_count
        upper.host_ref = lower.host_ref

    def _maybe_backup(self, node: TreeNode) -> None:
        """Back up a device node its hits call for (write-through policies)."""
        if self.write_policy == "write_back":
            return
        if node.host_value is None and node.hit_count >= self.write_threshold:
            self._backup(node)

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node to host memory (evicting host-only nodes for room)."""
        n = len(node.key)
        if self.host.available_size() < n:
            # a little more than needed: each call scans the tree, and a full host pool would
            # otherwise scan it again for every node written through
            self.evict_host(max(n - self.host.available_size(), self.host.size // HOST_EVICT_SLACK))
        slots = self.host.alloc_extend([0], [n], [0])
        if slots is None:
            return False
        node.host_value = slots
        self.transfers.add(STORE, node.value, slots)
        return True

    # -- match ----------------------------------------------------------------------------------
    def match(self, key: list[int]) -> PrefixMatch:
        path = self._walk(key)
        d = 0
        while d < len(path) and path[d].value is not None:
            d += 1
        slots = torch.cat([n.value for n in path[:d]]) if d else self._empty
        node = path[d - 1] if d else self.root_node
        if d == len(path):
            return PrefixMatch(slots, node)
        return PrefixMatch(slots, node, sum(len(n.key) for n in path[d:]), path[-1])

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        m = self.match(key)
        return m.slots, m.node

    def _match(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        return self.match_prefix(key)

    def load_back(self, req: CacheReq) -> int:
        """Match the request's prefix again (the tree may have changed since its match) and
        load the host part of it into device memory, if it is long enough and device memory
        can be had (evicting other unlocked cache); the request then shares it."""
        req.host_hit_len, req.host_node = 0, None
        m = self.match(req.prefix_key())
        req.prefix_indices, req.last_node = m.slots, m.node
        if m.host_node is None or m.host_len < self.load_back_threshold:
            return 0
        nodes = []
        node: TreeNode | None = m.host_node
        while node is not m.node:
            assert node is not None and node.value is None and node.host_value is not None
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        for n in nodes:
            n.host_ref += 1  # no host eviction of them while device memory is freed
        self.inc_lock_ref(m.node)
        try:
            free = self.allocator.available_size()
            if free < m.host_len:
                self.evict(m.host_len - free)
            slots = self.allocator.alloc_extend([0], [m.host_len], [0])
        finally:
            self.dec_lock_ref(m.node)
            for n in nodes:
                n.host_ref -= 1
        if slots is None:
            return 0
        self.transfers.add(LOAD, torch.cat([n.host_value for n in nodes]), slots)
        offset = 0
        for n in nodes:
            n.value = slots[offset : offset + len(n.key)]
            offset += len(n.key)
        self._evictable += m.host_len
        req.prefix_indices = torch.cat([m.slots, slots])
        req.last_node = nodes[-1]
        self.host_hit_tokens += m.host_len
        return m.host_len

    def take_transfers(self) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
        return self.transfers.take()

    # -- insert ---------------------------------------------------------------------------------
    def _on_reused(self, node: TreeNode, slots: torch.Tensor) -> bool:
        """A node evicted to host memory takes the inserting caller's slots (back on the
        device); a device node counts a hit."""
        if node.value is None:
            node.value = slots.to(self.device, torch.int64).clone()
            self._evictable += len(node.key)
            return True
        node.hit_count += 1
        self._maybe_backup(node)
        return False

    # -- eviction -------------------------------------------------------------------------------
    def _device_leaf(self, node: TreeNode) -> bool:
        return node.value is not None and all(c.value is None for c in node.children.values())

    def _evict_candidates(self) -> list[TreeNode]:
        """Unlocked nodes with no child on the device: eviction frees their device slots and
        keeps them as host nodes when they are (or, write_back, can now be) backed up."""
        return [n for n in self._nodes() if n.lock_ref == 0 and self._device_leaf(n)]

    def _evict_node(self, node: TreeNode, freed: list[torch.Tensor]) -> bool:
        if node.host_value is None and self.write_policy == "write_back":
            self._backup(node)
        parent = node.parent
        assert parent is not None and node.value is not None
        freed.append(node.value)
        node.value = None
        if node.host_value is None:
            self._drop(node)
        return parent.lock_ref == 0 and self._device_leaf(parent)

    def evict_host(self, num_tokens: int) -> int:
        """Forget least-recently-used host-only leaves until `num_tokens` host tokens are
        freed (or none is left); returns how many were."""
        freed: list[torch.Tensor] = []

        def evict_one(node: TreeNode) -> bool:
            parent = node.parent
            assert parent is not None and node.host_value is not None
            del parent.children[self._child_key(node.key, 0)]
            freed.append(node.host_value)
            return parent.value is None and not parent.children and parent.host_ref == 0

        candidates = [n for n in self._nodes()
                      if n.value is None and not n.children and n.host_ref == 0]  # fmt: skip
        num_freed = self._evict_lru(candidates, num_tokens, evict_one)
        if freed:
            self.host.free(torch.cat(freed))
        return num_freed

    def _drop(self, node: TreeNode) -> None:
        """Take `node` (off the device now) and its subtree (host nodes) out of the tree,
        freeing their host slots."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]
        host = [n.host_value for n in self._subtree(node) if n.host_value is not None]
        if host:
            self.host.free(torch.cat(host))

    def reset(self) -> None:
        """Forget every unlocked node, on the device and in host memory."""
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        for node in self._nodes():
            parent = node.parent
            assert parent is not None
            if node.lock_ref or (parent.parent is not None and parent.lock_ref == 0):
                continue  # locked, or under an unlocked node taken out with it
            del parent.children[self._child_key(node.key, 0)]
            for n in self._subtree(node):
                if n.value is not None:
                    device.append(n.value)
                if n.host_value is not None:
                    host.append(n.host_value)
        if device:
            self.allocator.free_runs(device)
            self.epoch += 1
        if host:
            self.host.free(torch.cat(host))
        self._evictable = 0

    # -- introspection --------------------------------------------------------------------------
    def host_stats(self) -> dict[str, int]:
        return {
            "hicache_host_tokens": self.host.size,
            "hicache_host_used_tokens": self.host.size - self.host.available_size(),
            "hicache_host_hit_tokens": self.host_hit_tokens,
            "hicache_stored_tokens": self.transfers.stored_tokens,
            "hicache_loaded_tokens": self.transfers.loaded_tokens,
        }

    def check_integrity(self) -> None:
        self.allocator.verify()
        ps = self.page_size
        nodes = self._nodes()
        evictable = protected = 0
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        for node in nodes:
            parent = node.parent
            assert parent is not None and len(node.key) > 0, f"{node}: empty or detached"
            assert len(node.key) % ps == 0, f"{node}: not whole pages"
            assert parent.children.get(self._child_key(node.key, 0)) is node, f"{node}: bad key"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
            assert node.host_ref == 0, f"{node}: a load's host lock was left"
            if parent.parent is not None:
                assert node.last_access_time <= parent.last_access_time, f"{node}: LRU order"
            if node.host_value is not None:
                assert node.host_value.numel() == len(node.key), f"{node}: host value"
                host.append(node.host_value)
            if node.value is None:
                assert node.host_value is not None, f"{node}: off the device, not backed up"
                assert node.lock_ref == 0, f"{node}: a host node is locked"
                continue
            assert parent.parent is None or parent.value is not None, f"{node}: under a host node"
            assert node.value.numel() == len(node.key) and node.value.dtype == torch.int64
            device.append(node.value)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self._evictable, self._protected), "size accounting"
        if device:
            self._check_owned(torch.cat(device), self.allocator)
        if host:
            self._check_owned(torch.cat(host), self.host)
