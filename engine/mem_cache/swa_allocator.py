"""`SWATokenToKVPoolAllocator`: the hybrid sliding-window memory of SGLang and vLLM.

A model whose sliding-window layers see only the last W keys need not keep those layers' K/V
for every token. The slots handed out here (full slots) index `req_to_token`, the radix
tree and the full-attention layers' buffers as before; each full page also gets a page of a
second, smaller pool (swa slots) that only the windowed layers' buffers are sized for.
`full_to_swa[full_slot]` is the swa slot of a full slot, 0 when it has none: never given
one, or freed because no query will look that far back (`free_swa`; the tree calls a node
whose swa pages are freed a tombstone). Slot 0 is the padding slot of both pools.

Pages line up: full page f maps to one swa page s, slot f*P + k to s*P + k, so a request's
pages keep the alignment the paged kernels rely on in both pools. Freeing a full page frees
its swa page too. `available_size` stays the full pool's (the scheduler's token budget);
`swa_available_size` is the second pool's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.mem_cache.allocator import _BAD_WINDOW, DoubleFreeError, TokenToKVPoolAllocator


class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
    def __init__(
        self,
        size: int,
        swa_size: int,
        page_size: int,
        device: str | torch.device = "cpu",
        defer_checks: bool | None = None,
    ) -> None:
        self.swa = TokenToKVPoolAllocator(swa_size, page_size, device, defer_checks)
        self.swa_size = swa_size
        num_pages = size // page_size
        # per full page: its swa page (0: none); per full slot: its swa slot (read by the
        # attention backends; shared with the device process, so never reallocated)
        self._swa_page = torch.zeros(num_pages + 1, dtype=torch.int64, device=device)
        self.full_to_swa = torch.zeros(
            (num_pages + 1) * page_size, dtype=torch.int64, device=device
        )
        self._in_page = torch.arange(page_size, dtype=torch.int64, device=device)
        super().__init__(size, page_size, device, defer_checks)

    def clear(self) -> None:
        super().clear()
        self.swa.clear()
        self._swa_page.zero_()
        self.full_to_swa.zero_()

    def verify(self) -> None:
        """Raise the first fault either pool's deferred checks flagged (the window pool checks
        the window pages it frees)."""
        super().verify()
        self.swa.verify()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def _pages_free(self) -> int:
        return min(self._num_free, self.swa._num_free)

    def _take_pages(self, n: int) -> torch.Tensor:
        pages = super()._take_pages(n)
        self._map(pages, self.swa._take_pages(n))
        return pages

    def _map(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        self._swa_page.index_copy_(0, full_pages, swa_pages)
        ps = self.page_size
        slots = (full_pages.unsqueeze(1) * ps + self._in_page).flatten()
        swa_slots = swa_pages.unsqueeze(1) * ps + self._in_page
        # a full page without swa maps to slot 0 for all its slots
        swa_slots = torch.where(swa_pages.unsqueeze(1) > 0, swa_slots, 0).flatten()
        self.full_to_swa.index_copy_(0, slots, swa_slots)

    def free_runs(
        self, runs: Sequence[torch.Tensor], live_from: Sequence[int] | None = None
    ) -> None:
        """`free_runs` of the full pages, and their window pages. `live_from`, the owners'
        account: per run, the offset (in slots) from which its pages still hold window pages;
        the pages before it hold none (a request's before its `swa_released`, a radix node's
        before its last `swa_live` tokens). With it the host knows how many window pages are
        freed and nothing is read from the device; a page whose window page is not as the
        account says is a DoubleFreeError (late where checks are deferred), or a leaked
        window page that `check_mapping` finds. Without it (or inside a free group), the
        window pages are looked up on the device (`_drop_swa`, a read)."""
        if live_from is None or self._group is not None:
            super().free_runs(runs)
            return
        found = self._run_pages(runs)
        if found is None:
            return
        pages, bad = found
        self._check_held(pages, bad)
        live = _live_page_index(runs, live_from, self.page_size)
        if live.size == pages.numel():
            self._free_windows(pages, pages)
        elif live.size:
            self._free_windows(pages, pages.index_select(0, torch.from_numpy(live).to(self.device)))
        else:
            self._map(pages, torch.zeros_like(pages))
        TokenToKVPoolAllocator._release(self, pages)

    def _free_windows(self, pages: torch.Tensor, held: torch.Tensor) -> None:
        """Free the window pages of the full pages `held` (each must have one: a page without
        reads as page 0, reserved, a DoubleFreeError) and clear the map of all `pages`."""
        self.swa._free_pages_checked(self._swa_page.index_select(0, held))
        self._map(pages, torch.zeros_like(pages))

    def _release(self, pages: torch.Tensor) -> None:
        super()._release(pages)
        self._drop_swa(pages)

    def _drop_swa(self, pages: torch.Tensor) -> int:
        """Free the swa pages of these full pages that have one (found by reading the device);
        returns how many."""
        swa_pages = self._swa_page.index_select(0, pages)
        live = swa_pages > 0
        if not bool(live.any()):
            return 0
        pages, swa_pages = pages[live], swa_pages[live]
        self._map(pages, torch.zeros_like(pages))
        self.swa.free(swa_pages * self.page_size)
        return int(pages.numel())

    # -- the window's own operations -------------------------------------------------------
    def full_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct full pages of these full slots, checked to be allocated."""
        slots = slots.to(device=self.device, dtype=torch.int64).flatten()
        pages = torch.unique(slots // self.page_size)
        if pages.numel() and not bool(self.is_allocated(pages * self.page_size).all()):
            raise DoubleFreeError("swa allocator: a page that is not allocated")
        return pages

    def free_swa(self, slots: torch.Tensor) -> int:
        """Free the swa pages of the full pages these slots lie in (those that still have one);
        the full pages stay. Returns the swa tokens freed."""
        if slots.numel() == 0:
            return 0
        return self._drop_swa(self.full_pages(slots)) * self.page_size

    def free_swa_runs(self, runs: Sequence[torch.Tensor]) -> int:
        """`free_swa` of page-aligned runs (see `free_runs`) whose every page holds a swa page:
        a request's own slots past its cached prefix, each freed once as its window moves on,
        or a radix node's live suffix (`SWARadixCache`). The host knows how many pages that
        frees, so nothing is read from the device; a page that is not allocated or has no swa
        page is a DoubleFreeError, raised late where checks are deferred. Returns the swa
        tokens freed."""
        found = self._run_pages(runs)
        if found is None:
            return 0
        pages, bad = found
        self._check_held(pages, bad)
        self._free_windows(pages, pages)
        return pages.numel() * self.page_size

    def has_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """Per full slot: whether its page still has a swa page."""
        pages = slots.to(device=self.device, dtype=torch.int64) // self.page_size
        return self._swa_page.index_select(0, pages.flatten()).view(pages.shape) > 0

    def move_swa_runs(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> int:
        """Give the window pages of the pages of the page-aligned runs `src` to those of `dst`,
        run for run and page for page (the same tokens' KV): the radix cache adopting a
        request's window KV for tokens it holds without. The owners' account says that every
        `src` page has a window page and no `dst` page does; where that is wrong, a
        DoubleFreeError (late where checks are deferred). No read of the device; returns the
        tokens moved."""
        ps = self.page_size
        counts = [-(-r.numel() // ps) for r in src]
        if counts != [-(-r.numel() // ps) for r in dst]:
            raise ValueError("move_swa_runs: source and target runs differ in length")
        found_src, found_dst = self._run_pages(src), self._run_pages(dst)
        if found_src is None or found_dst is None:
            return 0
        (src_p, bad_src), (dst_p, bad_dst) = found_src, found_dst
        self._check_held(torch.cat([src_p, dst_p]),
                         None if bad_src is None else torch.cat([bad_src, bad_dst]))  # fmt: skip
        swa = self._swa_page.index_select(0, src_p)
        self._check((swa == 0) | (self._swa_page.index_select(0, dst_p) != 0), _BAD_WINDOW)
        self._map(src_p, torch.zeros_like(src_p))
        self._map(dst_p, swa)
        return sum(counts) * ps

    def check_mapping(self) -> None:
        """Every full page with a swa page is allocated; swa pages are held once each and
        are allocated; the slot map agrees with the page map."""
        live = torch.nonzero(self._swa_page > 0).flatten()
        swa_pages = self._swa_page.index_select(0, live)
        ps = self.page_size
        assert bool(self.is_allocated(live * ps).all()), "a free full page has a swa page"
        assert torch.unique(swa_pages).numel() == swa_pages.numel(), "a swa page held twice"
        assert bool(self.swa.is_allocated(swa_pages * ps).all()), "a swa page is free"
        held = self.swa.size - self.swa.available_size()
        assert held == swa_pages.numel() * ps, f"swa pages leaked: {held} held"
        expect = (self._swa_page.unsqueeze(1) * ps + self._in_page).flatten()
        expect = torch.where(self._swa_page.repeat_interleave(ps) > 0, expect, 0)
        assert torch.equal(expect, self.full_to_swa), "full_to_swa disagrees with the pages"


def _live_page_index(
    runs: Sequence[torch.Tensor], live_from: Sequence[int], ps: int
) -> np.ndarray:
    """Indices, among the pages of the non-empty `runs` in order (as `_run_pages` lists
    them), of each run's pages from its `live_from` offset on."""
    if len(live_from) != len(runs):
        raise ValueError("free_runs: one live_from per run")
    parts, base = [], 0
    for run, first in zip(runs, live_from):
        n = -(-run.numel() // ps)
        if n:
            parts.append(np.arange(base + min(n, -(-first // ps)), base + n, dtype=np.int64))
            base += n
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
