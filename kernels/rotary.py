"""Rotary position embedding ("rotate half", GPT-NeoX layout) in one kernel.

Layout (engine/layers/rotary.py): `cos_sin_cache` [max_position, head_dim] holds
`cat(cos, sin)` per position in the model dtype; x [num_tokens, num_heads, head_dim] has a
contiguous last axis and any token / head strides (q and k as a column slice of a fused qkv).
The first and second halves of each head are the two coordinates of each rotated pair:

    out[..., :half] = x1 * cos - x2 * sin,   out[..., half:] = x2 * cos + x1 * sin

computed in float32 from the cache's values and rounded once into a new contiguous
[num_tokens, num_heads, head_dim] tensor. Reference: `engine.layers.rotary.rotate_torch`,
which rounds after every op in the model dtype, so half precision differs by rounding only.

Kernel grid: (num_tokens, cdiv(num_heads, BLOCK_H)); each program rotates BLOCK_H heads of
one token as a [BLOCK_H, BLOCK_D] tile per half (BLOCK_D = next power of two of half).
"""

from __future__ import annotations

import torch

from kernels.jit import HAS_TRITON, cdiv, launch_opts, next_pow2, tl, triton

TILE = 2048  # elements of one half-tile: BLOCK_H * BLOCK_D

if HAS_TRITON:

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        pos_ptr,
        cache_ptr,
        out_ptr,
        stride_xt,
        stride_xh,
        stride_cache,
        num_heads,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HALF
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dim_mask, other=0.0)
        sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=dim_mask, other=0.0)
        cos = cos.to(tl.float32)[None, :]
        sin = sin.to(tl.float32)[None, :]
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]
        src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + (token * num_heads + heads[:, None]) * (2 * HALF) + dims[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


def apply_rotary(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] at positions [num_tokens] (int) with the
    [max_position, head_dim] cos/sin table; returns a new contiguous tensor."""
    num_tokens, num_heads, dim = x.shape
    assert dim == head_dim and head_dim % 2 == 0, (dim, head_dim)
    assert cos_sin_cache.shape[-1] == head_dim, tuple(cos_sin_cache.shape)
    dtype = torch.promote_types(x.dtype, cos_sin_cache.dtype)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    half = head_dim // 2
    block_d = next_pow2(half)
    block_h = min(next_pow2(num_heads), max(1, TILE // block_d))
    grid = (num_tokens, cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        x, positions, cos_sin_cache, out,
        x.stride(0), x.stride(1), cos_sin_cache.stride(0), num_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        **launch_opts(4),
    )  # fmt: skip
    return out
