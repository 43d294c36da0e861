"""Giving the device memory of an idle engine back, and taking it again: SGLang's
`release_memory_occupation` / `resume_memory_occupation` (tags "weights", "kv_cache",
"cuda_graph") and vLLM's sleep mode (level 1: the weights kept in host memory, the K/V
discarded; level 2: both discarded), which RL trainers call to train on the GPU between
rollouts.

What is released is each tensor's storage, resized to nothing in place (the tensors, their
views and every reference to them stay; FSDP frees its parameters the same way), and resized
back at the resume: nothing is allocated at start for this, and no code that holds a weight
or a K/V buffer has to know. The memory goes back to torch's caching allocator, and to the
driver by `torch.cuda.empty_cache()`. The addresses change, so the CUDA graphs (which have
them baked in) are dropped with either, and captured again at the first decode after the
resume (SGLang keeps its graphs: torch_memory_saver maps the same virtual addresses again).

* "kv_cache": the K/V pool's buffers. Their content is forgotten (the scheduler empties the
  prefix cache first); they come back zeroed, as allocated at start.
* "weights": the model's parameters (not its buffers: rotary tables and the like are small
  and are not in the checkpoint). With `backup`, copied to host memory first (pinned on
  CUDA) and copied back at the resume; without, discarded: they come back zeroed and are
  read from the checkpoint served (`weights_path`) before the next forward, unless
  `update_weights_from_disk` fills them first (the RL loop's way: the old weights are never
  read again); weights updated from tensors are on no disk: all must be sent again
  (engine/runner_weights.py). A model quantized to FP8 as it loaded cannot be read again:
  only a backup releases its weights.
* "cuda_graph": the decode graphs (their memory pool); captured again when next needed.

The state is the runner's (`ModelRunner.memory`; its calls are engine/runner_weights.py);
the scheduler makes sure no request holds K/V before a release and runs nothing while
weights or K/V are released (engine/scheduler/memory_release.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """`tags` (None: all) in MEMORY_TAGS order; ValueError naming an unknown one."""
    if tags is None:
        return MEMORY_TAGS
    tags = list(tags)
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise ValueError(f"unknown memory tag {tag!r} (use {', '.join(MEMORY_TAGS)})")
    return tuple(t for t in MEMORY_TAGS if t in tags)


class _Released:
    """Storages resized to nothing: each with its size and, when kept, its host copy."""

    def __init__(self, storages: list[torch.UntypedStorage], backup: bool, pin: bool) -> None:
        self.sizes = [s.nbytes() for s in storages]
        self.storages = storages
        self.backups: list[torch.Tensor] | None = None
        if backup:
            self.backups = []
            for storage, size in zip(storages, self.sizes, strict=True):
                copy = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                copy.copy_(_bytes(storage, size))
                self.backups.append(copy)
        for storage in storages:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def restore(self) -> None:
        """Storages back at their size: the host copies in them, or zeros."""
        for i, (storage, size) in enumerate(zip(self.storages, self.sizes, strict=True)):
            storage.resize_(size)
            view = _bytes(storage, size)
            if self.backups is None:
                view.zero_()
            else:
                view.copy_(self.backups[i], non_blocking=True)
        if self.backups is not None and self.storages and self.storages[0].device.type == "cuda":
            torch.cuda.synchronize(self.storages[0].device)  # (the host copies are then freed)


class MemoryOccupation:
    """A runner's released memory: what is released now, and how to take it back."""

    def __init__(self) -> None:
        self.weights: _Released | None = None
        self.kv_cache: _Released | None = None
        self.stale_weights = False  # allocated again without their values: read before use

    def release_weights(self, model: torch.nn.Module, backup: bool, device: torch.device) -> int:
        if self.weights is not None:
            return 0
        self.weights = _Released(_storages(model.parameters()), backup, device.type == "cuda")
        return self.weights.nbytes

    def release_kv(self, buffers: list[torch.Tensor]) -> int:
        if self.kv_cache is not None:
            return 0
        self.kv_cache = _Released(_storages(buffers), backup=False, pin=False)
        return self.kv_cache.nbytes

    def resume_weights(self) -> int:
        """The weights' storages back; `stale_weights` set if they were discarded (a backup
        brings back what was there, stale or not)."""
        released, self.weights = self.weights, None
        if released is None:
            return 0
        released.restore()
        self.stale_weights = self.stale_weights or released.backups is None
        return released.nbytes

    def resume_kv(self) -> int:
        released, self.kv_cache = self.kv_cache, None
        if released is None:
            return 0
        released.restore()
        return released.nbytes


def occupied_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the distinct storages of `tensors` hold now."""
    return sum(s.nbytes() for s in _storages(tensors))


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` (tied weights, views: one each)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in _unique(tensors):
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(t)
        seen.setdefault(key, storage)
    return list(seen.values())


def _unique(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    ids: set[int] = set()
    for t in tensors:
        if id(t) not in ids:
            ids.add(id(t))
            yield t


def _bytes(storage: torch.UntypedStorage, size: int) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (size,))
