"""flashinfer's own Python on a machine without a GPU: its wrappers built and planned, with the
C++ planners (JIT modules that need a GPU) replaced. For tests/unit/test_flashinfer_plan.py and
benchmarks/flashinfer_plan.py; CI installs flashinfer without its CUDA dependencies."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

SHARED_BYTES = 1 << 16  # tensors larger than this are workspaces: recorded by identity


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Wrappers allocate pinned staging memory, which a machine without a GPU lacks: plain
    memory instead, inside this block."""
    empty = torch.empty
    torch.empty = lambda *a, pin_memory=False, **k: empty(*a, **k)
    try:
        yield
    finally:
        torch.empty = empty


def snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() > SHARED_BYTES:
            return ("buffer", value.data_ptr(), value.dtype)
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.tolist()))
    return value


class Recorder:
    """Stands for a planning module: `plan` records, and returns, what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def plan(self, *args: Any) -> list:
        self.calls.append(tuple(snapshot(a) for a in args))
        return list(self.calls[-1])


class NullPlanner:
    """Stands for a planning module and costs nothing (host-time benchmarks)."""

    def plan(self, *args: Any) -> list:
        return []


@contextlib.contextmanager
def stubbed_planners(fi: Any, module: Any) -> Iterator[Any]:
    """Inside this block, flashinfer's decode and prefill wrappers plan with `module`."""
    sites = [(fi.decode, "get_batch_prefill_module"), (fi.decode, "get_batch_decode_module"),
             (fi.prefill, "get_batch_prefill_module")]  # fmt: skip
    saved = [getattr(owner, name) for owner, name in sites]
    for owner, name in sites:
        setattr(owner, name, lambda *a, **k: module)
    try:
        yield module
    finally:
        for (owner, name), value in zip(sites, saved):
            setattr(owner, name, value)
