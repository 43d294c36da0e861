"""W8A8 int8 at one row (batch-1 decode): y = (x_q @ w_q.T) * s_x * s_w (+ bias) as a GEMV.

`engine.layers.int8.int8_linear` multiplies more rows with `torch._int_mm`, which takes more
than 16 of them: one row is padded to 17, and its int32 result is scaled in separate
launches. Here a program owns BLOCK_N weight rows and walks K BLOCK_K columns a step,
multiplying the int8 row by each int8 weight tile into an int32 accumulator (exact, as
`_int_mm`'s), summed once at the end; the epilogue is `int8_linear`'s float32 arithmetic in
its order ((sum * s_x) * s_w, then the bias), so the result is the GEMM path's to the bit.
The tiles are the float8 GEMV's (`kernels.gemv.gemv_config`: 1-byte weights too).
"""

from __future__ import annotations

import torch

from kernels.jit import HAS_TRITON, pdl_prologue, tl, triton

if HAS_TRITON:

    @triton.jit
    def _int8_gemv_kernel(
        q_ptr,
        w_ptr,
        w_s_ptr,
        bias_ptr,
        y_ptr,
        x_scale_ptr,
        N,
        K,
        stride_wn,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            k_mask = cols < K
            q = tl.load(q_ptr + cols, mask=k_mask, other=0).to(tl.int32)
            w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
            acc += w.to(tl.int32) * q[None, :]
        s_w = tl.load(w_s_ptr + offs_n, mask=n_mask, other=0.0)
        y = (tl.sum(acc, axis=1).to(tl.float32) * tl.load(x_scale_ptr)) * s_w
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def int8_gemv(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """q [1, K] int8 (its scale `x_scale` [1] float32) times the int8 weight [N, K] with
    float32 scales [N] (+ bias) -> [1, N] in `out_dtype`."""
    from kernels.gemv import one_row_launch

    m, k = q.shape
    n = weight.shape[0]
    assert m == 1 and q.stride(1) == 1 and weight.stride(1) == 1, "int8_gemv: one row"
    y = torch.empty(1, n, dtype=out_dtype, device=q.device)
    grid, opts = one_row_launch(n, k)
    _int8_gemv_kernel[grid](
        q, weight, weight_scale, bias if bias is not None else y, y, x_scale, n, k,
        weight.stride(0), HAS_BIAS=bias is not None, **opts,
    )  # fmt: skip
    return y
