"""`TokenToKVPoolAllocator`: hands out KV slots a whole page at a time.

Pages: page p is slots p*page_size .. p*page_size + page_size - 1. Page 0 is reserved for
padding writes and is never handed out, so the KV buffers need `size + page_size` slots.

Positions and slots line up inside a page: the slot of position `pos` of a request satisfies
`slot % page_size == pos % page_size`, because a request starts a new page exactly when a
position is a multiple of page_size and otherwise continues the page of its previous token.
So a request's last page is partly used iff its length is not a multiple of page_size, and
pages are never shared between owners (see `engine.mem_cache.base`).

Each page is in one of three states: allocated, free, or pending (freed inside a
`free_group_begin/end` pair, returned at the end); page 0 and an out-of-range page read as
reserved. Freeing a page that is not allocated raises `DoubleFreeError`, the classic bug this
layer exists to catch.

No host reads of the device on the scheduler's per-step path. A read of a CUDA tensor
(`.item()`, `bool()`, `.tolist()`, `torch.unique`'s size) waits for the scheduler's stream:
a round trip of some tens of microseconds of host time each. So:

* the allocation plans are host arithmetic on the length lists (numpy), sent to the device in
  one copy, and a partly filled last page continues from last slots given as a device tensor
  (`alloc_extend`, `alloc_decode`);
* `free_runs` frees runs of slots that start at a page boundary (a request's row from a
  page-aligned position, a radix node's value): their pages are every page_size-th slot's,
  with no `unique`;
* the checks (double frees; a last slot outside the page it should continue) are device ops
  whose outcome is read at once only where that is free (`defer_checks` false: the default
  off CUDA); on CUDA a fault flag collects them and `verify` reads it, every `CHECK_EVERY`
  deferred checks and at each integrity check, raising the same errors late.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from engine.host_tensors import int64_array, int64_tensor

_ALLOCATED, _FREE, _PENDING, _RESERVED = 0, 1, 2, 3
CHECK_EVERY = 64  # deferred checks between two reads of the fault flags (`verify`)
# the fault flags: a free of a page not held, a last slot outside its page, window pages that
# disagree with their owner's account (the hybrid sliding-window allocator)
_BAD_FREE, _BAD_LAST, _BAD_WINDOW = 0, 1, 2


class DoubleFreeError(RuntimeError):
    pass


class TokenToKVPoolAllocator:
    def __init__(
        self,
        size: int,
        page_size: int,
        device: str | torch.device = "cpu",
        defer_checks: bool | None = None,
    ) -> None:
        if page_size < 1 or size <= 0 or size % page_size != 0:
            raise ValueError(f"allocator: size {size} must be a positive multiple of {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = device
        # checks read at once (raising at the faulty call) or collected for `verify`
        self.defer_checks = (
            torch.device(device).type == "cuda" if defer_checks is None else defer_checks
        )
        self.clear()

    def clear(self) -> None:
        # A stack of free pages: _free_pages[:_num_free], the next to hand out on top. Kept in
        # a fixed buffer so alloc and free cost O(pages moved), not O(pool size).
        self._free_pages = torch.arange(
            self.num_pages, 0, -1, dtype=torch.int64, device=self.device
        )
        self._num_free = self.num_pages
        # per page 0 .. num_pages + 1: page 0 (padding) and num_pages + 1 (where out-of-range
        # pages are clamped to) are reserved: never free, never freeable
        self._page_state = torch.full(
            (self.num_pages + 2,), _FREE, dtype=torch.int8, device=self.device
        )
        self._page_state[0] = self._page_state[-1] = _RESERVED
        self._group: list[torch.Tensor] | None = None
        self._faults = torch.zeros(3, dtype=torch.bool, device=self.device)
        self._unverified = 0

    def available_size(self) -> int:
        """Free tokens (free pages * page_size); pending frees are not available yet."""
        return self._num_free * self.page_size

    def num_pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """New pages `alloc_extend` takes to grow a request from prefix_len to seq_len."""
        ps = self.page_size
        return -(-seq_len // ps) - (-(-prefix_len // ps))

    # -- allocation ------------------------------------------------------------------------------
    def alloc_extend(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_locs: list[int] | torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Slots for positions prefix_lens[i] .. seq_lens[i]-1 of each request, concatenated
        (int64). A request whose prefix_len is not page aligned first fills its last page
        (last_locs[i]+1, ...; last_locs[i] is the slot of position prefix_len-1), then takes
        new pages. `last_locs`: a list, or an int64 tensor [B] on this allocator's device
        (read where it is); entries of requests at a page boundary are ignored, and it may be
        None when every prefix_len is (always with page_size 1). Returns None, allocating
        nothing, if there are not enough free pages."""
        if len(prefix_lens) != len(seq_lens):
            raise ValueError("alloc_extend: prefix_lens and seq_lens differ in length")
        if prefix_lens and min(map(operator.sub, seq_lens, prefix_lens)) < 0:  # (per step)
            raise ValueError("alloc_extend: seq_len < prefix_len")
        if self.page_size == 1:
            total = sum(seq_lens) - sum(prefix_lens)
            if total > self._pages_free():
                return None
            return self._take_pages(total)
        return self._alloc_extend_paged(prefix_lens, seq_lens, last_locs)

    def alloc_decode(
        self, prefix_lens: list[int], last_locs: torch.Tensor | None
    ) -> torch.Tensor | None:
        """One slot per request, for position prefix_lens[i] (a decode step; every prefix_len
        >= 1): the next slot of the request's last page, or the first slot of a new page where
        that page is full. `last_locs` (None with page_size 1): int64 [B] on this allocator's
        device, the slot of position prefix_lens[i] - 1, read where it is. Four device ops:
        fewer than `alloc_extend`'s plan for the same one-token steps. Returns None,
        allocating nothing, if there are not enough free pages."""
        ps = self.page_size
        if ps == 1:  # (a slot per request: a page each)
            if len(prefix_lens) > self._pages_free():
                return None
            return self._take_pages(len(prefix_lens))
        need = [i for i, n in enumerate(prefix_lens) if n % ps == 0]
        if len(need) > self._pages_free():
            return None
        assert last_locs is not None, "alloc_decode: paged decode needs the last slots"
        out = last_locs + 1
        if need:
            rows = int64_tensor(need).to(self.device)
            out.index_copy_(0, rows, self._take_pages(len(need)) * ps)
        return out

    def _alloc_extend_paged(
        self,
        prefix_lens: list[int],
        seq_lens: list[int],
        last_locs: list[int] | torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The plan is host arithmetic (numpy) on the lengths: per new token, its request and
        its offset k among that request's new tokens. The first `room` tokens of a request
        continue its last page (last_loc + 1 + k), the others fill its new pages in order."""
        ps = self.page_size
        prefix, seq = int64_array(prefix_lens), int64_array(seq_lens)
        new_pages = _ceil_div(seq, ps) - _ceil_div(prefix, ps)
        total_pages = int(new_pages.sum())
        if total_pages > self._pages_free():
            return None
        num_new = seq - prefix
        room = np.minimum(-prefix % ps, num_new)  # slots left in the current last page
        partial = prefix % ps != 0
        last_dev = None
        if partial.any():
            if last_locs is None:
                raise ValueError("alloc_extend: a request continues a page; last_locs needed")
            if isinstance(last_locs, torch.Tensor):
                last_dev = last_locs.to(self.device, torch.int64)
                # a continuing request's last slot has the in-page offset of prefix_len - 1
                want = torch.from_numpy(np.where(partial, (prefix - 1) % ps, -1)).to(self.device)
                self._check((want >= 0) & (last_dev % ps != want), _BAD_LAST)
            else:
                last = int64_array(last_locs)
                if ((last[partial] + 1 - prefix[partial]) % ps != 0).any():
                    raise ValueError(
                        "alloc_extend: last_loc is not in the page of position prefix_len-1"
                    )
                last_dev = torch.from_numpy(last).to(self.device)
        total = int(num_new.sum())
        req = np.repeat(np.arange(len(prefix), dtype=np.int64), num_new)
        k = np.arange(total, dtype=np.int64) - (np.cumsum(num_new) - num_new)[req]
        k_new = k - room[req]  # offset among the request's slots in new pages (< 0: in room)
        page_start = np.cumsum(new_pages) - new_pages
        fresh = np.where(k_new >= 0, page_start[req] * ps + k_new, 0)
        pages = self._take_pages(total_pages)
        if last_dev is None:  # every token in a new page
            host = torch.from_numpy(fresh).to(self.device)
            return _page_slots(pages, ps).index_select(0, host)
        plan = torch.from_numpy(np.stack([fresh, req, k + 1, k_new >= 0])).to(self.device)
        from_last = last_dev.index_select(0, plan[1]) + plan[2]
        if not total_pages:
            return from_last
        return torch.where(plan[3] != 0, _page_slots(pages, ps).index_select(0, plan[0]),
                           from_last)  # fmt: skip

    def _pages_free(self) -> int:
        """Pages an allocation may take (the hybrid allocator also needs window pages)."""
        return self._num_free

    def _take_pages(self, n: int) -> torch.Tensor:
        """n free pages (as slots when page_size is 1), lowest first on a fresh pool."""
        pages = self._free_pages[self._num_free - n : self._num_free].flip(0)
        self._num_free -= n
        self._page_state.index_fill_(0, pages, _ALLOCATED)
        return pages

    # -- freeing ---------------------------------------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        """Free the pages these slots lie in (each page once, however many of its slots are
        given). Raises DoubleFreeError for a page that is free, pending, or page 0. Any
        slots: finding their pages takes `unique`, which reads the device (see `free_runs`)."""
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64).flatten()
        pages = torch.unique(slots // self.page_size)
        if self.page_size == 1 and pages.numel() != slots.numel():
            raise DoubleFreeError("allocator.free: the same slot given twice")
        self._free_pages_checked(pages)

    def free_runs(
        self, runs: Sequence[torch.Tensor], live_from: Sequence[int] | None = None
    ) -> None:
        """Free the pages of `runs`: each the slots of consecutive positions of one owner from
        a page boundary on (a request's row from a page-aligned position, a radix node's
        value), so that its pages are those of every page_size-th slot: no `unique`, no read
        of the device. Raises DoubleFreeError as `free` does (late where checks are deferred);
        a page given twice in one call is not caught here. `live_from`: the owner's account of
        which pages still hold sliding-window KV (see `SWATokenToKVPoolAllocator.free_runs`);
        this pool has none."""
        found = self._run_pages(runs)
        if found is not None:
            self._free_pages_checked(*found)

    def _run_pages(
        self, runs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The pages of page-aligned runs (see `free_runs`), and where a run does not start at
        a page boundary (None at page size 1); None for no slots."""
        ps = self.page_size
        parts = [r.flatten()[::ps] for r in runs if r.numel()]
        if not parts:
            return None
        firsts = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device, torch.int64)
        if ps == 1:
            return firsts, None
        # (a run that does not start at a page boundary would free the wrong pages)
        return firsts // ps, firsts % ps != 0

    def _free_pages_checked(self, pages: torch.Tensor, bad: torch.Tensor | None = None) -> None:
        """Free distinct pages, each checked to be allocated and none marked `bad`."""
        self._check_held(pages, bad)
        if self._group is not None:
            self._page_state.index_fill_(0, pages, _PENDING)
            self._group.append(pages)
            return
        self._release(pages)

    # -- checks ----------------------------------------------------------------------------------
    def _check_held(self, pages: torch.Tensor, bad: torch.Tensor | None = None) -> None:
        """Each page is allocated (page 0 and pages beyond the pool read as reserved: one
        gather checks all three) and none is marked `bad`: a DoubleFreeError otherwise."""
        state = self._page_state.index_select(0, pages.clamp(0, self.num_pages + 1))
        not_held = state != _ALLOCATED
        self._check(not_held if bad is None else not_held | bad, _BAD_FREE, pages)

    def _check(self, bad: torch.Tensor, fault: int, pages: torch.Tensor | None = None) -> None:
        """Where `bad` (a device bool tensor) holds a True, the `fault`: raised now, or with
        `defer_checks` flagged on the device for `verify` (no read of the device here)."""
        if not self.defer_checks:
            if bool(bad.any()):
                raise _fault_error(fault, None if pages is None else pages[bad][:8].tolist())
            return
        flag = self._faults[fault]
        flag |= bad.any()
        self._unverified += 1
        if self._unverified >= CHECK_EVERY:
            self.verify()

    def verify(self) -> None:
        """Raise the first fault the deferred checks flagged since the last call (a read of
        the device; nothing to read without deferred checks)."""
        if not self._unverified:
            return
        self._unverified = 0
        faults = self._faults.tolist()
        self._faults.zero_()
        for fault, seen in enumerate(faults):
            if seen:
                raise _fault_error(fault, None)

    def _release(self, pages: torch.Tensor) -> None:
        n = pages.numel()
        if self._num_free + n > self.num_pages:  # (a host-side check: deferred or not)
            raise DoubleFreeError("allocator: more pages freed than are allocated")
        self._page_state.index_fill_(0, pages, _FREE)
        self._free_pages[self._num_free : self._num_free + n] = pages
        self._num_free += n

    def free_group_begin(self) -> None:
        """Collect frees until `free_group_end` (one concatenation instead of many)."""
        assert self._group is None, "free_group_begin: groups do not nest"
        self._group = []

    def free_group_end(self) -> None:
        assert self._group is not None, "free_group_end without free_group_begin"
        group, self._group = self._group, None
        if group:
            self._release(torch.cat(group))

    # -- introspection (tests, integrity checks) ---------------------------------------------
    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot: True if its page is currently handed out (not free, not pending)."""
        pages = slots.to(device=self.device, dtype=torch.int64).flatten() // self.page_size
        return self._page_state.index_select(0, pages.clamp(0, self.num_pages + 1)) == _ALLOCATED


def _fault_error(fault: int, pages: list[int] | None) -> Exception:
    if fault == _BAD_LAST:
        return ValueError("alloc_extend: last_loc is not in the page of position prefix_len-1")
    where = f" of pages {pages}" if pages is not None else " (found by a deferred check)"
    if fault == _BAD_WINDOW:
        return DoubleFreeError(f"swa allocator: window pages not as their owner says{where}")
    return DoubleFreeError(f"allocator: free of a page that is not allocated{where}")


def _ceil_div(x: np.ndarray, n: int) -> np.ndarray:
    return -(-x // n)


def _page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of `pages`, page after page."""
    if page_size == 1:
        return pages
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size, device=pages.device)).flatten()
