"""The prefix-cache interface the scheduler programs against, and what it needs of a request.

Two implementations share it: `RadixCache` (prefix sharing) and `NoRadixCache`
(`--disable-radix-cache`), so the scheduler never branches on which one it holds.

Slot ownership, the invariant both keep: every allocated KV page belongs to exactly one owner,
either the cache (a tree node) or one running request. A request's row
`req_to_token[req_pool_idx, :kv_allocated_len]` starts with `len(prefix_indices)` slots it
shares with the cache (protected by its lock on `last_node`); the rest are its own, and it
must give them back exactly once (`cache_finished_req` does).
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from engine.mem_cache.allocator import TokenToKVPoolAllocator

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: `key` (token ids) and `value` (their KV slots, int64).

    Invariants (checked by `RadixCache.check_integrity`): a non-root node has a non-empty key
    whose length is a multiple of page_size; `parent.children[first page of key] is self`;
    `lock_ref` counts running requests whose prefix ends at or below this node, so a parent's
    lock_ref is at least the sum of its children's; `last_access_time` never exceeds the
    parent's (the whole path is touched together).
    """

    __slots__ = (
        "id", "key", "value", "parent", "children", "lock_ref", "last_access_time",
        "swa_live", "swa_lock_ref", "host_value", "host_ref", "hit_count",
    )  # fmt: skip

    def __init__(
        self,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
        parent: TreeNode | None = None,
        last_access_time: int = 0,
    ) -> None:
        self.id = next(_node_ids)
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.parent = parent
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = last_access_time
        # hybrid sliding-window memory (engine/mem_cache/swa_radix_cache.py): tokens of the
        # value whose window-layer KV is still held, and locks on that KV
        self.swa_live = 0
        self.swa_lock_ref = 0
        # hierarchical cache (engine/mem_cache/hiradix_cache.py): the node's slots in the host
        # pool (None: not backed up), loads in progress from them, and matches of the node;
        # a node evicted to host memory has `value` None
        self.host_value: torch.Tensor | None = None
        self.host_ref = 0
        self.hit_count = 0

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def cache_namespace(lora_id: int, salt: str | None = None) -> int:
    """A request's prefix-cache namespace: its LoRA adapter's id (0: the base model), and
    with a cache salt (vLLM's `cache_salt`, SGLang's `extra_key`) a 128-bit digest of the
    salt above it, so a request reuses cached K/V only of requests with its adapter and its
    salt (or, without one, of unsalted ones): tenants who do not share a salt cannot learn
    from a fast first token that someone sent their prompt. Adapter ids stay below 2**32."""
    if salt is None:
        return lora_id
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return (((1 << 128) | int.from_bytes(digest, "big")) << 32) | lora_id


def namespaced(key: list[int], namespace: int) -> list[int]:
    """The cache key of token ids in a namespace (`cache_namespace`; 0: the base model,
    unsalted): each id with the namespace in its high bits, so no two namespaces share a
    prefix."""
    if not namespace:
        return key
    high = namespace << 32
    return [high | t for t in key]


class CacheReq(Protocol):
    """The fields of the scheduler's request that the cache reads and writes.

    `fill_ids`: tokens whose KV is in `req_to_token[req_pool_idx, :len(fill_ids)]`.
    `kv_allocated_len`: slots of the row that are allocated (>= len(fill_ids); the overlap
    scheduler may have allocated one more). `prefix_indices`: the leading slots shared with
    the cache (page aligned). `last_node`: the node the request holds a lock on (the root, or
    None, when nothing is shared).
    Hybrid sliding-window memory also reads `swa_released` (see `free_own`; 0 if absent).
    """

    req_pool_idx: int
    fill_ids: list[int]
    kv_allocated_len: int
    prefix_indices: torch.Tensor
    last_node: TreeNode | None


def free_own(
    allocator: TokenToKVPoolAllocator,
    req: CacheReq,
    row: torch.Tensor,
    ranges: list[tuple[int, int]],
) -> None:
    """Free the request's own slots `row[a:b]` for each (a, b), every a at a page boundary.
    With hybrid sliding-window memory, the request's account says which of them still hold
    window KV, so that freeing them reads nothing from the device: those from its
    `swa_released` on (the ones before were freed as its window moved on, or handed to the
    radix tree)."""
    released = getattr(req, "swa_released", 0)
    kept = [(a, b) for a, b in ranges if b > a]
    if kept:
        allocator.free_runs([row[a:b] for a, b in kept],
                            [min(b, max(a, released)) - a for a, b in kept])  # fmt: skip


class PrefixMatch(NamedTuple):
    """A match of the prefix cache: `slots` (int64) of the longest cached page-aligned prefix
    on the device and `node`, its deepest node; with a hierarchical cache, `host_len` more
    tokens of the key held in host memory, down to `host_node` (0 and None without)."""

    slots: torch.Tensor
    node: TreeNode
    host_len: int = 0
    host_node: TreeNode | None = None


class PrefixCache(ABC):
    """What the scheduler calls. Sizes are in tokens."""

    root_node: TreeNode
    # bumped whenever device cache is evicted: a match made before may name freed slots
    epoch = 0

    @abstractmethod
    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached page-aligned prefix of `key`: (its slots, int64; the deepest node)."""

    def match(self, key: list[int]) -> PrefixMatch:
        """`match_prefix`, and what host memory holds beyond it (hierarchical cache)."""
        return PrefixMatch(*self.match_prefix(key))

    def load_back(self, req: CacheReq) -> int:
        """Hierarchical cache: bring the host part of the request's match (`host_len`,
        `host_node`, as `match` found them) into device memory, extending its
        `prefix_indices` and `last_node`; returns the tokens loaded (0: none)."""
        return 0

    def host_stats(self) -> dict[str, int]:
        """Hierarchical cache: its host pool's figures (`hicache_*`); none without it."""
        return {}

    def take_transfers(self) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
        """Hierarchical cache: the host <-> device copies queued since the last call, in
        order, for the next forward to run first (engine/mem_cache/host_pool.py)."""
        return None

    @abstractmethod
    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Hand `slots` of the page-aligned `key` to the cache; returns how many leading tokens
        the cache already held (the caller frees its own slots for those)."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` (or all it can) of unlocked cache; returns tokens freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of the sliding-window pool held by unlocked cache (or
        all it can), keeping the full KV; returns tokens freed. Only the hybrid cache has it."""
        return 0

    def swa_evictable_size(self) -> int:
        return 0

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def unlock_req(self, req: CacheReq) -> None:
        """Drop the request's lock on its cached prefix (retraction)."""
        self.dec_lock_ref(req.last_node)

    def release_prefix_window(self, req: CacheReq) -> None:
        """Hybrid window memory only: the request no longer reads its prefix's window KV."""
        return None

    @abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """After a prefill chunk: share the computed page-aligned prefix of `fill_ids`."""

    @abstractmethod
    def cache_finished_req(self, req: CacheReq, insert: bool = True) -> None:
        """The request ends: share its KV (unless `insert` is False, e.g. on retraction), free
        every slot it still owns, drop its lock and free its row."""

    @abstractmethod
    def reset(self) -> None:
        """Free everything the cache holds that no request has locked."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant is broken."""
