"""`LoRALinear`: a model's linear layer plus the LoRA deltas of the adapters in device slots.

The layer holds, per output shard (q, k, v of a fused `qkv_proj`; one shard for a plain
linear), `num_slots` adapters' matrices side by side: A as rows `[slot][shard][rank]` of one
`[slots * shards * max_rank, in]` buffer, B per shard as `[shard size, slots * max_rank]` with
the adapter's scaling folded in. A forward uses the slots `lo..hi` its batch's adapters are
in (a contiguous block of rows of A and of columns of each B); a token's delta is then

    y[:, shard] += ((x @ A[lo..hi].T) * mask)[:, shard's columns] @ B_shard[:, lo..hi].T

where `mask` keeps only the rank columns of the token's slot (the batch's tokens of all its
adapters go through the same matmuls; a base-model token's mask row is all zeros), so a batch
of one adapter computes one adapter's rank, not every slot's. A smaller rank than `max_rank`
leaves its extra rows and columns zero. The mask and slot range are the manager's
(engine/lora/manager.py), set once per forward for all layers.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.parallel import RowParallelLinear

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, manager: LoRAManager) -> None:
        super().__init__()
        self.base = base
        self.manager = manager
        ranges = getattr(base, "shard_ranges", None) or {None: (0, base.out_features)}
        self.shard_ids: list[Hashable] = list(ranges)
        self.shard_ranges: list[tuple[int, int]] = [ranges[s] for s in self.shard_ids]
        slots, rank = manager.num_slots, manager.max_rank
        dtype, device = manager.dtype, base.weight.device  # an FP8 base's weight is float8
        self.lora_a = torch.zeros(
            slots * len(self.shard_ids) * rank, base.in_features, dtype=dtype, device=device
        )
        self.lora_b = [
            torch.zeros(size, slots * rank, dtype=dtype, device=device)
            for _, size in self.shard_ranges
        ]
        # tensor parallelism (engine/layers/parallel.py): a column-parallel base holds its
        # rows of each shard (B's rows: `sources`); a row-parallel one its columns of the input
        # (A's columns: `column_part`), so x @ A.T is a partial sum, all-reduced over `tp`
        self.sources = getattr(base, "sources", None) or None
        self.column_part, self.tp = getattr(base, "column_part", None), getattr(base, "tp", None)
        if isinstance(base, RowParallelLinear):
            self.column_part = (base.in_start, base.in_features, base.full_in)

    def part(
        self, shard_id: Hashable, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's (A [r, in], B [out, r]) for shard `shard_id` of a
        split base (as they are where it is not split, or where they do not have the base's
        full shape: the caller's check names that)."""
        if self.column_part is not None:
            start, length, full = self.column_part
            if a.shape[1] == full:
                a = a[:, start : start + length]
        if self.sources and shard_id in self.sources:
            start, rows, total = self.sources[shard_id]
            if b.shape[0] == total:
                b = b[start : start + rows]
        return a, b

    @property
    def output_sizes(self) -> list[int]:
        """As `MergedLinear.output_sizes` (models split the fused output by it)."""
        return [size for _, size in self.shard_ranges]

    def shard_of(self, shard_id: Hashable) -> tuple[int, int]:
        """(index, size) of an output shard; KeyError names the shards there are."""
        if shard_id not in self.shard_ids:
            raise KeyError(f"no shard {shard_id!r} (shards: {self.shard_ids})")
        index = self.shard_ids.index(shard_id)
        return index, self.shard_ranges[index][1]

    def set_slot(
        self, slot: int, weights: dict[Hashable, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Put an adapter's (A [r, in], B [size, r]) per shard into `slot`; shards it does
        not adapt get zeros."""
        rank, shards = self.manager.max_rank, len(self.shard_ids)
        self.lora_a[slot * shards * rank : (slot + 1) * shards * rank].zero_()
        for index in range(shards):
            self.lora_b[index][:, slot * rank : (slot + 1) * rank].zero_()
        for shard_id, (a, b) in weights.items():
            index, _ = self.shard_of(shard_id)
            r = a.shape[0]
            row0 = (slot * shards + index) * rank
            self.lora_a[row0 : row0 + r].copy_(a)
            self.lora_b[index][:, slot * rank : slot * rank + r].copy_(b * scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.manager.mask
        if mask is None:  # no token of this batch has an adapter
            return y
        lo, hi = self.manager.slot_range
        rank, shards, n = self.manager.max_rank, len(self.shard_ids), x.shape[0]
        a = self.lora_a[lo * shards * rank : (hi + 1) * shards * rank]
        h = x @ a.T
        if self.tp is not None:  # (a row-parallel base: this rank's columns' partial sums)
            h = self.tp.all_reduce(h)
        h = h.view(n, hi + 1 - lo, shards, rank) * mask.view(n, hi + 1 - lo, 1, rank)
        for index, (offset, size) in enumerate(self.shard_ranges):
            b = self.lora_b[index][:, lo * rank : (hi + 1) * rank]
            y[:, offset : offset + size] += h[:, :, index].reshape(n, -1) @ b.T
        return y
