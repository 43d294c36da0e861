"""`Fp8Linear`: a linear layer whose weight is float8 (e4m3) with float32 block scales, and
whose input is quantized to float8 on the fly (W8A8, dynamic activation scales), as SGLang's
and vLLM's `Fp8LinearMethod`.

The weight's scales are per `group` = (rows, columns) block: the checkpoint's
`weight_block_size` (DeepSeek-style FP8 checkpoints: 128 x 128, activations then scaled per
token and 128 columns), or (1, in_features), one scale per output channel (what
`--quantization fp8` makes of a 16-bit checkpoint, and what a per-tensor scale becomes when
q, k and v with their own scales are stacked in one layer; activations then scaled per token).

The matmul: on CUDA, `torch._scaled_mm` (per-channel, bfloat16 output) or the Triton block
kernel (kernels/fp8_gemm.py), and one row (batch-1 decode) on the Triton float8 GEMV where
the model's GEMV backend is Triton (`gemv_max_rows`, the default for 16-bit models on CUDA);
elsewhere the same arithmetic in torch, activations quantized to float8 and back, so a CPU
run computes what the GPU does up to summation order.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.parallel import QuantizedLinearBase, take_split
from kernels.fp8_gemm import (
    FP8_DTYPE,
    dequantize_groups,
    fp8_gemm,
    fp8_gemm_reference,
    fp8_gemv,
    quantize_groups,
    quantize_rows,
)
from kernels.jit import HAS_TRITON, cdiv


@dataclass
class QuantizedWeight:
    """A checkpoint's float8 weight with its scale: one per tensor (shape [] or [1]), or one
    per `block` of a `weight_block_size` checkpoint."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_groups(self.data, self.scale, self.block, dtype)


class Fp8Linear(QuantizedLinearBase):
    """y = x @ dequant(weight).T + bias, computed in float8; `shards` as `MergedLinear`'s
    (the stacked projections: q/k/v, gate/up), else one output block."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: tuple[int, int] | None = None,
        shards: Sequence[tuple[Hashable, int]] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group = (1, in_features) if group is None else (int(group[0]), int(group[1]))
        gn, gk = self.group
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        scale = torch.empty(cdiv(out_features, gn), cdiv(in_features, gk), dtype=torch.float32)
        self.register_buffer("weight_scale", scale)
        self._init_outputs(out_features, bias, shards)

    @classmethod
    def like(cls, linear: nn.Linear, group: tuple[int, int] | None = None) -> Fp8Linear:
        """An empty layer of `linear`'s shape (and shards, and part of a split layer), on its
        device."""
        shards = getattr(linear, "shard_ranges", None)
        with torch.device(linear.weight.device):
            layer = cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                group,
                [(s, size) for s, (_, size) in shards.items()] if shards else None,
            )
        take_split(layer, linear)
        if layer.sources:  # (split: checked as the model is built, before anything loads)
            for shard_id, (offset, size) in layer.shard_ranges.items():
                layer._check_blocks(shard_id, offset, size)
        return layer

    def _check_blocks(self, shard_id: Hashable, offset: int, size: int) -> None:
        gn = self.group[0]
        if offset % gn or (size % gn and offset + size != self.out_features):
            split = " (this rank's part of it: choose a tp_size whose parts are)" if (
                self.sources) else ""  # fmt: skip
            raise ValueError(f"shard {shard_id!r}: rows {offset}..{offset + size} are not whole "
                             f"{self.group} scale blocks{split}")  # fmt: skip

    @classmethod
    def quantize(cls, linear: nn.Linear, group: tuple[int, int] | None = None) -> Fp8Linear:
        """`linear` quantized (`--quantization fp8` on a 16-bit checkpoint)."""
        layer = cls.like(linear, group)  # (of a split layer: its part, quantized as it is)
        layer.weight.data, layer.weight_scale = quantize_groups(linear.weight.data, *layer.group)
        if linear.bias is not None:
            layer.bias.data = linear.bias.data
        return layer

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group}"

    # -- loading ------------------------------------------------------------------------------
    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight, shard_id: Hashable
    ) -> None:
        """Fill shard `shard_id`'s rows of the weight (and their scales) or of the bias from a
        checkpoint tensor: float8 with its scale, requantized to this layer's blocks where
        the two differ, or a 16/32-bit tensor, quantized here. Of a split layer, this rank's
        rows or columns of it."""
        offset, size = self.shard_ranges[shard_id if self.merged else None]
        if self.sources and shard_id in self.sources:
            loaded = _part(loaded, 0, *self.sources[shard_id])
        if self.column_part is not None and param is self.weight:
            loaded = _part(loaded, 1, *self.column_part)
        if loaded.shape[0] != size or (
            param is self.weight and loaded.shape[1] != self.in_features
        ):
            expected = (size, self.in_features) if param is self.weight else (size,)
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"expected {expected}"
            )
        if param is not self.weight:
            param.data.narrow(0, offset, size).copy_(loaded)
            return
        gn = self.group[0]
        self._check_blocks(shard_id, offset, size)
        if isinstance(loaded, QuantizedWeight) and self._same_blocks(loaded):
            q, scale = loaded.data, loaded.scale.float()
            if loaded.block is None:  # the tensor's one scale, for each of its rows
                scale = scale.reshape(1, 1).expand(size, 1)
        else:
            full = (
                loaded.dequantize(torch.float32) if isinstance(loaded, QuantizedWeight) else loaded
            )
            q, scale = quantize_groups(full, *self.group)
        self.weight.data.narrow(0, offset, size).copy_(q)
        self.weight_scale.narrow(0, offset // gn, scale.shape[0]).copy_(scale)

    def _same_blocks(self, loaded: QuantizedWeight) -> bool:
        if loaded.block is None:  # one scale for the tensor: the same for each of its rows
            return self.group == (1, self.in_features) and loaded.scale.numel() == 1
        return tuple(loaded.block) == self.group

    # -- forward ------------------------------------------------------------------------------
    # Set by `engine.layers.linear.use_triton_gemv` (the model's `gemv_backend` is Triton):
    # inputs of one row go to the float8 GEMV when this is at least 1.
    gemv_max_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gemv = self.gemv_max_rows > 0
        if self.tp is not None:  # (row-parallel: the ranks' partial sums, then the bias)
            y = self.tp.all_reduce(
                fp8_linear(x, self.weight, self.weight_scale, self.group, gemv=gemv)
            )
            y = y if self.bias is None else y + self.bias
        else:
            y = fp8_linear(x, self.weight, self.weight_scale, self.group, self.bias, gemv)
        return y.view(*shape[:-1], self.out_features)


def _part(
    loaded: torch.Tensor | QuantizedWeight, dim: int, start: int, length: int, full: int
) -> torch.Tensor | QuantizedWeight:
    """`length` rows (dim 0) or columns (dim 1) of a checkpoint tensor from `start`, of the
    `full` it must have. A float8 weight keeps its scales where the part is whole scale blocks;
    otherwise it is dequantized (and quantized again by the layer)."""
    if loaded.shape[dim] != full:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} has not {full} in dim {dim}")
    if not isinstance(loaded, QuantizedWeight):
        return loaded.narrow(dim, start, length)
    data = loaded.data.narrow(dim, start, length)
    if loaded.block is None:  # (one scale for the tensor)
        return QuantizedWeight(data, loaded.scale, None)
    block = loaded.block[dim]
    if start % block == 0 and (length % block == 0 or start + length == full):
        scale = loaded.scale.narrow(dim, start // block, cdiv(length, block))
        return QuantizedWeight(data, scale, loaded.block)
    return loaded.dequantize(torch.float32).narrow(dim, start, length)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    group: tuple[int, int],
    bias: torch.Tensor | None = None,
    gemv: bool = False,
) -> torch.Tensor:
    """x [M, K] in bf16/fp16/fp32 -> [M, N] in x's dtype; activations quantized per row and
    `group[1]` columns. `gemv`: one row goes to the Triton GEMV (`kernels.fp8_gemm.fp8_gemv`)."""
    n, k = weight.shape
    if x.is_cuda and HAS_TRITON:  # one launch, bit for bit quantize_groups' (ten on CUDA)
        x_q, x_s = quantize_rows(x, group[1])
    else:
        x_q, x_s = quantize_groups(x, 1, group[1])
    if gemv and x.shape[0] == 1:
        return fp8_gemv(x_q, x_s, weight, weight_scale, group, bias, x.dtype)
    if x.is_cuda:
        if _scaled_mm_fits(x, group, n, k):
            return torch._scaled_mm(
                x_q, weight.t(), scale_a=x_s, scale_b=weight_scale.view(1, n),
                bias=bias, out_dtype=x.dtype,
            )  # fmt: skip
        if HAS_TRITON:
            return fp8_gemm(x_q, x_s, weight, weight_scale, group, bias, x.dtype)
    return fp8_gemm_reference(x_q, x_s, weight, weight_scale, group, bias, x.dtype)


def _scaled_mm_fits(x: torch.Tensor, group: tuple[int, int], n: int, k: int) -> bool:
    """Row-wise scaled `_scaled_mm` (cuBLASLt, sm89+): per-channel weights, bf16 output,
    dimensions multiples of 16."""
    return (
        group[0] == 1
        and group[1] >= k
        and x.dtype == torch.bfloat16
        and n % 16 == 0
        and k % 16 == 0
        and _capability(x.device.index) >= (8, 9)
    )


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
