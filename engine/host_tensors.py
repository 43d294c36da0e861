"""Index lists to tensors on the host, fast: the per-step conversions of the scheduler loop.

`torch.tensor(list_of_ints)` parses the list one Python object at a time, through its generic
nested-sequence path: 1024 ints took 75 us on the development VM. `array.array("q", ...)`
packs them in C and `torch.frombuffer` wraps the result without a copy: 25 us. At batch 256 a
decode step converts about a thousand ints, a tenth of the scheduler's host time per step
with the null model runner (benchmarks/host_overhead.py), which is what a GPU waits for when
the model is fast.

The tensor keeps the array alive (frombuffer holds a reference to the buffer). Values must be
Python ints within int64 (array raises OverflowError or TypeError otherwise).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import torch


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """CPU int64 tensor [len(values)] of `values`."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def int64_array(values: Sequence[int]) -> np.ndarray:
    """numpy int64 array [len(values)] of `values` (the same fast packing, for host
    arithmetic: the allocator's plans, the attention page tables)."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    return np.frombuffer(array.array("q", values), dtype=np.int64)


def int64_rows(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """CPU int64 tensor [len(rows), n] of equal-length lists: one conversion for all of them
    (and so, moved to a device, one copy)."""
    n = len(rows[0]) if rows else 0
    if any(len(r) != n for r in rows):
        raise ValueError(f"rows of unequal lengths: {[len(r) for r in rows]}")
    flat: list[int] = []
    for r in rows:
        flat.extend(r)
    return int64_tensor(flat).view(len(rows), n)
