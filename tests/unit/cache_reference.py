"""A naive model of what a prefix cache holds, for property tests of `RadixCache`.

The model is a dict from every cached page-aligned token prefix (a tuple) to the KV slots of
its last page. A cache that is correct holds exactly these prefixes: it is closed under taking
shorter page-aligned prefixes, a match returns the longest one present, and eviction removes
entries whose pages the allocator got back.
"""

from __future__ import annotations

import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator


class ReferenceCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[tuple[int, ...], list[int]] = {}

    def longest(self, key: list[int]) -> list[int]:
        """Slots of the longest cached prefix of key (page aligned)."""
        ps = self.page_size
        slots: list[int] = []
        for end in range(ps, len(key) + 1, ps):
            page = self.pages.get(tuple(key[:end]))
            if page is None:
                break
            slots.extend(page)
        return slots

    def add(self, key: list[int], slots: list[int]) -> int:
        """What an insert must do: prefixes not cached yet take the caller's slots. Returns the
        number of leading tokens that were cached already."""
        ps = self.page_size
        assert len(key) % ps == 0
        already = len(self.longest(key))
        for end in range(already + ps, len(key) + 1, ps):
            self.pages[tuple(key[:end])] = slots[end - ps : end]
        return already

    def drop_freed(self, allocator: TokenToKVPoolAllocator) -> int:
        """Forget prefixes whose pages the allocator holds as free again (after an eviction);
        returns how many tokens were forgotten."""
        gone = [
            k
            for k, page in self.pages.items()
            if not bool(allocator.is_allocated(torch.tensor(page[:1])).item())
        ]
        for k in gone:
            del self.pages[k]
        return len(gone) * self.page_size

    def is_prefix_closed(self) -> bool:
        ps = self.page_size
        return all(len(k) == ps or k[:-ps] in self.pages for k in self.pages)

    def page_slots(self) -> set[int]:
        return {s for page in self.pages.values() for s in page}

    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size

    def num_tokens_under(self, keys: list[list[int]]) -> int:
        """Tokens of cached prefixes that are a prefix of at least one of keys (what locks on
        those keys protect)."""
        ps = self.page_size
        covered = {tuple(key[:end]) for key in keys for end in range(ps, len(key) + 1, ps)}
        return len(covered & self.pages.keys()) * ps
