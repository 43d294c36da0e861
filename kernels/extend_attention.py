"""Extend (prefill) attention: packed new tokens over a cached prefix plus themselves, causal.

Token layout as in ForwardBatch: request i owns the packed rows
`extend_start_loc[i] .. extend_start_loc[i] + extend_lens[i] - 1` of q [N, Hq, D] and of the new
k/v [N, Hk, D]; it also has `prefix_lens[i]` cached tokens whose K/V sit in the pool
k_buffer / v_buffer [num_slots, Hk, D] at slots `req_to_token[req_pool_indices[i], :prefix]`.
New token t (0-based) sees every prefix token and new tokens 0..t (in a sliding-window layer,
`window_left` >= 0, only those at positions >= its own minus window_left). Reference:
`kernels.reference.extend_attention_ref`.

Grid (B, Hq, cdiv(max_extend_len, BLOCK_M)): a program owns BLOCK_M new tokens of one request
and one query head. It first streams the prefix, BLOCK_N keys at a time gathered through
req_to_token with no mask but the prefix length (`kernels.attention_common.attend_paged_keys`,
the same loop as decode's), then the new tokens' own K/V read contiguously from k/v up to the
block's last row (causal mask), with an online softmax in float32 (exp2, log2(e) folded into
the scale). Programs past a request's extend length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_common import attend_paged_keys, sink_log2, soft_cap
from kernels.jit import (
    LOG2E,
    cdiv,
    compute_dtype,
    dot_dtype,
    dot_precision,
    launch_opts,
    next_pow2,
    pdl_prologue,
)
from kernels.reference import as_heads


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    k_buf_ptr,
    v_buf_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    start_loc_ptr,
    sinks_ptr,
    tree_mask_ptr,
    mask_start_ptr,
    positions_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_buf_s,
    stride_buf_h,
    stride_r2t,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    SINKS: tl.constexpr,
    TREE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(extend_lens_ptr + req).to(tl.int32)
    if m_start < extend_len:
        kv_head = head // GROUP
        prefix_len = tl.load(prefix_lens_ptr + req).to(tl.int32)
        start = tl.load(start_loc_ptr + req).to(tl.int64)
        row = tl.load(req_pool_indices_ptr + req).to(tl.int64)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend_len
        mask_d = offs_d < HEAD_DIM
        q_off = (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        q = q.to(DOT_DTYPE)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # cached prefix, gathered through req_to_token: every key is visible (in a sliding
        # window, key j to the query at position p iff j >= p - WINDOW_LEFT; blocks wholly
        # before the row block's window are skipped)
        prefix_start, own_start, row_lo = 0, 0, 0
        if WINDOW_LEFT >= 0 and TREE:
            # a tree's node sits at its depth's position, not at prefix_len + its row: the
            # window is by the tokens' positions (every row is at prefix_len or later)
            q_pos = tl.load(positions_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int32)
            row_lo = q_pos - WINDOW_LEFT
            prefix_start = tl.maximum(prefix_len - WINDOW_LEFT, 0)
        elif WINDOW_LEFT >= 0:
            row_lo = prefix_len + offs_m - WINDOW_LEFT
            prefix_start = tl.maximum(prefix_len + m_start - WINDOW_LEFT, 0)
            own_start = tl.maximum(m_start - WINDOW_LEFT, 0)
        m_i, l_i, acc = attend_paged_keys(
            q, m_i, l_i, acc, k_buf_ptr, v_buf_ptr, req_to_token_ptr, row, stride_r2t,
            stride_buf_s, stride_buf_h, kv_head, prefix_start, prefix_len, scale_log2, offs_d,
            mask_d, row_lo, BLOCK_N, WINDOW_LEFT >= 0, LOGIT_CAP, DOT_DTYPE, PRECISION,
        )  # fmt: skip

        # the new tokens themselves, contiguous in k/v: causal
        causal_end = tl.minimum(extend_len, m_start + BLOCK_M)
        for block_start in range(own_start, causal_end, BLOCK_N):
            pos = block_start + offs_n
            mask_n = pos < extend_len
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k_off = (start + pos)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
            k = tl.load(k_ptr + k_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if LOGIT_CAP > 0:
                qk = soft_cap(qk, LOGIT_CAP)
            visible = mask_n[None, :] & (pos[None, :] <= offs_m[:, None])
            if WINDOW_LEFT >= 0 and TREE:
                k_pos = tl.load(positions_ptr + start + pos, mask=mask_n, other=0).to(tl.int32)
                visible = visible & (k_pos[None, :] >= row_lo[:, None])
            elif WINDOW_LEFT >= 0:
                visible = visible & (pos[None, :] >= offs_m[:, None] - WINDOW_LEFT)
            if TREE:  # a draft tree: a node sees its ancestors only (row-major, its own mask)
                mask_start = tl.load(mask_start_ptr + req).to(tl.int64)
                m_off = mask_start + offs_m[:, None] * extend_len + pos[None, :]
                seen = tl.load(tree_mask_ptr + m_off, mask=mask_m[:, None] & mask_n[None, :],
                               other=0)  # fmt: skip
                # (rows past the request's tokens keep the causal mask: no row sees nothing)
                visible = visible & ((seen != 0) | (offs_m[:, None] >= extend_len))
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = (start + pos)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
            v = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
            pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SINKS:  # the head's sink: one more term of the softmax's denominator
            l_i += tl.exp2(sink_log2(sinks_ptr, head, True) - m_i)
        if WINDOW_LEFT >= 0:  # a padded row (past extend_len) may see no key in a window
            l_i = tl.where(mask_m, l_i, 1.0)
        out = acc / l_i[:, None]
        out_off = (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        out_mask = mask_m[:, None] & mask_d[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch_config(
    dtype: torch.dtype, block_d: int, tree_window: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for K/V of `dtype` and padded head size `block_d`;
    `tree_window`: draft trees in a sliding window (the tokens' positions held too).

    fp16/bf16 run both dots on tensor cores: 64 x 64 blocks, 4 warps up to head_dim 64, 8 above.

    float32 is the exactness path (`input_precision="ieee"`, no TF32), which Triton lowers to
    FMA loops that keep every thread's rows of the left operand and columns of the right one in
    registers. At 64 x 64 blocks that did not fit: ptxas for sm_90a spilled 8-11 KB of stack
    per thread. Head_dim 64 runs 32 x 64 blocks over 16 warps (58-62 registers, no spill). At
    head_dim 128 the same blocks compiled cleanly with triton 3.9 (74 registers) but not with
    the GPU machine's triton 3.6: its ptxas held GQA groups 4 and 8 at 64 registers and spilled
    2.6 KB. 16 x 32 blocks over 8 warps compile without spills under both (70-80 registers,
    every head shape of `python -m kernels.compile_check`). Smaller key blocks only change the
    order in which keys enter the online softmax (last-bit float32 differences).

    Head_dim 256 (Gemma 2 and 3) in fp16/bf16: 64 x 64 blocks over 8 warps hit 255 registers
    and, in the sliding-window variant, spilled 236 B (and took 224 KB of shared memory, near
    the 227 KB limit); 64 x 32 blocks use 195-212 registers, 128 KB, no spill (sm_90a, triton
    3.9). float32 keeps 16 x 32 over 8 warps there (95-147 registers, no spill).

    Draft trees in a sliding window hold each row's and key's position: in float32 at
    head_dim 64 the 32 x 64 blocks spilled 216 B (sm_90a, triton 3.9); they take 16 x 32
    blocks over 8 warps, as head_dim 128 does.
    """
    if dtype == torch.float32:
        return (32, 64, 16) if block_d <= 64 and not tree_window else (16, 32, 8)
    if block_d > 128:
        return 64, 32, 8
    return 64, 64, 4 if block_d <= 64 else 8


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]; k/v [N, Hk, D] or [N, Hk * D] (the new tokens, in the pool's dtype; a
    float8 cache's are read as stored, like its prefix: `scale` includes its k_scale);
    per-request tensors [B] on q's device; returns out [N, Hq, D] in q's dtype. Block sizes
    left at None come from `launch_config`. `window_left` >= 0: a sliding-window layer, the
    query at position p sees keys p - window_left .. p (blocks wholly before a row block's
    window are skipped). `logit_cap` > 0: scores s become logit_cap * tanh(s / logit_cap).
    `sinks` [Hq] (gpt-oss's): each head's logit joins its softmax as a key without a value.
    `tree_mask` (a verify step's draft trees, engine/speculative/tree.py): (masks, starts),
    request i's extend_lens[i]^2 uint8 mask row-major at masks[starts[i]:]; new token t sees
    new token u only where its row has a 1 at u. A tree in a sliding-window layer needs the
    tokens' `positions` [N] (a node's is the request's prefix length plus its depth): the
    window is by position."""
    if tree_mask is not None and window_left >= 0 and positions is None:
        raise ValueError("extend_attention: a draft tree in a sliding window needs positions")
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _ = k_buffer.shape
    k = as_heads(k, num_kv_heads, head_dim)
    v = as_heads(v, num_kv_heads, head_dim)
    assert q.stride(-1) == 1 and k_buffer.is_contiguous() and v_buffer.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    batch_size = extend_lens.shape[0]
    if num_tokens == 0 or batch_size == 0:
        return out
    block_d = next_pow2(head_dim, 16)
    dtype = compute_dtype(q.dtype, k_buffer.dtype)
    tree_window = tree_mask is not None and window_left >= 0
    default_m, default_n, num_warps = launch_config(dtype, block_d, tree_window)
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    grid = (batch_size, num_heads, cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k, v, out, k_buffer, v_buffer,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        sinks if sinks is not None else extend_lens,
        *(tree_mask if tree_mask is not None else (extend_lens, extend_lens)),
        positions if positions is not None else extend_lens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        req_to_token.stride(0),
        scale * LOG2E,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        WINDOW_LEFT=window_left,
        LOGIT_CAP=logit_cap * LOG2E,
        SINKS=sinks is not None,
        TREE=tree_mask is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype(dtype),
        PRECISION=dot_precision(dtype),
        **launch_opts(num_warps),
    )  # fmt: skip
    return out
