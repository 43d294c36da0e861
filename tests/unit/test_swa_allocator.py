"""SWATokenToKVPoolAllocator: every full page gets a window page, freeing either kind, moving
window pages between full pages, and refusing what the pools cannot give."""

from __future__ import annotations

import pytest
import torch

from engine.mem_cache.allocator import DoubleFreeError
from engine.mem_cache.swa_allocator import SWATokenToKVPoolAllocator


def swa_slots(alloc: SWATokenToKVPoolAllocator, slots: torch.Tensor) -> torch.Tensor:
    return alloc.full_to_swa.index_select(0, slots)


@pytest.mark.parametrize("ps", [1, 4])
def test_each_full_page_maps_to_its_own_window_page(ps: int) -> None:
    alloc = SWATokenToKVPoolAllocator(8 * ps, 4 * ps, ps)
    out = alloc.alloc_extend([0, 0], [2 * ps, ps + 1], [-1, -1])
    assert out is not None
    swa = swa_slots(alloc, out)
    assert bool((swa > 0).all()) and torch.unique(swa).numel() == swa.numel()
    assert bool((swa % ps == out % ps).all()), "slots keep their offset within the page"
    assert alloc.available_size() == 4 * ps and alloc.swa_available_size() == 0
    alloc.check_mapping()
    alloc.free(out)
    assert alloc.available_size() == alloc.size and alloc.swa_available_size() == alloc.swa_size
    assert int(alloc.full_to_swa.abs().sum()) == 0
    alloc.check_mapping()


def test_the_smaller_pool_limits_allocation_and_nothing_is_taken() -> None:
    alloc = SWATokenToKVPoolAllocator(16, 4, 1)
    assert alloc.alloc_extend([0], [5], [-1]) is None
    assert alloc.available_size() == 16 and alloc.swa_available_size() == 4
    first = alloc.alloc_extend([0], [4], [-1])
    assert alloc.free_swa(first[:3]) == 3  # the full slots stay, their window KV goes
    assert alloc.available_size() == 12 and alloc.swa_available_size() == 3
    assert alloc.has_swa(first).tolist() == [False, False, False, True]
    more = alloc.alloc_extend([4], [7], [int(first[-1])])
    assert more is not None and bool((swa_slots(alloc, more) > 0).all())
    assert alloc.free_swa(first[:3]) == 0  # freeing again frees nothing
    alloc.check_mapping()
    alloc.free(torch.cat([first, more]))
    alloc.check_mapping()
    assert alloc.swa_available_size() == 4


@pytest.mark.parametrize("ps", [1, 4])
def test_move_gives_window_pages_page_for_page(ps: int) -> None:
    alloc = SWATokenToKVPoolAllocator(8 * ps, 8 * ps, ps)
    tree = alloc.alloc_extend([0], [3 * ps], [-1])
    mine = alloc.alloc_extend([0], [3 * ps], [-1])
    alloc.free_swa_runs([tree[: 2 * ps]])  # the tree lost the window KV of its first two pages
    alloc.free_swa_runs([mine[:ps]])  # and the request that of its first
    before = swa_slots(alloc, mine).clone()
    # page 2 only: page 1 of mine has none, page 3 of the tree has one
    assert alloc.move_swa_runs([mine[ps : 2 * ps]], [tree[ps : 2 * ps]]) == ps
    assert alloc.has_swa(tree).tolist() == [False] * ps + [True] * 2 * ps
    assert swa_slots(alloc, tree)[ps : 2 * ps].tolist() == before[ps : 2 * ps].tolist()
    assert not bool(alloc.has_swa(mine[: 2 * ps]).any())
    assert alloc.move_swa_runs([mine[:0]], [tree[:0]]) == 0
    alloc.check_mapping()
    alloc.free(torch.cat([tree, mine]))
    assert alloc.swa_available_size() == alloc.swa_size
    alloc.check_mapping()


@pytest.mark.parametrize("defer", [False, True])
def test_move_refuses_pages_not_as_the_owners_say(defer: bool) -> None:
    alloc = SWATokenToKVPoolAllocator(8, 8, 1, defer_checks=defer)
    tree = alloc.alloc_extend([0], [2], [-1])
    mine = alloc.alloc_extend([0], [2], [-1])
    with pytest.raises(ValueError, match="differ in length"):
        alloc.move_swa_runs([mine], [tree[:1]])
    try:  # the target page has a window page already
        alloc.move_swa_runs([mine[:1]], [tree[:1]])
        alloc.verify()
    except DoubleFreeError as exc:
        assert "owner" in str(exc)
    else:
        raise AssertionError("not refused")


@pytest.mark.parametrize("ps", [1, 4])
def test_free_runs_with_the_owners_account_frees_what_a_lookup_frees(ps: int) -> None:
    """`free_runs` told where each run's window pages start frees the same pages, full and
    window, as the read of the device does without it."""
    told, looked = (SWATokenToKVPoolAllocator(16 * ps, 16 * ps, ps) for _ in range(2))
    for alloc in (told, looked):
        out = alloc.alloc_extend([0, 0], [5 * ps, 3 * ps + 1], [-1, -1])
        alloc.free_swa_runs([out[: 2 * ps], out[5 * ps : 6 * ps]])
    runs = [out[: 4 * ps], out[5 * ps : 8 * ps + 1], out[4 * ps : 5 * ps]]
    told.free_runs(runs, [2 * ps, ps, 0])
    looked.free_runs(runs)
    for alloc in (told, looked):
        assert alloc.available_size() == alloc.size
        assert alloc.swa_available_size() == alloc.swa_size
        alloc.check_mapping()
    assert torch.equal(told.full_to_swa, looked.full_to_swa)


@pytest.mark.parametrize("defer", [False, True])
def test_free_runs_with_a_wrong_account_is_caught(defer: bool) -> None:
    alloc = SWATokenToKVPoolAllocator(8, 8, 1, defer_checks=defer)
    out = alloc.alloc_extend([0], [4], [-1])
    alloc.free_swa_runs([out[:2]])
    with pytest.raises(DoubleFreeError):  # says position 1 has a window page: it has none
        alloc.free_runs([out[:2]], [1])
        alloc.verify()
    alloc = SWATokenToKVPoolAllocator(8, 8, 1, defer_checks=defer)
    out = alloc.alloc_extend([0], [4], [-1])
    alloc.free_runs([out], [2])  # says 0..1 have none: they do, and leak
    alloc.verify()
    with pytest.raises(AssertionError, match="leaked"):
        alloc.check_mapping()


def test_window_operations_refuse_free_pages() -> None:
    alloc = SWATokenToKVPoolAllocator(8, 8, 1)
    out = alloc.alloc_extend([0], [2], [-1])
    alloc.free(out)
    with pytest.raises(DoubleFreeError):
        alloc.free_swa(out)


def test_check_mapping_catches_a_leaked_window_page() -> None:
    alloc = SWATokenToKVPoolAllocator(8, 8, 1)
    out = alloc.alloc_extend([0], [2], [-1])
    alloc._swa_page[int(out[0])] = 0  # forget a window page without freeing it
    alloc.full_to_swa[int(out[0])] = 0
    with pytest.raises(AssertionError, match="leaked"):
        alloc.check_mapping()


def test_deferred_checks_of_the_window_pool_are_raised_by_verify() -> None:
    """With checks deferred (as on CUDA) a bad free of a window page is flagged on the device
    by the window pool, and the hybrid allocator's `verify` (what the scheduler calls when
    idle) raises it."""
    alloc = SWATokenToKVPoolAllocator(8, 8, 1, defer_checks=True)
    assert alloc.swa.defer_checks
    out = alloc.alloc_extend([0], [2], [-1])
    window_page = alloc._swa_page[out[:1]].clone()
    alloc.swa.free(window_page)  # freed behind the hybrid allocator's back
    alloc.free_swa(out[:1])  # frees it again: flagged, not raised
    with pytest.raises(DoubleFreeError):
        alloc.verify()
    alloc.verify()  # (reported once)


@pytest.mark.parametrize("ps", [1, 4])
def test_free_swa_runs_frees_what_free_swa_frees(ps: int) -> None:
    """A request's window runs (page-aligned, every page holding a swa page) free the same
    swa pages as `free_swa` of the same slots, and count them on the host."""
    runs_alloc, slots_alloc = (SWATokenToKVPoolAllocator(16 * ps, 12 * ps, ps) for _ in range(2))
    outs = [a.alloc_extend([0, 0], [5 * ps, 3 * ps + 1], [-1, -1]) for a in (runs_alloc,
                                                                          slots_alloc)]
    assert torch.equal(*outs)
    out = outs[0]
    runs = [out[ps : 3 * ps], out[5 * ps : 7 * ps]]  # two requests' windows
    assert runs_alloc.free_swa_runs(runs) == 4 * ps
    assert slots_alloc.free_swa(torch.cat(runs)) == 4 * ps
    assert torch.equal(runs_alloc.full_to_swa, slots_alloc.full_to_swa)
    assert runs_alloc.swa_available_size() == slots_alloc.swa_available_size() == 7 * ps
    assert runs_alloc.available_size() == 16 * ps - 9 * ps  # the full pages stay
    runs_alloc.check_mapping()
    assert runs_alloc.free_swa_runs([out[:0]]) == 0


def test_free_swa_runs_refuses_pages_without_swa_and_misaligned_runs() -> None:
    alloc = SWATokenToKVPoolAllocator(16, 16, 4)
    out = alloc.alloc_extend([0], [12], [-1])
    alloc.free_swa_runs([out[:4]])
    with pytest.raises(DoubleFreeError):  # freed already: its page has no swa page
        alloc.free_swa_runs([out[:4]])
    with pytest.raises(DoubleFreeError):
        alloc.free_swa_runs([out[6:10]])  # does not start at a page boundary
    deferred = SWATokenToKVPoolAllocator(16, 16, 4, defer_checks=True)
    out = deferred.alloc_extend([0], [8], [-1])
    deferred.free_swa_runs([out[:4]])
    deferred.free_swa_runs([out[:4]])  # flagged, not raised
    with pytest.raises(DoubleFreeError):
        deferred.verify()
