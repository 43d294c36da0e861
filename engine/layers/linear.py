"""A linear layer whose output rows are several checkpoint matrices stacked together.

`qkv_proj` holds q_proj, k_proj and v_proj, `gate_up_proj` holds gate_proj and up_proj, so
each costs one matmul. Shard `s` occupies output rows `[offset_s, offset_s + size_s)` of the
weight (and of the bias) in the order the shards were declared; the loader fills each from
its own checkpoint tensor through `load_shard`.

`use_triton_gemv` (`--gemv-backend triton`) sends the inputs of a few rows (decode at small
batch) of every `nn.Linear` / `MergedLinear` of a model, and its lm_head matmul, to the Triton
GEMV (`kernels/gemv.py`) instead of cuBLAS; larger inputs still take `F.linear`. Modules that
call the GEMV themselves say so with a `gemv_max_rows` attribute (0: off), which it sets: the
lm_head's `LogitsProcessor`; Llama's MLP, whose down projection computes the SiLU-and-mul as it
loads its input; Llama's decoder layer, whose residual add and RMSNorm run in the prologue of
the qkv and gate_up projections' GEMV (`norm_gemv`).
"""

from __future__ import annotations

import types
from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import kernels.gemv
from engine.layers.layernorm import RMSNorm
from kernels.gemv import RMSNormInput


def shard_ranges(shards: Sequence[tuple[Hashable, int]]) -> dict[Hashable, tuple[int, int]]:
    """Each shard's (first output row, rows), stacked in the order given."""
    ranges, offset = {}, 0
    for shard_id, size in shards:
        ranges[shard_id] = (offset, size)
        offset += size
    return ranges


class MergedLinear(nn.Linear):
    """`sources` (tensor parallelism: a column-parallel layer, engine/layers/parallel.py): per
    shard, the (first row, rows, all rows) of its checkpoint tensor that this rank holds;
    default all of it."""

    def __init__(
        self,
        in_features: int,
        shards: Sequence[tuple[Hashable, int]],
        bias: bool = False,
        sources: dict[Hashable, tuple[int, int, int]] | None = None,
    ) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias=bias)
        self.shard_ranges = shard_ranges(shards)
        self.output_sizes = [size for _, size in shards]
        self.sources = sources or {}

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable) -> None:
        """Copy one checkpoint tensor (weight or bias of shard `shard_id`) into its rows."""
        offset, size = self.shard_ranges[shard_id]
        if shard_id in self.sources:
            start, rows, total = self.sources[shard_id]
            if loaded.shape[0] != total:
                raise ValueError(
                    f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not have "
                    f"the {total} rows expected"
                )
            loaded = loaded.narrow(0, start, rows)
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not match "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)


def resolve_gemv_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`gemv_backend` "auto": the Triton GEMV for a 16-bit model on CUDA where Triton
    compiles, "torch" (cuBLAS) elsewhere: on the CPU the GEMV would run in the interpreter,
    and only 16-bit weights were measured (benchmarks/results/gpu_gemv.json,
    gpu_decode_bs1_ab2.json: Llama-3.2-1B's batch-1 decode 1.07x faster on it on the H100).
    A named backend is kept."""
    if name != "auto":
        return name
    from kernels.jit import HAS_TRITON, interpreting

    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    on_gpu = device.type == "cuda" and HAS_TRITON and not interpreting()
    return "triton" if on_gpu and sixteen_bit else "torch"


def use_triton_gemv(model: nn.Module, max_rows: int) -> int:
    """Route inputs of 1..max_rows rows of the model's plain linear layers (and of the modules
    with a `gemv_max_rows` attribute: the lm_head matmul, Llama's fused activation and down
    projection) through `kernels.gemv.gemv`; returns how many linear layers now do. Quantized
    layers (`Fp8Linear`) keep their own kernels: one row on their float8 GEMV."""
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, MergedLinear):
            module.gemv_max_rows = max_rows
            module.forward = types.MethodType(_small_rows_forward, module)
            count += 1
        elif hasattr(module, "gemv_max_rows"):
            module.gemv_max_rows = max_rows
    return count


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether `kernels.gemv.gemv` takes x @ weight.T: 1..max_rows rows of weight's dtype."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= max_rows
        and x.dtype == weight.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def _small_rows_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if gemv_fits(x, self.weight, self.gemv_max_rows):
        return kernels.gemv.gemv(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, linear: nn.Linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual) with the add and the RMSNorm (Llama's:
    `norm`'s weight and eps) computed in the prologue of the linear layer's Triton GEMV; the first
    layer has no residual: (linear(norm(x)), x). For inputs `gemv_fits` takes."""
    weight, eps = norm.weight, norm.eps
    if residual is None:
        out = kernels.gemv.gemv(x, linear.weight, linear.bias, norm=RMSNormInput(weight, eps))
        return out, x
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    norm_in = RMSNormInput(weight, eps, residual, summed)
    return kernels.gemv.gemv(x, linear.weight, linear.bias, norm=norm_in), summed
