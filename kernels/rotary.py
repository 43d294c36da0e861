"""Rotary position embedding ("rotate half", GPT-NeoX layout) in one kernel.

Layout (engine/layers/rotary.py): `cos_sin_cache` [max_position, head_dim] holds
`cat(cos, sin)` per position in the model dtype; x [num_tokens, num_heads, head_dim] has a
contiguous last axis and any token / head strides (q and k as a column slice of a fused qkv).
The first and second halves of each head are the two coordinates of each rotated pair:

    out[..., :half] = x1 * cos - x2 * sin,   out[..., half:] = x2 * cos + x1 * sin

computed in float32 from the cache's values, rounding each product and the result to the
output dtype as `engine.layers.rotary.rotate_torch` (the reference) and transformers do op by
op in the model dtype, bit for bit, into a new contiguous [num_tokens, num_heads, head_dim]
tensor. (The first fused version rounded once: more exact, but on the H100 it lowered the
bf16 random models' teacher-forced agreement with transformers from 0.93 to 0.88.)

Kernel grid: (num_tokens, cdiv(num_heads, BLOCK_H)); each program rotates BLOCK_H heads of
one token as a [BLOCK_H, BLOCK_D] tile per half (BLOCK_D = next power of two of half).

With `kv_store` (x is q and k stacked, k from head `q_heads` on) the same kernel also writes
the new tokens' K/V into the paged pool, as `kernels.kv_store.store_kv` would after it: the
rotated K (the values it returns, cast to the pool's dtype) and V (another [tokens, kv_heads,
head_dim] view) at slot `loc[t]` of `k_buffer` / `v_buffer` ([num_slots, kv_heads, head_dim],
contiguous). One launch a layer instead of two; the attention backend then skips its store
(`AttentionBackend.kv_store_target`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.jit import HAS_TRITON, cdiv, launch_opts, next_pow2, tl, triton
from kernels.reference import as_heads


class KVStore(NamedTuple):
    """Where `apply_rotary` also writes K (its heads from `q_heads` on) and `v`."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor
    v: torch.Tensor
    q_heads: int


TILE = 2048  # elements of one half-tile: BLOCK_H * BLOCK_D
_DROP_BITS = {torch.bfloat16: 16, torch.float16: 13}  # float32's mantissa bits they lack

if HAS_TRITON:
    from kernels.jit import pdl_prologue

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
        v_ptr,
        stride_vt,
        stride_vh,
        k_buf_ptr,
        v_buf_ptr,
        loc_ptr,
        q_heads,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DROP: tl.constexpr,
        MIN_NORMAL: tl.constexpr,
        STORE_KV: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
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
        # each product rounded to the output dtype, then their sum: the reference's (and
        # transformers') op-by-op rounding (see `_round`)
        x1c, x2s = _round(x1 * cos, DROP, MIN_NORMAL), _round(x2 * sin, DROP, MIN_NORMAL)
        x2c, x1s = _round(x2 * cos, DROP, MIN_NORMAL), _round(x1 * sin, DROP, MIN_NORMAL)
        # (the sums rounded here too: the conversion is then exact, also in the interpreter,
        # which truncates to bfloat16)
        out1 = _round(x1c - x2s, DROP, MIN_NORMAL).to(ty)
        out2 = _round(x2c + x1s, DROP, MIN_NORMAL).to(ty)
        tl.store(dst, out1, mask=mask)
        tl.store(dst + HALF, out2, mask=mask)
        if STORE_KV:
            # the K heads (from q_heads on) of this block, and the V heads of the same index
            kv_mask = mask & (heads >= q_heads)[:, None]
            kv_head = tl.maximum(heads - q_heads, 0)[:, None]
            slot = tl.load(loc_ptr + token).to(tl.int64)
            row = (slot * (num_heads - q_heads) + kv_head) * (2 * HALF) + dims[None, :]
            buf_ty = k_buf_ptr.dtype.element_ty
            tl.store(k_buf_ptr + row, out1.to(buf_ty), mask=kv_mask)
            tl.store(k_buf_ptr + row + HALF, out2.to(buf_ty), mask=kv_mask)
            v_src = v_ptr + token * stride_vt + kv_head * stride_vh + dims[None, :]
            v1 = tl.load(v_src, mask=kv_mask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0)
            tl.store(v_buf_ptr + row, v1.to(v_buf_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_buf_ptr + row + HALF, v2.to(v_buf_ptr.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _round(v, DROP: tl.constexpr, MIN_NORMAL: tl.constexpr):
        """float32 `v` rounded to nearest (ties to even) at `DROP` mantissa bits fewer (16:
        bfloat16, 13: float16's normal range, below MIN_NORMAL a plain conversion; 0: as is),
        still as float32. With integer ops: on the H100, `v.to(bf16).to(float32)` around a
        product let LLVM narrow it to a bf16 multiply and contract that with the sum into one
        FMA, rounding once (a quarter of the results differed from torch's by an ulp)."""
        r = v
        if DROP > 0:
            u = v.to(tl.uint32, bitcast=True)
            u = ((u + ((1 << (DROP - 1)) - 1) + ((u >> DROP) & 1)) >> DROP) << DROP
            r = tl.where(v != v, v, u.to(tl.float32, bitcast=True))  # (NaN stays NaN)
            if MIN_NORMAL > 0:
                r = tl.where(tl.abs(v) < MIN_NORMAL, v.to(tl.float16).to(tl.float32), r)
        return r


def apply_rotary(
    positions: torch.Tensor,
    x: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    kv_store: KVStore | None = None,
) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] at positions [num_tokens] (int) with the
    [max_position, head_dim] cos/sin table; returns a new contiguous tensor. With `kv_store`,
    also write the rotated K and V into the pool (see the module docstring)."""
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
    if kv_store is None:
        v, k_buf, v_buf, loc, q_heads = x, out, out, positions, num_heads
    else:
        k_buf, v_buf, loc, v, q_heads = kv_store
        kv_heads = num_heads - q_heads
        assert 0 < kv_heads and k_buf.shape[1:] == (kv_heads, head_dim), tuple(k_buf.shape)
        assert k_buf.is_contiguous() and v_buf.is_contiguous() and v_buf.shape == k_buf.shape
        v = as_heads(v, kv_heads, head_dim)
        assert v.shape == (num_tokens, kv_heads, head_dim)
        assert loc.shape == (num_tokens,), (tuple(loc.shape), num_tokens)
    _rotary_kernel[grid](
        x, positions, cos_sin_cache, out,
        x.stride(0), x.stride(1), cos_sin_cache.stride(0), num_heads,
        v, v.stride(0), v.stride(1), k_buf, v_buf, loc, q_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        DROP=_DROP_BITS.get(dtype, 0),
        MIN_NORMAL=2.0**-14 if dtype == torch.float16 else 0.0,
        STORE_KV=kv_store is not None,
        **launch_opts(4),
    )  # fmt: skip
    return out
