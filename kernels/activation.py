"""Fused activations of the MLP: SiLU-and-mul (Llama family) and GPT-2's tanh GELU.

`silu_and_mul(x)`: x [..., 2 * I] is a fused gate_up projection (gate first); the result
[..., I] is `silu(gate) * up` rounded as torch rounds it in x's dtype: `F.silu` computes in
float32 and rounds to the dtype, then the product is computed in float32 and rounded again.
Reference: `engine.layers.activation.silu_and_mul_torch`. The rows may be strided (contiguous
last axis); the output is a new contiguous tensor.
Kernel grid: (rows, cdiv(I, BLOCK)); each program handles BLOCK columns of one row.

`gelu_new(x)`: `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`, computed in float32 as
the identical `x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3))` and rounded once. The torch
reference (`engine.layers.activation.gelu_new`) rounds after every op in half precision, so
bf16/fp16 results differ from it by rounding only (float32 agrees to a few ulps).
Kernel grid: (cdiv(numel, BLOCK),) over the flattened contiguous tensor.
"""

from __future__ import annotations

import math

import torch

from kernels.jit import HAS_TRITON, cdiv, launch_opts, next_pow2, tl, triton

GELU_TANH_COEF = math.sqrt(2.0 / math.pi)

if HAS_TRITON:
    from kernels.jit import pdl_prologue

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * inter + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_new_kernel(x_ptr, out_ptr, numel, coef, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_prologue(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        inner = coef * (x + 0.044715 * x * x * x)
        # 0.5 * (1 + tanh(u)) == 1 / (1 + exp(-2u)); the clamp keeps exp finite (e^80 ~ 5e34,
        # so the result is ~0 there, as tanh's -1 makes it)
        out = x / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0)))
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:] as a new [..., I] tensor."""
    inter = x.shape[-1] // 2
    assert x.shape[-1] == 2 * inter, f"last dim {x.shape[-1]} is not even"
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, x.shape[-1])  # a view unless the leading dims cannot be merged
    block = min(block, next_pow2(inter))
    grid = (rows.shape[0], cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        rows, out, rows.stride(0), inter, BLOCK=block, **launch_opts(4 if block >= 512 else 1),
    )  # fmt: skip
    return out


def gelu_new(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """GPT-2's tanh GELU of x (any shape), a new contiguous tensor of x's dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return out
    block = min(block, next_pow2(numel))
    grid = (cdiv(numel, block),)
    _gelu_new_kernel[grid](
        x, out, numel, GELU_TANH_COEF, BLOCK=block, **launch_opts(4 if block >= 512 else 1),
    )  # fmt: skip
    return out
