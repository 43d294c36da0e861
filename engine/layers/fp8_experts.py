"""Mixture-of-experts weights kept in float8 (an FP8 checkpoint whose experts are quantized:
Qwen3-30B-A3B-FP8, DeepSeek-V3's, GLM-4.5's; or `--quantization fp8` on a 16-bit one,
`Fp8ExpertWeights.quantize`), at a byte per weight as vLLM and SGLang keep them.

`Fp8ExpertWeights` replaces a `FusedMoE`'s `ExpertWeights` (engine/layers/moe.py): expert e's
[out, in] matrix is `weight[e]` (float8_e4m3fn) and `weight_scale[e]` [out, cdiv(in, group)]
(float32) its multipliers, a scale per row and per `group` input columns. A block checkpoint's
scales (one per 128 x 128 block) are held per row, repeated over the block's rows, so the
stacked gate and up projections keep their own whatever their sizes, and so do a per-tensor
checkpoint's (group: the whole row); that costs 4 / group bytes a weight (3 % at 128).

`Fp8Experts` is what the compute takes: on CUDA the grouped GEMMs of `kernels.fused_moe`
multiply each float8 tile by its scales in registers, with the activations in 16 bits (the
experts run as W8A16: vLLM's FP8 MoE quantizes the activations per token and 128 columns too;
the grouped GEMMs here have no float8-activation path); elsewhere `fused_experts_torch`
dequantizes each expert it runs (`Fp8Experts[e]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.fp8 import FP8_DTYPE, QuantizedWeight
from engine.layers.moe import ExpertWeights
from kernels.fp8_gemm import quantize_groups
from kernels.jit import cdiv


@dataclass(frozen=True)
class Fp8Experts:
    """Every expert's float8 weight `data` [E, N, K] and its scales `scale` [E, N,
    cdiv(offset + K, group)] (float32); dequantized in `dtype` (the model's). `offset`: a
    rank's part of the columns (tensor parallelism) that starts `offset` columns into its
    first scale block."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype
    offset: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantized(self) -> torch.Tensor:
        """Every expert's weight [E, N, K] in `dtype`."""
        k, o = self.data.shape[2], self.offset
        scale = self.scale.repeat_interleave(self.group, 2)[:, :, o : o + k]
        return (self.data.float() * scale).to(self.dtype)

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight [N, K], dequantized in `dtype`."""
        k, o = self.data.shape[2], self.offset
        scale = self.scale[expert].repeat_interleave(self.group, 1)[:, o : o + k]
        return (self.data[expert].float() * scale).to(self.dtype)


def row_scales(weight: QuantizedWeight, group: int) -> torch.Tensor:
    """A checkpoint matrix's scales as [N, cdiv(K, group)] float32: a block checkpoint's
    (blocks of `group` columns) repeated over each block's rows, a per-tensor one over all."""
    n, k = weight.shape
    scale = weight.scale.float()
    if weight.block is None:  # (one per tensor)
        if scale.numel() != 1:
            raise ValueError(f"an FP8 expert's per-tensor scale has {scale.numel()} values")
        return scale.reshape(1, 1).expand(n, cdiv(k, group)).contiguous()
    rows, cols = weight.block
    if cols != group or scale.shape != (cdiv(n, rows), cdiv(k, cols)):
        raise ValueError(f"an FP8 expert's block scales {tuple(scale.shape)} do not fit its "
                         f"{tuple(weight.shape)} weight in {rows} x {cols} blocks")  # fmt: skip
    return scale.repeat_interleave(rows, 0)[:n]


class Fp8ExpertWeights(ExpertWeights):
    """`ExpertWeights` in float8 with a scale per row and per `group` input columns (a block
    checkpoint's block width; a per-tensor one's: the whole row)."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        shards: Sequence[tuple[str, int]],
        group: int | None,
        dtype: torch.dtype = torch.float32,
        split: tuple[int, int, int, int] | None = None,
        experts: tuple[int, int] | None = None,
    ) -> None:
        self.group, self.dtype = int(group) if group else in_features, dtype
        # (a rank's part of the down projection's columns may start inside a scale block)
        self.offset = split[1] % self.group if group and split and split[0] == 1 else 0
        super().__init__(num_experts, in_features, shards, split, experts)

    def _init_weights(self) -> None:
        e, n, k = self.num_local, self.out_features, self.in_features
        self.weight = nn.Parameter(torch.empty(e, n, k, dtype=FP8_DTYPE), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(e, n, cdiv(self.offset + k, self.group)))

    @classmethod
    def like(cls, experts: ExpertWeights, block: tuple[int, int] | None) -> Fp8ExpertWeights:
        """Empty float8 experts of `experts`' shape, shards and parallel split, on its device
        (a rank's part of the down projection's columns may cut the checkpoint's blocks: it
        keeps the scales of the blocks it overlaps)."""
        split = experts.split
        group = block[1] if block else None
        with torch.device(experts.weight.device):
            return cls(
                experts.num_local, experts.in_features, experts.shards, group,
                dtype=experts.weight.dtype, split=split,
                experts=(experts.first, experts.total) if experts.num_local < experts.total
                else None,
            )  # fmt: skip

    @classmethod
    def quantize(cls, experts: ExpertWeights) -> Fp8ExpertWeights:
        """`experts` quantized (`--quantization fp8` on a 16-bit checkpoint): float8 with a
        scale per row, as the dense layers' online FP8 (vLLM's online FP8 MoE takes one per
        tensor); expert by expert, so the float32 copy is one expert's."""
        layer = cls.like(experts, None)
        for e in range(experts.num_local):
            q, scale = quantize_groups(experts.weight.data[e], 1, experts.in_features)
            layer.weight.data[e].copy_(q)
            layer.weight_scale[e].copy_(scale)
        return layer

    def extra_repr(self) -> str:
        return (f"experts={self.num_local}, in={self.in_features}, out={self.out_features}, "
                f"float8, scale per row and {self.group} columns")  # fmt: skip

    def operand(self) -> Fp8Experts:
        return Fp8Experts(self.weight, self.weight_scale, self.group, self.dtype, self.offset)

    def load_shard(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor | QuantizedWeight,
        shard_id: tuple[int, str],
    ) -> None:
        rows = self._quantized_rows(loaded, QuantizedWeight, shard_id)
        if rows is None:
            return
        expert, offset, size = rows
        # (whole matrices first: the scales per row, then this rank's part of both)
        scale = row_scales(loaded, self.group)
        data = loaded.data
        if self.split is not None:
            data = self._part(data, shard_id)
            dim, start, length, _ = self.split
            if dim == 0:
                scale = scale.narrow(0, start, length)
            else:
                scale = scale[:, start // self.group : cdiv(start + length, self.group)]
        if data.shape != (size, self.in_features):
            raise ValueError(f"expert shard {shard_id!r}: checkpoint shape "
                             f"{tuple(data.shape)} does not match expected "
                             f"{(size, self.in_features)}")  # fmt: skip
        self.weight.data[expert].narrow(0, offset, size).copy_(data)
        self.weight_scale[expert].narrow(0, offset, size).copy_(scale)
