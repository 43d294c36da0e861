"""RadixCache and NoRadixCache: targeted cases, then a stateful property test that runs
requests (start, compute, finish, retract), evictions and matches against `ReferenceCache`,
checking integrity and slot ownership after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.base import TreeNode
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.no_cache import NoRadixCache
from engine.mem_cache.radix_cache import RadixCache
from tests.unit.cache_reference import ReferenceCache


@dataclass
class FakeReq:
    """The fields of the scheduler's Req that the cache protocol uses, plus the test's plan."""

    req_pool_idx: int
    ids: list[int]  # every token the request will have
    fill_ids: list[int] = field(default_factory=list)
    kv_allocated_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    swa_released: int = 0  # hybrid window memory: own window KV freed up to here


def make(page_size: int, num_pages: int = 64, rows: int = 4, cls: type = RadixCache):
    pool = ReqToTokenPool(rows, 64)
    alloc = TokenToKVPoolAllocator(num_pages * page_size, page_size)
    return pool, alloc, cls(pool, alloc, page_size)


def insert_new(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Allocate slots for key and insert them; frees the duplicates as a caller must."""
    slots = cache.allocator.alloc_extend([0], [len(key)], [-1])
    assert slots is not None
    cache.allocator.free(slots[: cache.insert(key, slots)])
    return slots


# -- targeted cases ----------------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 4])
def test_match_splits_node_at_page_boundary(ps: int) -> None:
    _, alloc, cache = make(ps)
    key = list(range(4 * ps))
    slots = insert_new(cache, key)
    query = key[: 3 * ps - 1] + [99] * ps  # diverges at the last token of the third page
    got, node = cache.match_prefix(query)
    assert got.tolist() == slots[: 2 * ps].tolist()
    assert node.key == key[: 2 * ps] and len(node.children) == 1
    (rest,) = node.children.values()
    assert rest.key == key[2 * ps :] and rest.value.tolist() == slots[2 * ps :].tolist()
    assert cache.total_size() == 4 * ps
    cache.check_integrity()


def test_insert_reports_cached_prefix_and_keeps_tree_slots() -> None:
    _, alloc, cache = make(4)
    first = insert_new(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    free_before = alloc.available_size()
    second = alloc.alloc_extend([0], [12], [-1])
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], second) == 8
    alloc.free(second[:8])
    got, _ = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
    assert got.tolist() == first.tolist() + second[8:].tolist()
    assert alloc.available_size() == free_before - 4
    cache.check_integrity()


def test_evict_takes_least_recently_used_leaf_first() -> None:
    _, alloc, cache = make(1)
    a, b, c = [1, 2, 3], [1, 2, 4], [5, 6]
    for key in (a, b, c):
        insert_new(cache, key)
    cache.match_prefix(a)  # a is now the most recent; b is the oldest leaf
    assert cache.evict(1) == 1
    assert len(cache.match_prefix(b)[0]) == 2 and len(cache.match_prefix(a)[0]) == 3
    assert cache.evict(1) == 2  # c ([5, 6]) is now the oldest
    assert len(cache.match_prefix(c)[0]) == 0
    cache.check_integrity()
    assert cache.evict(100) == 3  # leaf [3], then its parent [1, 2] once it became a leaf
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_locked_path_is_never_evicted_and_sizes_are_exact() -> None:
    _, alloc, cache = make(2)
    insert_new(cache, [1, 1, 2, 2, 3, 3])
    insert_new(cache, [1, 1, 2, 2, 4, 4])
    _, node = cache.match_prefix([1, 1, 2, 2, 3, 3])
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (6, 2)
    assert cache.evict(100) == 2  # only [4, 4]
    assert (cache.protected_size(), cache.evictable_size()) == (6, 0)
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 6)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    cache.check_integrity()
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_lock_on_evicted_node_is_refused() -> None:
    _, _, cache = make(1)
    insert_new(cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    cache.evict(2)
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(node)


def test_check_integrity_catches_corruption() -> None:
    _, _, cache = make(1)
    insert_new(cache, [1, 2, 3])
    insert_new(cache, [1, 2, 4])
    cache._evictable += 1
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache._evictable -= 1
    leaf = cache.match_prefix([1, 2, 3])[1]
    leaf.value = cache.match_prefix([1, 2, 4])[1].value  # two nodes own one slot
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_finished_request_frees_tail_and_extra_slot() -> None:
    pool, alloc, cache = make(4)
    req = FakeReq(pool.alloc(1)[0], ids=list(range(7)))
    slots = alloc.alloc_extend([0], [8], [-1])  # 7 tokens + one overlap slot: 2 pages
    pool.req_to_token[req.req_pool_idx, :8] = slots.to(torch.int32)
    req.fill_ids, req.kv_allocated_len = req.ids, 8
    cache.cache_finished_req(req)
    assert cache.total_size() == 4 and alloc.available_size() == alloc.size - 4
    assert pool.available_size() == pool.size
    cache.check_integrity()


def test_no_radix_cache_shares_nothing() -> None:
    pool, alloc, cache = make(4, cls=NoRadixCache)
    req = FakeReq(pool.alloc(1)[0], ids=list(range(6)))
    assert cache.match_prefix(req.ids)[0].numel() == 0
    slots = alloc.alloc_extend([0], [6], [-1])
    pool.req_to_token[req.req_pool_idx, :6] = slots.to(torch.int32)
    req.fill_ids, req.kv_allocated_len = req.ids, 6
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.numel() == 0 and cache.evict(10) == 0
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size - 8
    cache.cache_finished_req(req)
    assert alloc.available_size() == alloc.size and pool.available_size() == pool.size


# -- stateful property test --------------------------------------------------------------------
def token_ids(ps: int) -> st.SearchStrategy[list[int]]:
    """Sequences of two pages that differ only in their last token, so prompts often share
    prefixes and matches end inside a page; cut to any length so tails are unaligned."""
    pages = [[0] * ps, [0] * (ps - 1) + [1]]
    page_lists = st.lists(st.sampled_from(pages), min_size=1, max_size=10)
    seqs = page_lists.map(lambda ps_: [t for page in ps_ for t in page])
    return seqs.flatmap(lambda s: st.integers(1, len(s)).map(lambda n: s[:n]))


class CacheMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    NUM_PAGES = 8  # small, so allocations fail and force evictions
    CACHE: type = RadixCache
    ROWS = 3

    def __init__(self) -> None:
        super().__init__()
        made = make(self.PAGE_SIZE, self.NUM_PAGES, self.ROWS, self.CACHE)
        self.pool, self.alloc, self.cache = made
        self.shares = self.CACHE is RadixCache
        self.ref = ReferenceCache(self.PAGE_SIZE)
        self.running: list[FakeReq] = []

    def row(self, req: FakeReq) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx].to(torch.int64)

    def aligned(self, n: int) -> int:
        return n - n % self.PAGE_SIZE

    def evict(self, num_tokens: int) -> int:
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(num_tokens)
        assert self.ref.drop_freed(self.alloc) == freed
        assert freed >= min(num_tokens, evictable)
        assert self.ref.is_prefix_closed()
        return freed

    def share(self, req: FakeReq) -> None:
        """What the cache must do with req's fill_ids, applied to the reference."""
        if self.shares:
            n = self.aligned(len(req.fill_ids))
            self.ref.add(req.fill_ids[:n], self.row(req)[:n].tolist())

    @precondition(lambda self: self.pool.available_size() > 0)
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        ids = data.draw(token_ids(self.PAGE_SIZE))
        req = FakeReq(self.pool.alloc(1)[0], ids)
        slots, node = self.cache.match_prefix(ids[:-1])  # one token is always computed
        assert slots.tolist() == self.ref.longest(ids[:-1])
        self.cache.inc_lock_ref(node)
        self.pool.req_to_token[req.req_pool_idx, : len(slots)] = slots.to(torch.int32)
        req.prefix_indices, req.last_node = slots, node
        req.fill_ids, req.kv_allocated_len = ids[: len(slots)], len(slots)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2), n=st.integers(1, 16), cache_it=st.booleans())
    def compute(self, i: int, n: int, cache_it: bool) -> None:
        req = self.running[i % len(self.running)]
        start = req.kv_allocated_len
        end = min(start + n, len(req.ids))
        if end > start:
            last_loc = [int(self.row(req)[start - 1]) if start else -1]
            out = self.alloc.alloc_extend([start], [end], last_loc)
            if out is None:
                pages = self.alloc.num_pages_needed(start, end)
                self.evict(pages * self.PAGE_SIZE - self.alloc.available_size())
                out = self.alloc.alloc_extend([start], [end], last_loc)
            if out is None:
                return
            assert (out % self.PAGE_SIZE == torch.arange(start, end) % self.PAGE_SIZE).all()
            self.pool.req_to_token[req.req_pool_idx, start:end] = out.to(torch.int32)
            req.fill_ids, req.kv_allocated_len = req.ids[:end], end
        if cache_it:
            self.share(req)
            self.cache.cache_unfinished_req(req)
            n_shared = self.aligned(end) if self.shares else 0
            assert req.prefix_indices.tolist() == self.ref.longest(req.fill_ids)[:n_shared]
            assert len(req.prefix_indices) == n_shared

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2), extra_slot=st.booleans(), insert=st.booleans())
    def finish(self, i: int, extra_slot: bool, insert: bool) -> None:
        req = self.running.pop(i % len(self.running))
        n = req.kv_allocated_len
        if extra_slot:  # the overlap scheduler allocated a slot for a token never computed
            out = self.alloc.alloc_extend([n], [n + 1], [int(self.row(req)[n - 1]) if n else -1])
            if out is not None:
                self.pool.req_to_token[req.req_pool_idx, n] = int(out[0])
                req.kv_allocated_len = n + 1
        if insert:
            self.share(req)
        self.cache.cache_finished_req(req, insert=insert)

    @rule(n=st.integers(0, 40))
    def evict_some(self, n: int) -> None:
        if n < 40:
            self.evict(n)
            return
        self.cache.reset()  # frees everything unlocked
        self.ref.drop_freed(self.alloc)
        assert self.cache.evictable_size() == 0

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        key = data.draw(token_ids(self.PAGE_SIZE))
        assert self.cache.match_prefix(key)[0].tolist() == self.ref.longest(key)

    @invariant()
    def integrity_and_ownership(self) -> None:
        self.cache.check_integrity()
        tree = self.ref.page_slots()
        owned = [tree]
        for req in self.running:
            shared = len(req.prefix_indices)
            assert self.row(req)[:shared].tolist() == req.prefix_indices.tolist()
            assert set(req.prefix_indices.tolist()) <= tree
            owned.append(set(self.row(req)[shared : req.kv_allocated_len].tolist()))
        ps = self.PAGE_SIZE
        pages = [{s // ps for s in group} for group in owned]
        assert sum(map(len, pages)) == len(set().union(*pages)), "a page has two owners"
        all_slots = torch.arange(ps, self.alloc.size + ps)
        allocated = set((all_slots[self.alloc.is_allocated(all_slots)] // ps).tolist())
        assert allocated == set().union(*pages), "leaked or unowned pages"
        assert self.cache.total_size() == self.ref.num_tokens()
        locked_keys = [r.ids[: len(r.prefix_indices)] for r in self.running]
        assert self.cache.protected_size() == self.ref.num_tokens_under(locked_keys)

    def teardown(self) -> None:
        while self.running:
            self.cache.cache_finished_req(self.running.pop())
        self.cache.reset()
        self.cache.check_integrity()
        assert self.cache.total_size() == 0
        assert self.alloc.available_size() == self.alloc.size
        assert self.pool.available_size() == self.pool.size


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@_SETTINGS
class RadixPage1(CacheMachine):
    PAGE_SIZE = 1


@_SETTINGS
class RadixPage4(CacheMachine):
    PAGE_SIZE = 4
    NUM_PAGES = 6


@_SETTINGS
class NoCachePage4(CacheMachine):
    PAGE_SIZE = 4
    NUM_PAGES = 6
    CACHE = NoRadixCache


TestRadixPage1 = RadixPage1.TestCase
TestRadixPage4 = RadixPage4.TestCase
TestNoCachePage4 = NoCachePage4.TestCase
