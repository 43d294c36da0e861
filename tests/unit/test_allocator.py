"""TokenToKVPoolAllocator and ReqToTokenPool: page accounting, partial pages, groups, and the
double frees they must refuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.mem_cache.allocator import DoubleFreeError, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import ReqToTokenPool


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_round_trip_returns_every_page(ps: int) -> None:
    alloc = TokenToKVPoolAllocator(8 * ps, ps)
    out = alloc.alloc_extend([0, 0], [3 * ps, 5 * ps], [-1, -1])
    assert out is not None and out.dtype == torch.int64 and out.numel() == 8 * ps
    assert sorted(out.tolist()) == list(range(ps, 9 * ps))  # every slot but page 0
    assert alloc.available_size() == 0
    assert alloc.alloc_extend([0], [1], [-1]) is None
    alloc.free(out[: 3 * ps])
    alloc.free(out[3 * ps :])
    assert alloc.available_size() == alloc.size


def test_alloc_extend_continues_partial_pages_then_takes_new_ones() -> None:
    alloc = TokenToKVPoolAllocator(16 * 4, 4)
    first = alloc.alloc_extend([0, 0], [5, 2], [-1, -1])
    a, b = first[:5].tolist(), first[5:].tolist()
    assert a[:4] == list(range(a[0], a[0] + 4)) and a[0] % 4 == 0 and a[4] % 4 == 0
    # a: 5 tokens -> grows to 11 (3 slots left in its page, then a new page);
    # b: 2 tokens -> grows to 3 (stays in its page); c: new, 4 tokens (one page).
    assert alloc.num_pages_needed(5, 11) == 1 and alloc.num_pages_needed(2, 3) == 0
    out = alloc.alloc_extend([5, 2, 0], [11, 3, 4], [a[4], b[1], -1]).tolist()
    assert out[:3] == [a[4] + 1, a[4] + 2, a[4] + 3]
    assert out[3] % 4 == 0 and out[3:6] == [out[3], out[3] + 1, out[3] + 2]
    assert out[6] == b[1] + 1
    assert out[7] % 4 == 0 and out[7:11] == list(range(out[7], out[7] + 4))
    assert alloc.available_size() == (16 - 2 - 1 - 1 - 1) * 4


def test_decode_is_alloc_extend_by_one() -> None:
    alloc = TokenToKVPoolAllocator(4 * 4, 4)
    slots = alloc.alloc_extend([0], [3], [-1]).tolist()
    for pos in range(3, 9):
        (slot,) = alloc.alloc_extend([pos], [pos + 1], [slots[-1]]).tolist()
        assert slot % 4 == pos % 4
        assert slot == slots[-1] + 1 or pos % 4 == 0  # a new page only at a page boundary
        slots.append(slot)
    assert alloc.available_size() == 16 - 12


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_alloc_decode_equals_alloc_extend_by_one(ps: int, seed: int) -> None:
    """The decode fast path (last slots given as a tensor, read on the device) hands out the
    same slots, from the same pages, as alloc_extend by one token, step after step, over
    requests at and off page boundaries; and refuses, changing nothing, when short."""
    import random

    rng = random.Random(seed)
    fast, slow = TokenToKVPoolAllocator(80 * ps, ps), TokenToKVPoolAllocator(80 * ps, ps)
    lens = [rng.randint(1, 3 * ps) for _ in range(6)]
    first = fast.alloc_extend([0] * 6, lens, [-1] * 6)
    assert torch.equal(first, slow.alloc_extend([0] * 6, lens, [-1] * 6))
    ends = torch.cumsum(torch.tensor(lens), 0) - 1
    last = first[ends].tolist()  # each request's last slot
    for _ in range(2 * ps + 3):
        locs = None if ps == 1 else torch.tensor(last, dtype=torch.int64)
        got = fast.alloc_decode(lens, locs)
        want = slow.alloc_extend(lens, [n + 1 for n in lens], last if ps > 1 else [-1] * 6)
        assert got is not None and torch.equal(got, want)
        assert fast.available_size() == slow.available_size()
        last, lens = got.tolist(), [n + 1 for n in lens]
    before = fast.available_size()
    short = TokenToKVPoolAllocator(2 * ps, ps)
    short.alloc_extend([0, 0], [ps, ps], [-1, -1])  # both pages taken, both full
    full = torch.tensor([ps - 1, 2 * ps - 1]) if ps > 1 else None
    assert short.alloc_decode([ps, ps], full) is None and short.available_size() == 0
    assert fast.available_size() == before


def test_short_allocation_changes_nothing() -> None:
    alloc = TokenToKVPoolAllocator(4 * 4, 4)
    last = int(alloc.alloc_extend([0], [10], [-1])[-1])  # 3 pages, 2 slots left in the last
    before = alloc.available_size()
    assert alloc.alloc_extend([10, 0], [12, 5], [last, -1]) is None  # needs 2 pages, has 1
    with pytest.raises(ValueError):
        alloc.alloc_extend([10], [11], [last + 1])  # not the slot of position 9
    assert alloc.available_size() == before
    again = TokenToKVPoolAllocator(4 * 4, 4)
    again.alloc_extend([0], [10], [-1])
    assert torch.equal(alloc.alloc_extend([0], [4], [-1]), again.alloc_extend([0], [4], [-1]))


@pytest.mark.parametrize("ps", [1, 4])
def test_double_free_is_detected(ps: int) -> None:
    alloc = TokenToKVPoolAllocator(8 * ps, ps)
    out = alloc.alloc_extend([0], [2 * ps], [-1])
    alloc.free(out)
    with pytest.raises(DoubleFreeError):
        alloc.free(out[:1])
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.tensor([0]))  # the padding page
    out = alloc.alloc_extend([0], [ps], [-1])
    if ps == 1:
        with pytest.raises(DoubleFreeError):
            alloc.free(torch.cat([out, out]))
    alloc.free(out)
    assert alloc.available_size() == alloc.size


def test_group_free_applies_at_end_and_catches_repeats() -> None:
    alloc = TokenToKVPoolAllocator(8 * 2, 2)
    out = alloc.alloc_extend([0, 0], [8, 8], [-1, -1])
    alloc.free_group_begin()
    alloc.free(out[:4])
    assert alloc.available_size() == 0  # collected, not applied yet
    with pytest.raises(DoubleFreeError):
        alloc.free(out[2:3])  # pending already
    alloc.free(out[4:])
    alloc.free_group_end()
    assert alloc.available_size() == alloc.size


def test_page_size_one_is_vectorised() -> None:
    alloc = TokenToKVPoolAllocator(200_000, 1)
    out = alloc.alloc_extend([0] * 4, [50_000] * 4, [-1] * 4)
    assert out.numel() == 200_000 and torch.unique(out).numel() == 200_000
    alloc.free(out)
    assert alloc.available_size() == alloc.size


@settings(max_examples=80, deadline=None)
@given(
    ps=st.sampled_from([1, 4, 16]),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=30),
)
def test_requests_grow_and_free_without_leaks(ps: int, steps: list[tuple[int, int]]) -> None:
    alloc = TokenToKVPoolAllocator(12 * ps, ps)
    reqs: list[list[int]] = [[] for _ in range(4)]
    for i, n in steps:
        slots = reqs[i]
        if n == 0:  # finish: free the whole request
            alloc.free(torch.tensor(slots, dtype=torch.int64))
            slots.clear()
            continue
        short = alloc.num_pages_needed(len(slots), len(slots) + n) * ps > alloc.available_size()
        out = alloc.alloc_extend([len(slots)], [len(slots) + n], [slots[-1] if slots else -1])
        assert (out is None) == short
        if out is not None:
            slots.extend(out.tolist())
        assert all(s % ps == pos % ps for pos, s in enumerate(slots))
        everything = [s for r in reqs for s in r]
        assert len(set(everything)) == len(everything) and min(everything, default=ps) >= ps
        held = sum(-(-len(r) // ps) for r in reqs)
        assert alloc.available_size() == alloc.size - held * ps
    for slots in reqs:
        alloc.free(torch.tensor(slots, dtype=torch.int64))
    assert alloc.available_size() == alloc.size


def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(3, 16)
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(2)
    assert rows is not None and len(set(rows)) == 2
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free(rows[0])
    with pytest.raises(RuntimeError):
        pool.free([rows[0]])
    pool.free([rows[1]])
    assert pool.available_size() == 3
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == 3


@pytest.mark.parametrize("ps", [4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_alloc_extend_takes_last_slots_as_a_device_tensor(ps: int, seed: int) -> None:
    """Last slots given as a tensor (read where they are) or as a list: the same slots from
    the same pages, over requests continuing partial pages, starting fresh or adding nothing;
    entries of requests at a page boundary are ignored, and None does when all are."""
    import random

    rng = random.Random(seed)
    a, b = TokenToKVPoolAllocator(64 * ps, ps), TokenToKVPoolAllocator(64 * ps, ps)
    lens = [rng.randint(0, 3 * ps) for _ in range(5)]
    first = a.alloc_extend([0] * 5, lens, None)
    assert torch.equal(first, b.alloc_extend([0] * 5, lens, [-1] * 5))
    ends = torch.cumsum(torch.tensor(lens), 0) - 1
    last = [first[e].item() if n else -1 for e, n in zip(ends.tolist(), lens)]
    for _ in range(3):
        grow = [rng.choice([0, 1, rng.randint(1, 2 * ps)]) for _ in lens]
        seq = [n + g for n, g in zip(lens, grow)]
        junk = [s if n % ps else 10**6 for s, n in zip(last, lens)]  # (ignored where aligned)
        got = a.alloc_extend(lens, seq, torch.tensor(junk, dtype=torch.int64))
        want = b.alloc_extend(lens, seq, last)
        assert got is not None and torch.equal(got, want)
        assert a.available_size() == b.available_size()
        out = got.tolist()
        offsets = torch.cumsum(torch.tensor([0] + grow), 0).tolist()
        last = [out[offsets[i + 1] - 1] if grow[i] else last[i] for i in range(len(lens))]
        assert all(s % ps == (n - 1) % ps for s, n in zip(last, seq) if n)
        lens = seq


def test_deferred_checks_raise_at_verify() -> None:
    """With checks deferred (as on CUDA, where reading them waits for the device), a double
    free and a last slot outside its page are flagged on the device and raised by `verify`
    (or after CHECK_EVERY checks), not at the call."""
    from engine.mem_cache import allocator as mod

    alloc = TokenToKVPoolAllocator(8 * 4, 4, defer_checks=True)
    out = alloc.alloc_extend([0], [8], None)
    alloc.free_runs([out])
    alloc.verify()  # all fine so far
    with pytest.raises(DoubleFreeError, match="more pages"):  # (counted on the host)
        alloc.free_runs([out[4:]])
    with pytest.raises(DoubleFreeError, match="deferred"):  # (and flagged on the device)
        alloc.verify()
    alloc.verify()  # the flag was cleared
    alloc.clear()
    out = alloc.alloc_extend([0], [8], None)
    alloc.free_runs([out[:4]])
    alloc.free_runs([out[:4]])  # page already free, and others still held: flagged only
    with pytest.raises(DoubleFreeError, match="deferred"):
        alloc.verify()
    alloc.clear()
    last = int(alloc.alloc_extend([0], [6], None)[-1])
    alloc.alloc_extend([6], [7], torch.tensor([last + 1]))  # not the slot of position 5
    with pytest.raises(ValueError, match="last_loc"):
        alloc.verify()
    alloc.clear()
    pages = alloc.alloc_extend([0], [4], None)
    alloc.free_runs([pages])
    with pytest.raises(DoubleFreeError):
        for _ in range(mod.CHECK_EVERY):
            alloc.free_runs([pages])


@pytest.mark.parametrize("ps", [1, 4])
def test_free_runs_frees_what_free_does(ps: int) -> None:
    """Runs from a page boundary (whole pages, then a partial one): the pages `free` finds
    with `unique`, found as every page_size-th slot; a page not held is refused at once
    without deferred checks, and page 0 always."""
    a, b = TokenToKVPoolAllocator(16 * ps, ps), TokenToKVPoolAllocator(16 * ps, ps)
    runs = [a.alloc_extend([0], [n], None) for n in (2 * ps, ps + 1, 1)]
    for n in (2 * ps, ps + 1, 1):
        b.alloc_extend([0], [n], None)
    a.free_runs([runs[0], runs[1]])
    b.free(torch.cat([runs[0], runs[1]]))
    assert a.available_size() == b.available_size()
    assert torch.equal(a.is_allocated(runs[2]), torch.tensor([True]))
    assert not a.is_allocated(runs[0]).any() and not a.is_allocated(runs[1]).any()
    with pytest.raises(DoubleFreeError):
        a.free_runs([runs[1]])
    with pytest.raises(DoubleFreeError):
        a.free_runs([torch.tensor([0])])  # the padding page
    with pytest.raises(DoubleFreeError):
        a.free_runs([torch.tensor([17 * ps])])  # beyond the pool
    if ps > 1:
        two = a.alloc_extend([0], [2], None)
        with pytest.raises(DoubleFreeError):
            a.free_runs([two[1:]])  # not from a page boundary
        a.free_runs([two])
    a.free_runs([runs[2]])
    assert a.available_size() == a.size
