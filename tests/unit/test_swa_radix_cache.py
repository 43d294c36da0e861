"""SWARadixCache: matches cut to a live window, window locks across splits, tombstones and
revivals; then a stateful property test in which requests run, free the window KV they no
longer read (their own tokens', and their lock on the prefix's), and the cache tombstones and
evicts, checking after every step that no running request has lost a key its next query
reads."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from engine.mem_cache.swa_radix_cache import SWARadixCache
from tests.unit.cache_reference import ReferenceCache
from tests.unit.test_radix_cache import _SETTINGS, FakeReq, token_ids


def make(ps: int, window: int, num_pages: int = 64, swa_pages: int = 64, rows: int = 4):
    pool = ReqToTokenPool(rows, 64)
    alloc = SWATokenToKVPoolAllocator(num_pages * ps, swa_pages * ps, ps)
    return pool, alloc, SWARadixCache(pool, alloc, ps, window)


def insert_new(cache: SWARadixCache, key: list[int]) -> torch.Tensor:
    slots = cache.allocator.alloc_extend([0], [len(key)], [-1])
    assert slots is not None
    cache.allocator.free(slots[: cache.insert(key, slots)])
    return slots


def test_match_stops_where_the_window_of_the_next_token_has_lost_its_kv() -> None:
    _, alloc, cache = make(1, window=4)
    key = list(range(10, 22))
    slots = insert_new(cache, key)
    for n in (5, 6, 10, 11):  # nodes 0..4, 5, 6..9, 10, 11
        cache.match_prefix(key[:n] + [99])
    nodes = {sum(len(m.key) for m in cache._path(n)) - len(n.key): n for n in cache._nodes()}
    cache._tombstone(nodes[5])  # position 5: outside the window of position 12
    got, node = cache.match_prefix(key)
    assert got.tolist() == slots.tolist()
    cache._tombstone(nodes[10])  # position 10: the next token (12) reads 9..11
    got, node = cache.match_prefix(key + [99])
    assert got.tolist() == slots[:10].tolist()  # 10 reads 7..9: live
    assert node.key == key[6:10] and sum(len(n.key) for n in cache._path(node)) == 10
    assert alloc.has_swa(slots).tolist() == [True] * 5 + [False] + [True] * 4 + [False, True]
    cache.check_integrity()


def test_an_insert_takes_the_callers_account_of_its_window_pages() -> None:
    """A request's slots before its `swa_released` have no swa pages: the new node says so
    (its live pages are a suffix), and where the tree already holds the tokens, the request's
    live pages go to the tree's dead ones and its others are freed."""
    ps = 2
    _, alloc, cache = make(ps, window=5)
    key = list(range(10, 26))  # 8 pages
    mine = alloc.alloc_extend([0], [16], [-1])
    alloc.free_swa_runs([mine[:6]])  # released up to 6
    assert cache.insert(key, mine, live_from=6) == 0
    (node,) = cache._nodes()
    assert node.swa_live == 10 and cache.swa_evictable_size() == 10
    cache.check_integrity()
    other = alloc.alloc_extend([0], [16], [-1])
    alloc.free_swa_runs([other[:10]])  # released up to 10; the tree has 10..15: freed
    free_before = alloc.swa_available_size()
    assert cache.insert(key, other, live_from=10) == 16
    assert node.swa_live == 10 and alloc.swa_available_size() == free_before + 6  # 10..15
    assert not bool(alloc.has_swa(other).any())
    alloc.free(other)
    third = alloc.alloc_extend([0], [16], [-1])
    alloc.free_swa_runs([third[:2]])
    assert cache.insert(key, third, live_from=2) == 16  # revives 2..5 of the tree's
    assert node.swa_live == 14 and cache.swa_evictable_size() == 14
    assert alloc.has_swa(cache.match_prefix(key)[0]).tolist() == [False] * 2 + [True] * 14
    alloc.free(third)
    cache.check_integrity()


def test_window_lock_survives_splits_and_protects_only_the_window() -> None:
    _, alloc, cache = make(2, window=5)
    key = list(range(10, 22))  # 12 tokens, 6 pages
    slots = insert_new(cache, key)
    _, node = cache.match_prefix(key)
    cache.inc_lock_ref(node)  # window of position 12: 8..11 (page aligned start 8)
    assert [len(n.key) for n in cache._path(node)] == [4, 8]
    assert cache.swa_evictable_size() == 8
    cache.match_prefix(key[:6] + [0, 0])  # splits the unlocked upper node at 6
    cache.match_prefix(key[:10] + [0, 0])  # and the locked lower one at 10
    assert cache.evict_swa(100) == 8
    assert alloc.has_swa(slots).tolist() == [False] * 8 + [True] * 4
    cache.check_integrity()
    cache.dec_lock_ref(node)
    assert cache.swa_evictable_size() == 4 and cache.protected_size() == 0
    cache.check_integrity()
    assert cache.match_prefix(key)[0].numel() == 12  # 8..11 still live
    assert cache.match_prefix(key[:9] + [0])[0].numel() == 0  # 8 needs 4..7: gone


def test_inserting_live_tokens_revives_a_tombstone() -> None:
    _, alloc, cache = make(1, window=3)
    key = list(range(10, 18))
    tree = insert_new(cache, key)
    assert cache.evict_swa(8) == 8 and cache.match_prefix(key)[0].numel() == 0
    mine = alloc.alloc_extend([0], [8], [-1])
    in_tree = cache.insert(key, mine)
    assert in_tree == 8
    assert alloc.has_swa(tree).all() and not alloc.has_swa(mine).any()
    alloc.free(mine)
    assert cache.match_prefix(key)[0].tolist() == tree.tolist()
    assert cache.swa_evictable_size() == 8
    cache.check_integrity()
    assert cache.evict(8) == 8 and alloc.swa_available_size() == alloc.swa_size


# -- stateful property test --------------------------------------------------------------------
class SWACacheMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1
    WINDOW = 3
    NUM_PAGES = 12
    SWA_PAGES = 6  # small, so window KV runs out and forces tombstones
    ROWS = 3

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.alloc, self.cache = make(
            self.PAGE_SIZE, self.WINDOW, self.NUM_PAGES, self.SWA_PAGES, self.ROWS
        )
        self.ref = ReferenceCache(self.PAGE_SIZE)
        self.running: list[FakeReq] = []

    def row(self, req: FakeReq) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx].to(torch.int64)

    def usable(self, raw: list[int]) -> int:
        """The longest prefix of the cached slots `raw` whose next token's window is live."""
        ps, w = self.PAGE_SIZE, self.WINDOW
        live = self.alloc.has_swa(torch.tensor(raw, dtype=torch.int64)).tolist() if raw else []
        for end in range(len(raw), 0, -ps):
            if all(live[max(0, end - w + 1) : end]):
                return end
        return 0

    def sync_ref(self) -> None:
        self.ref.drop_freed(self.alloc)

    @precondition(lambda self: self.pool.available_size() > 0)
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        ids = data.draw(token_ids(self.PAGE_SIZE))
        raw = self.ref.longest(ids[:-1])
        slots, node = self.cache.match_prefix(ids[:-1])
        assert slots.tolist() == raw[: self.usable(raw)]
        self.cache.inc_lock_ref(node)
        req = FakeReq(self.pool.alloc(1)[0], ids)
        self.pool.req_to_token[req.req_pool_idx, : len(slots)] = slots.to(torch.int32)
        req.prefix_indices, req.last_node = slots, node
        req.fill_ids, req.kv_allocated_len = ids[: len(slots)], len(slots)
        self.running.append(req)

    def release_window(self, req: FakeReq) -> None:
        """What the scheduler frees of a request's own tokens (no batch in flight here)."""
        ps = self.PAGE_SIZE
        end = max(0, req.kv_allocated_len - self.WINDOW + 1)
        if end >= len(req.prefix_indices) > 0:  # its window has left the cached prefix
            self.cache.release_prefix_window(req)
        end -= end % ps
        start = max(len(req.prefix_indices), req.swa_released)
        if end > start:
            self.alloc.free_swa_runs([self.row(req)[start:end]])
            req.swa_released = end

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2), n=st.integers(1, 8), cache_it=st.booleans())
    def compute(self, i: int, n: int, cache_it: bool) -> None:
        req = self.running[i % len(self.running)]
        start = req.kv_allocated_len
        end = min(start + n, len(req.ids))
        self.release_window(req)
        if end > start:
            last_loc = [int(self.row(req)[start - 1]) if start else -1]
            out = self.alloc.alloc_extend([start], [end], last_loc)
            if out is None:
                need = self.alloc.num_pages_needed(start, end) * self.PAGE_SIZE
                self.cache.evict_swa(need - self.alloc.swa_available_size())
                self.cache.evict(need - self.alloc.available_size())
                self.sync_ref()
                out = self.alloc.alloc_extend([start], [end], last_loc)
            if out is None:
                return
            self.pool.req_to_token[req.req_pool_idx, start:end] = out.to(torch.int32)
            req.fill_ids, req.kv_allocated_len = req.ids[:end], end
        if cache_it:
            n = len(req.fill_ids) - len(req.fill_ids) % self.PAGE_SIZE
            self.ref.add(req.fill_ids[:n], self.row(req)[:n].tolist())
            self.cache.cache_unfinished_req(req)
            assert len(req.prefix_indices) == n

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 2), insert=st.booleans())
    def finish(self, i: int, insert: bool) -> None:
        req = self.running.pop(i % len(self.running))
        if insert:
            n = len(req.fill_ids) - len(req.fill_ids) % self.PAGE_SIZE
            self.ref.add(req.fill_ids[:n], self.row(req)[:n].tolist())
        self.cache.cache_finished_req(req, insert=insert)

    @rule(n=st.integers(0, 12), full=st.booleans())
    def evict_some(self, n: int, full: bool) -> None:
        if full:
            self.cache.evict(n)
            self.sync_ref()
        else:
            before = self.cache.swa_evictable_size()
            assert self.cache.evict_swa(n) >= min(n, before)

    @invariant()
    def windows_of_running_requests_are_live(self) -> None:
        self.cache.check_integrity()
        for req in self.running:
            n = req.kv_allocated_len
            window = self.row(req)[max(0, n - self.WINDOW + 1) : n]
            assert bool(self.alloc.has_swa(window).all()), "a running request lost its window"
        assert self.cache.total_size() == self.ref.num_tokens()

    def teardown(self) -> None:
        while self.running:
            self.cache.cache_finished_req(self.running.pop())
        self.cache.reset()
        self.cache.check_integrity()
        assert self.alloc.available_size() == self.alloc.size
        assert self.alloc.swa_available_size() == self.alloc.swa_size


@_SETTINGS
class SWAPage1(SWACacheMachine):
    PAGE_SIZE = 1


@_SETTINGS
class SWAPage2(SWACacheMachine):
    PAGE_SIZE = 2
    WINDOW = 5
    NUM_PAGES = 10
    SWA_PAGES = 6


TestSWAPage1 = SWAPage1.TestCase
TestSWAPage2 = SWAPage2.TestCase


def test_a_released_prefix_window_becomes_evictable_and_is_taken_back_to_unlock() -> None:
    pool, alloc, cache = make(1, window=4)
    key = list(range(10, 22))
    insert_new(cache, key)
    slots, node = cache.match_prefix(key)
    cache.inc_lock_ref(node)
    req = FakeReq(pool.alloc(1)[0], key + [1, 2, 3, 4])
    pool.req_to_token[req.req_pool_idx, :12] = slots.to(torch.int32)
    req.prefix_indices, req.last_node, req.fill_ids, req.kv_allocated_len = slots, node, key, 12
    assert cache.swa_evictable_size() == 9  # positions 9..11 locked
    cache.release_prefix_window(req)
    cache.release_prefix_window(req)  # once only
    assert cache.swa_evictable_size() == 12 and cache.protected_size() == 12
    cache.check_integrity()
    cache.cache_finished_req(req)
    assert cache.swa_evictable_size() == 12 and cache.protected_size() == 0
    cache.check_integrity()
