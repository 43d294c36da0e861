"""RMSNorm and LayerNorm, optionally fused with the residual add before them, one row per
program.

Op order is that of `engine.layers.layernorm.rms_norm` (the reference): upcast to float32,
mean of squares, `h * rsqrt(var + eps)`, round back to the input dtype, then multiply by the
weight in the dtype torch promotes `weight * h` to. `fused_add_rms_norm` first forms
`x + residual` rounded to its torch dtype (the new residual stream, also returned) and
normalises that rounded sum, as `RMSNorm.forward(x, residual)` does.

`layer_norm` / `fused_add_layer_norm` (GPT-2): `F.layer_norm`'s arithmetic, in float32 and
rounded once: mean, variance of the centred row, `(h - mean) * rsqrt(var + eps) * w + b`
(torch's CUDA kernel also computes in float32 from the rounded input and rounds once; its
mean and variance come from a Welford pass, so the two can differ in the last bit).

Layout: x [..., hidden] with a contiguous last axis. The leading dims are viewed as
[A, B] (e.g. tokens x heads for a per-head q/k norm read straight out of a fused qkv), each
with its own stride, so a column slice of a wider tensor is read in place. Outputs are new
contiguous tensors of x's shape.

Kernel grid: (A * B,); each program loads one whole row (BLOCK = next power of two of
hidden, at most MAX_HIDDEN), reduces it in registers and writes the normalised row (and the
new residual row).
"""

from __future__ import annotations

import torch

from kernels.jit import HAS_TRITON, launch_opts, next_pow2, tl, triton

MAX_HIDDEN = 16384

if HAS_TRITON:
    from kernels.jit import pdl_prologue

    @triton.jit
    def _norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        res_out_ptr,
        stride_xa,
        stride_xb,
        stride_ra,
        stride_rb,
        rows_b,
        hidden,
        eps,
        LAYER_NORM: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """RMSNorm (LAYER_NORM False) or LayerNorm of one row, the residual add first."""
        pdl_prologue(PDL)
        row = tl.program_id(0).to(tl.int64)
        a = row // rows_b
        b = row % rows_b
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
        # res_out_ptr is x_ptr itself without a residual: its element type is the input dtype
        in_ty = res_out_ptr.dtype.element_ty
        h = x.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + a * stride_ra + b * stride_rb + offs, mask=mask, other=0.0)
            summed = (h + r.to(tl.float32)).to(in_ty)
            tl.store(res_out_ptr + row * hidden + offs, summed, mask=mask)
            h = summed.to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if LAYER_NORM:
            mean = tl.sum(h, axis=0) / hidden
            centred = tl.where(mask, h - mean, 0.0)
            var = tl.sum(centred * centred, axis=0) / hidden
            y = centred * tl.math.rsqrt(var + eps) * w
            if HAS_BIAS:
                y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:  # Llama's order: normalise, round to the input dtype, then scale
            var = tl.sum(h * h, axis=0) / hidden
            y = w * (h * tl.math.rsqrt(var + eps)).to(in_ty).to(tl.float32)
        tl.store(out_ptr + row * hidden + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [A, B, hidden] with a contiguous last axis (a view where strides allow)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    layer_norm: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        name = "layer_norm" if layer_norm else "rms_norm"
        raise ValueError(f"{name} kernel supports hidden <= {MAX_HIDDEN}, got {hidden}")
    assert weight.shape == (hidden,), (tuple(weight.shape), hidden)
    assert bias is None or bias.shape == (hidden,), tuple(bias.shape)
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, in_dtype), device=x.device)
    new_res = None if residual is None else torch.empty(x.shape, dtype=in_dtype, device=x.device)
    if x.numel() == 0:
        return out, new_res
    x3 = _rows(x)
    r3 = x3 if residual is None else _rows(residual)
    assert r3.shape == x3.shape, (tuple(residual.shape), tuple(x.shape))
    block = next_pow2(hidden)
    _norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3, r3, weight, weight if bias is None else bias, out,
        x3 if new_res is None else new_res,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        x3.shape[1], hidden, eps,
        LAYER_NORM=layer_norm,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK=block,
        **launch_opts(_num_warps(block)),
    )  # fmt: skip
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., hidden] over the last dim; weight [hidden]. A new contiguous tensor.
    Reference: `engine.layers.layernorm.rms_norm`."""
    return _launch(x, None, weight, None, eps, layer_norm=False)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) as new tensors; x and residual are only read.
    Reference: `engine.layers.layernorm.RMSNorm.forward(x, residual)`."""
    out, new_res = _launch(x, residual, weight, None, eps, layer_norm=False)
    assert new_res is not None
    return out, new_res


def fused_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(layer_norm(x + residual), x + residual) as new tensors (x, residual only read);
    without a residual, (layer_norm(x), None). weight and bias [hidden] of x's dtype.
    Reference: `engine.layers.layernorm.LayerNorm`'s torch path (`F.layer_norm`)."""
    assert weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    return _launch(x, residual, weight, bias, eps, layer_norm=True)
