"""Rope over interleaved pairs (x0, x1), (x2, x3), ... (GPT-J's layout: DeepSeek, GLM-4,
ERNIE 4.5) served by the "rotate half" kernels, which rotate (x0, x_{d/2}), (x1, x_{d/2+1}), ...:
the rows of the projections that produce the rotated features are reordered at load to
[x0, x2, ...; x1, x3, ...]. Queries and keys are reordered alike, so every score is unchanged,
and nothing else reads those features in that order (a per-head q/k norm's weight is reordered
with them)."""

from __future__ import annotations

import torch

from engine.layers.fp8 import QuantizedWeight
from engine.layers.int_weight import PackedIntWeight


def deinterleave(tensor: object, name: str, block: int, start: int, size: int) -> object:
    """`deinterleave_rows` of a tensor, or of an FP8 checkpoint's weight, whose block scales
    stay valid where each head's rope rows lie in one block of rows (DeepSeek-V3's: 64 rows
    at 128 of each 192, in 128-row blocks)."""
    if isinstance(tensor, PackedIntWeight):  # (rows of words, scales, zeros: reordered alike)
        rows = torch.arange(tensor.shape[0])
        return tensor[deinterleave_rows(rows, block, start, size)]
    if not isinstance(tensor, QuantizedWeight):
        return deinterleave_rows(tensor, block, start, size)
    if tensor.scale.numel() > 1:
        rows = tensor.block[0] if tensor.block else 1
        for first in range(start, tensor.data.shape[0], block):
            if first // rows != (first + size - 1) // rows:
                raise ValueError(
                    f"weight {name!r}: the rope rows {first}..{first + size - 1} cross its "
                    f"{rows}-row scale blocks, so they cannot be reordered"
                )
    data = deinterleave_rows(tensor.data, block, start, size)
    return QuantizedWeight(data, tensor.scale, tensor.block)


def deinterleave_rows(tensor: torch.Tensor, block: int, start: int, size: int) -> torch.Tensor:
    """In each block of `block` rows, rows start .. start + size reordered from interleaved
    pairs (0, 1), (2, 3), ... to the evens then the odds."""
    blocks = tensor.reshape(-1, block, *tensor.shape[1:]).clone()
    part = blocks[:, start : start + size]
    blocks[:, start : start + size] = torch.cat((part[:, 0::2], part[:, 1::2]), dim=1)
    return blocks.reshape(tensor.shape)
