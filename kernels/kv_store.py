"""Write the new tokens' K and V into the paged pool: `k_buffer[loc[t]] = k[t]` (same for v).

Pool layout (engine/mem_cache/kv_pool.py): `k_buffer` is [num_slots, num_kv_heads, head_dim],
contiguous, so one slot is one row of `num_kv_heads * head_dim` elements. The inputs k, v are
[num_tokens, num_kv_heads, head_dim] with a contiguous last axis but any token / head strides
(they are usually column slices of a fused qkv projection).

Kernel grid: (num_tokens, cdiv(num_kv_heads * head_dim, BLOCK)); each program copies one block
of one token's row for K and for V, casting to the pool's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import cdiv, launch_opts, next_pow2, pdl_prologue
from kernels.reference import as_heads


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_buf_ptr,
    v_buf_ptr,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    row_len,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_len
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    slot = tl.load(loc_ptr + token).to(tl.int64)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(k_buf_ptr + slot * row_len + offs, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + slot * row_len + offs, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int = 256,
) -> None:
    """k_buffer/v_buffer [num_slots, H, D] contiguous; loc [N] int; k/v [N, H, D] or
    [N, H * D]. Reference: `kernels.reference.store_kv_ref`."""
    num_slots, num_heads, head_dim = k_buffer.shape
    k = as_heads(k, num_heads, head_dim)
    v = as_heads(v, num_heads, head_dim)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    assert k_buffer.is_contiguous() and v_buffer.is_contiguous()
    row_len = num_heads * head_dim
    block = min(block, next_pow2(row_len))
    grid = (num_tokens, cdiv(row_len, block))
    _store_kv_kernel[grid](
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        row_len,
        HEAD_DIM=head_dim,
        BLOCK=block,
        **launch_opts(4),
    )  # fmt: skip
