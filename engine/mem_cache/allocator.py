"""`TokenToKVPoolAllocator`: hands out KV slots a whole page at a time.

Pages: page p is slots p*page_size .. p*page_size + page_size - 1. Page 0 is reserved for
padding writes and is never handed out, so the KV buffers need `size + page_size` slots.

Positions and slots line up inside a page: the slot of position `pos` of a request satisfies
`slot % page_size == pos % page_size`, because a request starts a new page exactly when a
position is a multiple of page_size and otherwise continues the page of its previous token.
So a request's last page is partly used iff its length is not a multiple of page_size, and
pages are never shared between owners (see `engine.mem_cache.base`).

Each page is in one of three states: allocated, free, or pending (freed inside a
`free_group_begin/end` pair, returned at the end). Freeing a page that is not allocated raises
`DoubleFreeError`, the classic bug this layer exists to catch.
"""

from __future__ import annotations

import array
import operator

import torch

_ALLOCATED, _FREE, _PENDING = 0, 1, 2


class DoubleFreeError(RuntimeError):
    pass


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu") -> None:
        if page_size < 1 or size <= 0 or size % page_size != 0:
            raise ValueError(f"allocator: size {size} must be a positive multiple of {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        # A stack of free pages: _free_pages[:_num_free], the next to hand out on top. Kept in
        # a fixed buffer so alloc and free cost O(pages moved), not O(pool size).
        self._free_pages = torch.arange(
            self.num_pages, 0, -1, dtype=torch.int64, device=self.device
        )
        self._num_free = self.num_pages
        self._page_state = torch.full(
            (self.num_pages + 1,), _FREE, dtype=torch.int8, device=self.device
        )
        self._page_state[0] = _ALLOCATED  # the padding page: never free, never freeable
        self._group: list[torch.Tensor] | None = None

    def available_size(self) -> int:
        """Free tokens (free pages * page_size); pending frees are not available yet."""
        return self._num_free * self.page_size

    def num_pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """New pages `alloc_extend` takes to grow a request from prefix_len to seq_len."""
        ps = self.page_size
        return -(-seq_len // ps) - (-(-prefix_len // ps))

    # -- allocation ------------------------------------------------------------------------------
    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        """Slots for positions prefix_lens[i] .. seq_lens[i]-1 of each request, concatenated
        (int64). A request whose prefix_len is not page aligned first fills its last page
        (last_locs[i]+1, ...; last_locs[i] is the slot of position prefix_len-1), then takes
        new pages. Returns None, allocating nothing, if there are not enough free pages."""
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
        device, the slot of position prefix_lens[i] - 1, read where it is (no host read,
        unlike `alloc_extend`'s list). A handful of device ops where `alloc_extend` takes about
        fifty. Returns None, allocating nothing, if there are not enough free pages."""
        ps = self.page_size
        need = [i for i, n in enumerate(prefix_lens) if n % ps == 0]
        if len(need) > self._pages_free():
            return None
        if ps == 1:
            return self._take_pages(len(need))
        assert last_locs is not None, "alloc_decode: paged decode needs the last slots"
        out = last_locs + 1
        if need:
            rows = torch.frombuffer(array.array("q", need), dtype=torch.int64).to(self.device)
            out.index_copy_(0, rows, self._take_pages(len(need)) * ps)
        return out

    def _alloc_extend_paged(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> torch.Tensor | None:
        ps = self.page_size
        dev = self.device
        prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=dev)
        seq = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        last = torch.tensor(last_locs, dtype=torch.int64, device=dev)
        partial = prefix % ps != 0
        if bool((partial & ((last + 1 - prefix) % ps != 0)).any()):
            raise ValueError("alloc_extend: last_loc is not in the page of position prefix_len-1")
        new_pages = (seq + ps - 1) // ps - (prefix + ps - 1) // ps
        total_pages = int(new_pages.sum())
        if total_pages > self._pages_free():
            return None
        num_new = seq - prefix
        room = torch.minimum((-prefix) % ps, num_new)  # slots left in the current last page
        pages = self._take_pages(total_pages)

        # Per new token: which request, and its offset k within that request's new tokens.
        total = sum(seq_lens) - sum(prefix_lens)
        req = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=dev), num_new, output_size=total
        )
        tok_start = torch.cumsum(num_new, 0) - num_new
        # (index_select, not tensor[index]: advanced indexing is ~100x slower on CPU)
        k = torch.arange(total, device=dev) - tok_start.index_select(0, req)
        room_k = room.index_select(0, req)
        out = last.index_select(0, req) + 1 + k
        if total_pages:
            k_new = (k - room_k).clamp(min=0)
            page_start = torch.cumsum(new_pages, 0) - new_pages
            page_idx = (page_start.index_select(0, req) + k_new // ps).clamp(max=total_pages - 1)
            fresh = pages.index_select(0, page_idx) * ps + k_new % ps
            out = torch.where(k < room_k, out, fresh)
        return out

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
        given). Raises DoubleFreeError for a page that is free, pending, or page 0."""
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64).flatten()
        pages = torch.unique(slots // self.page_size)
        if self.page_size == 1 and pages.numel() != slots.numel():
            raise DoubleFreeError("allocator.free: the same slot given twice")
        if int(pages[0]) < 1 or int(pages[-1]) > self.num_pages:
            raise DoubleFreeError(f"allocator.free: slot outside 1..{self.num_pages} pages")
        not_held = self._page_state.index_select(0, pages) != _ALLOCATED
        if bool(not_held.any()):
            bad = pages[not_held][:8].tolist()
            raise DoubleFreeError(f"allocator.free: double free of pages {bad}")
        if self._group is not None:
            self._page_state.index_fill_(0, pages, _PENDING)
            self._group.append(pages)
            return
        self._release(pages)

    def _release(self, pages: torch.Tensor) -> None:
        self._page_state.index_fill_(0, pages, _FREE)
        n = pages.numel()
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
        return (self._page_state.index_select(0, pages) == _ALLOCATED) & (pages > 0)
