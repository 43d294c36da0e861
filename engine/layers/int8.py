"""`Int8Linear`: W8A8 in integers, as compressed-tensors' "int-quantized" W8A8 checkpoints store
it (llm-compressor's W8A8 scheme, the `*-quantized.w8a8` models; vLLM's and SGLang's
`compressed-tensors` method on int8 activations): the weight is int8 with a scale per output
channel, and each input row is quantized to int8 as it comes (a scale per token: its largest
magnitude / 127, rounded to nearest even and clamped to [-128, 127], as vLLM's
`scaled_int8_quant`). y = (x_q @ w_q.T) * s_x * s_w (+ bias).

The matmul: on CUDA `torch._int_mm` (int8 x int8 -> int32; its rows padded past 16, as it
needs), or for one row a GEMV (`int8_gemv`: the same integers and epilogue, to the bit, in
one launch after the row's quantization), elsewhere the same integers multiplied in float32
(exact while a row's sum of products stays below 2^24, which covers the test models; large
layers round there as the GPU's float epilogue would).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.int_weight import PackedIntWeight
from engine.layers.parallel import QuantizedLinearBase, take_split
from kernels.int_gemm import pack_int
from kernels.jit import HAS_TRITON, interpreting


@dataclass
class Int8Weight:
    """A checkpoint's int8 weight [N, K] with its scale per output channel [N] (float32)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __getitem__(self, rows: slice | torch.Tensor) -> Int8Weight:
        return replace(self, data=self.data[rows], scale=self.scale[rows])

    def narrow(self, dim: int, start: int, length: int) -> Int8Weight:
        """Rows, or columns (a row's scale holds for any part of it)."""
        if dim == 0:
            return self[start : start + length]
        return replace(self, data=self.data.narrow(1, start, length))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale.float()[:, None]).to(dtype)

    def as_packed(self) -> PackedIntWeight:
        """The same integers in the integer layers' layout (`kernels.int_gemm`: four a word,
        offset by 128, a scale per row): how a W8A8 checkpoint's MoE experts are kept
        (`engine.layers.int_experts`, 16-bit activations)."""
        n, k = self.data.shape
        ints = self.data.to(torch.int32) + 128
        words = pack_int(F.pad(ints, (0, -k % 4), value=128), 8)
        return PackedIntWeight(words, self.scale.reshape(n, 1), None, 8, k, k)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows of x [M, K], their float32 scales [M]): each row's largest magnitude maps to
    127; zero rows get scale 1."""
    x = x.float()
    scale = x.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale


def int8_gemv(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One quantized row q [1, K] (its scale [1]) times the int8 weight [N, K] (scales [N])
    as a GEMV (`kernels.fp8_gemm.fp8_gemv`'s int8 mode): `int8_linear`'s result, bit for bit,
    in one launch where `torch._int_mm` pads the row to 17 and scales in more."""
    from kernels.fp8_gemm import fp8_gemv

    return fp8_gemv(q, scale.view(1, 1), weight, weight_scale.view(-1, 1), (1, q.shape[1]), bias,
                    out_dtype, int8=True)  # fmt: skip


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (any float dtype) times the int8 weight [N, K] with scales [N], W8A8 -> [M, N]
    in x's dtype. (On CUDA the rows are quantized in one Triton launch, bit for bit.)"""
    if x.is_cuda and HAS_TRITON and not interpreting():
        from kernels.fp8_gemm import quantize_rows_int8_triton

        q, scale = quantize_rows_int8_triton(x)
    else:
        q, scale = quantize_rows_int8(x)
    m, n = q.shape[0], weight.shape[0]
    if m == 1 and x.is_cuda and HAS_TRITON and not interpreting():  # (batch-1 decode)
        return int8_gemv(q, scale, weight, weight_scale, bias, x.dtype)
    if q.is_cuda and q.shape[1] % 8 == 0 and n % 8 == 0:
        rows = max(m, 17)  # (_int_mm takes more than 16 rows)
        padded = F.pad(q, (0, 0, 0, rows - m)) if rows > m else q
        acc = torch._int_mm(padded, weight.t())[:m].float()
    else:
        acc = q.float() @ weight.float().t()
    y = acc * scale[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Int8Linear(QuantizedLinearBase):
    """y = W8A8(x, weight) + bias; `shards` as `MergedLinear`'s (stacked q/k/v, gate/up), else
    one output block. `weight` is the int8 matrix (a parameter, loaded and checked like any
    weight), `weight_scale` a float32 buffer [out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        shards: Sequence[tuple[Hashable, int]] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8),
                                   requires_grad=False)  # fmt: skip
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self._init_outputs(out_features, bias, shards)

    @classmethod
    def like(cls, linear: nn.Linear) -> Int8Linear:
        """An empty layer of `linear`'s shape, shards and split part, on its device."""
        shards = getattr(linear, "shard_ranges", None)
        with torch.device(linear.weight.device):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        [(s, size) for s, (_, size) in shards.items()] if shards else None)
        take_split(layer, linear)
        return layer

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, W8A8 int8"

    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor | Int8Weight, shard_id: Hashable
    ) -> None:
        """Shard `shard_id`'s rows of the weight (and scales) or of the bias; of a split
        layer, this rank's rows or columns."""
        weight = param is self.weight
        if weight and not isinstance(loaded, Int8Weight):
            raise ValueError(f"shard {shard_id!r}: the checkpoint's weight is not int8 with "
                             f"scales (a {loaded.dtype} tensor) but the config says it "
                             "is")  # fmt: skip
        offset, size, loaded = self._rank_part(loaded, shard_id, weight)
        if not weight:
            param.data.narrow(0, offset, size).copy_(loaded)
            return
        assert isinstance(loaded, Int8Weight)
        self.weight.data.narrow(0, offset, size).copy_(loaded.data)
        self.weight_scale.narrow(0, offset, size).copy_(loaded.scale.reshape(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        bias = None if self.tp is not None else self.bias
        y = int8_linear(x.reshape(-1, shape[-1]), self.weight, self.weight_scale, bias)
        if self.tp is not None:  # (row-parallel: the ranks' partial sums, then the bias)
            y = self.tp.all_reduce(y)
            y = y if self.bias is None else y + self.bias
        return y.view(*shape[:-1], self.out_features)
