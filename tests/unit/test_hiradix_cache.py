"""The hierarchical prefix cache (`HiRadixCache`) with real K/V buffers: a device pool, a host
pool and the copies between them, checked by what matters: the K/V a request reuses (from the
device, or loaded back from host memory) is exactly the K/V of its tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.hiradix_cache import HiRadixCache
from engine.mem_cache.host_pool import LOAD, STORE, HostKVPool, TransferQueue, host_pool_tokens
from engine.mem_cache.kv_pool import KVPool
from engine.mem_cache.memory_pool import ReqToTokenPool


class Req:
    """The fields of a scheduler request the cache reads and writes."""

    def __init__(self, fill_ids: list[int]) -> None:
        self.fill_ids = fill_ids
        self.req_pool_idx: int | None = None
        self.kv_allocated_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.host_hit_len = 0
        self.host_node = None
        self.cache_namespace = 0

    def prefix_key(self) -> list[int]:
        return self.fill_ids[: len(self.fill_ids) - 1]


def kv_of(key: list[int], end: int) -> float:
    """The K value a model would write for position end-1 of `key`: a function of the whole
    prefix, as attention K/V are."""
    return float(hash(tuple(key[:end])) % 100003)


class World:
    def __init__(self, page_size: int, device_pages: int, host_pages: int, policy: str) -> None:
        ps = self.ps = page_size
        self.rows = ReqToTokenPool(8, 512, "cpu")
        self.allocator = TokenToKVPoolAllocator(device_pages * ps, ps)
        host = TokenToKVPoolAllocator(host_pages * ps, ps)
        self.cache = HiRadixCache(self.rows, self.allocator, ps, host, policy, 1)
        self.kv = KVPool(device_pages * ps + ps, 2, 1, 1, torch.float32, page_size=ps)
        self.host = HostKVPool(self.kv, host_pages * ps + ps, torch.device("cpu"))
        self.host_hits = 0

    def run_transfers(self) -> None:
        """What the next forward does first."""
        ops = self.cache.take_transfers()
        if ops:
            self.host.apply(ops)

    def serve(self, key: list[int], insert: bool = True) -> tuple[int, int]:
        """A request for `key`: match, load back, compute the rest (writing its K/V), check
        the K/V of its cached prefix, then cache it. Returns (device hit, host hit) tokens."""
        cache = self.cache
        req = Req(key)
        m = cache.match(req.prefix_key())
        req.prefix_indices, req.last_node = m.slots, m.node
        req.host_hit_len, req.host_node = m.host_len, m.host_node
        device_hit = len(m.slots)
        host_hit = cache.load_back(req) if m.host_len else 0
        self.host_hits += host_hit
        assert len(req.prefix_indices) == device_hit + host_hit
        cache.inc_lock_ref(req.last_node)
        prefix = len(req.prefix_indices)
        need = -(-len(key) // self.ps) * self.ps - prefix
        if self.allocator.available_size() < need:
            cache.evict(need - self.allocator.available_size())
        new = self.allocator.alloc_extend([prefix], [len(key)], [0])
        if new is None:  # no room: give up on this request
            cache.dec_lock_ref(req.last_node)
            return 0, 0
        req.req_pool_idx = self.rows.alloc(1)[0]
        row = self.rows.req_to_token[req.req_pool_idx]
        row[:prefix] = req.prefix_indices.to(row.dtype)
        row[prefix : len(key)] = new.to(row.dtype)
        req.kv_allocated_len = len(key)
        self.run_transfers()  # the forward: loads land, then its K/V is written
        for layer in range(2):
            k, v = self.kv.get_kv_buffer(layer)
            got = k[row[:prefix].long(), 0, 0].tolist()
            assert got == [kv_of(key, i + 1) + layer for i in range(prefix)], "stale prefix K"
            assert v[row[:prefix].long(), 0, 0].tolist() == [-x for x in got]
            vals = torch.tensor([kv_of(key, i + 1) + layer for i in range(prefix, len(key))])
            k[new, 0, 0] = vals
            v[new, 0, 0] = -vals
        cache.cache_finished_req(req, insert=insert)
        cache.check_integrity()
        return device_hit, host_hit


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("ps", [1, 4])
def test_random_requests_reuse_exactly_their_kv(policy: str, ps: int) -> None:
    """Conversations that grow and come back, over a device pool that holds a few of them
    and a host pool that holds more: every reused prefix has its tokens' K/V."""
    rng = random.Random(ps * 7 + len(policy))
    w = World(ps, device_pages=96 // ps, host_pages=256 // ps, policy=policy)
    convs = [[rng.randrange(50) for _ in range(rng.randrange(8, 40))] for _ in range(12)]
    hits = [0, 0]
    for step in range(400):
        i = rng.randrange(len(convs))
        if rng.random() < 0.5 and len(convs[i]) < 90:  # the conversation goes on
            convs[i] = convs[i] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        d, h = w.serve(convs[i], insert=rng.random() > 0.05)
        hits[0] += d
        hits[1] += h
        if step % 50 == 49:
            w.run_transfers()
            w.cache.evict(rng.randrange(0, 64))
            w.cache.check_integrity()
        if step == 300:
            w.cache.reset()
            w.cache.check_integrity()
            host = w.cache.host
            assert w.cache.evictable_size() == 0 and host.available_size() == host.size
    assert hits[0] > 0 and hits[1] > 0, hits  # both tiers served prefixes
    assert w.cache.host_hit_tokens == w.host_hits >= hits[1]


def test_evicted_prefix_comes_back_from_host_memory() -> None:
    w = World(1, device_pages=40, host_pages=100, policy="write_through")
    a = list(range(1, 31))
    assert w.serve(a) == (0, 0)
    stats = w.cache.host_stats()
    assert stats["hicache_stored_tokens"] == 30  # written through as it was cached
    w.serve([99] * 30)  # needs the device pool: `a` goes to host memory
    m = w.cache.match(a)
    assert len(m.slots) == 0 and m.host_len == 30
    d, h = w.serve(a + [7])
    assert (d, h) == (0, 30)
    assert w.cache.host_stats()["hicache_loaded_tokens"] == 30


def test_without_host_memory_the_prefix_is_forgotten() -> None:
    """The same sequence with write_through_selective: `a` was never reused, so it was not
    backed up, and eviction forgets it (as a plain radix cache would)."""
    w = World(1, device_pages=40, host_pages=100, policy="write_through_selective")
    a = list(range(1, 31))
    w.serve(a)
    assert w.cache.host_stats()["hicache_stored_tokens"] == 0
    w.serve([99] * 30)
    assert w.cache.match(a).host_len == 0


def test_selective_backs_up_on_reuse_and_write_back_on_eviction() -> None:
    w = World(1, device_pages=40, host_pages=100, policy="write_through_selective")
    a = list(range(1, 21))
    w.serve(a)
    w.serve(a)  # reused: now backed up
    assert w.cache.host_stats()["hicache_stored_tokens"] == 20
    w = World(1, device_pages=40, host_pages=100, policy="write_back")
    w.serve(a)
    w.serve(a)
    assert w.cache.host_stats()["hicache_stored_tokens"] == 0
    w.serve([99] * 30)  # evicts `a`: written back then
    assert w.cache.host_stats()["hicache_stored_tokens"] == 20
    assert w.serve(a + [1]) == (0, 20)


def test_insert_over_a_host_node_takes_the_callers_slots() -> None:
    w = World(1, device_pages=64, host_pages=128, policy="write_through")
    cache = w.cache
    a = list(range(1, 17))
    w.serve(a)
    w.run_transfers()
    cache.evict(100)
    assert cache.evictable_size() == 0 and cache.match(a).host_len == 16
    slots = w.allocator.alloc_extend([0], [20], [0])
    held = cache.insert(a + [5, 6, 7, 8], slots)
    assert held == 0  # nothing of it was on the device: the tree owns all 20 slots now
    m = cache.match(a + [5, 6, 7, 8])
    assert m.host_len == 0 and torch.equal(m.slots, slots)
    cache.check_integrity()


def test_host_memory_full_evicts_its_least_recently_used() -> None:
    w = World(1, device_pages=32, host_pages=48, policy="write_through")
    a, b, c = [1] * 20, [2] * 20, [3] * 20
    for key in (a, b, c):
        w.serve(key)
    # the host holds 48 tokens: backing up c forgot a, the least recently used
    assert w.cache.match(a).host_len == 0 and len(w.cache.match(a).slots) == 0
    assert w.cache.match(b).host_len + len(w.cache.match(b).slots) == 20


def test_transfer_queue_merges_only_disjoint_copies_of_one_kind() -> None:
    q = TransferQueue()
    t = torch.tensor
    q.add(STORE, t([1, 2]), t([10, 11]))
    q.add(STORE, t([3]), t([12]))
    q.add(STORE, t([4]), t([10]))  # writes slot 10 again: a new copy, after the first
    q.add(LOAD, t([12]), t([5]))
    ops = q.take()
    assert [(k, s.tolist(), d.tolist()) for k, s, d in ops] == [
        (STORE, [1, 2, 3], [10, 11, 12]),
        (STORE, [4], [10]),
        (LOAD, [12], [5]),
    ]
    assert q.take() is None


def test_host_pool_size() -> None:
    assert host_pool_tokens(1000, 64, 2.0, 0.0, 16) == 2000
    assert host_pool_tokens(1000, 1000, 2.0, 0.01, 16) == 10000  # 10^7 bytes / 1000
    with pytest.raises(ValueError, match="larger than the device KV pool"):
        host_pool_tokens(1000, 64, 1.0, 0.0, 16)


def test_fp8_host_pool_round_trip() -> None:
    kv = KVPool(9, 1, 1, 2, torch.float32, kv_cache_dtype=torch.float8_e4m3fn)
    host = HostKVPool(kv, 9, torch.device("cpu"))
    kv.k_buffer[0][3] = torch.tensor([[0.5, -2.0]]).to(torch.float8_e4m3fn)
    host.apply([(STORE, torch.tensor([3]), torch.tensor([7]))])
    host.apply([(LOAD, torch.tensor([7]), torch.tensor([5]))])
    assert kv.k_buffer[0][5].float().tolist() == [[0.5, -2.0]]
