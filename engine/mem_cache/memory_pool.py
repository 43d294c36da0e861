"""`ReqToTokenPool`: one row per running request, holding the KV slot of each of its positions.

`req_to_token[row, pos]` is the slot (index into the KV buffers) of token `pos` of the request
that owns `row`. Rows are handed out and taken back whole; the pool knows nothing about which
slots a row holds or who owns them (see `engine.mem_cache.base` for slot ownership).
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool: size={size}, max_context_len={max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.clear()

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int) -> list[int] | None:
        """`n` free row indices, or None (allocating nothing) if fewer are free."""
        if n > len(self._free_rows):
            return None
        rows = self._free_rows[:n]
        del self._free_rows[:n]
        for row in rows:
            self._is_free[row] = False
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Give rows back. Freeing a row that is already free raises RuntimeError."""
        rows = [idx] if isinstance(idx, int) else [int(i) for i in idx]
        for row in rows:
            if not 0 <= row < self.size:
                raise ValueError(f"ReqToTokenPool.free: row {row} out of range [0, {self.size})")
            if self._is_free[row]:
                raise RuntimeError(f"ReqToTokenPool.free: double free of row {row}")
            self._is_free[row] = True
        self._free_rows.extend(rows)

    def reserve_last_row(self) -> int:
        """Take the last row out of circulation and return its index.

        Padded rows of captured decode batches point there: no request ever owns the row, so
        its entries stay 0 (KV slot 0, never handed out). The pool then counts one row fewer
        (`size`, free rows, leak checks), as if the row were not there.
        """
        self.size -= 1
        self.clear()
        return self.size

    def clear(self) -> None:
        self._free_rows: list[int] = list(range(self.size))
        self._is_free: list[bool] = [True] * self.size
