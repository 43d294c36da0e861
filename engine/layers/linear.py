"""A linear layer whose output rows are several checkpoint matrices stacked together.

`qkv_proj` holds q_proj, k_proj and v_proj, `gate_up_proj` holds gate_proj and up_proj, so
each costs one matmul. Shard `s` occupies output rows `[offset_s, offset_s + size_s)` of the
weight (and of the bias) in the order the shards were declared; the loader fills each from
its own checkpoint tensor through `load_shard`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn


def shard_ranges(shards: Sequence[tuple[Hashable, int]]) -> dict[Hashable, tuple[int, int]]:
    """Each shard's (first output row, rows), stacked in the order given."""
    ranges, offset = {}, 0
    for shard_id, size in shards:
        ranges[shard_id] = (offset, size)
        offset += size
    return ranges


class MergedLinear(nn.Linear):
    def __init__(
        self, in_features: int, shards: Sequence[tuple[Hashable, int]], bias: bool = False
    ) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias=bias)
        self.shard_ranges = shard_ranges(shards)
        self.output_sizes = [size for _, size in shards]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable) -> None:
        """Copy one checkpoint tensor (weight or bias of shard `shard_id`) into its rows."""
        offset, size = self.shard_ranges[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)
