"""Paged decode attention (one query token per request), flash-decoding style in two stages.

Inputs: q [B, Hq, D]; the layer's pool k_buffer / v_buffer [num_slots, Hk, D]; request i's
keys are slots `req_to_token[req_pool_indices[i], :seq_lens[i]]` (any page size: slots are
read per token). Reference: `kernels.reference.decode_attention_ref`.

Stage 1, grid (B, Hk, num_splits): request i's keys are cut into `num_splits` chunks of
`split_len = roundup(cdiv(seq_len, num_splits), BLOCK_N)` keys; a program attends the
`group = Hq // Hk` query heads of one KV head (padded to BLOCK_H >= 16 rows so that `tl.dot`
runs on tensor cores) over one chunk, BLOCK_N keys at a time with an online softmax
(`kernels.attention_common.attend_paged_keys`, shared with the extend kernel's prefix), and
writes the chunk's normalised output `mid_o` [B, Hq, num_splits, D] (float32) and its
log2-sum-exp `mid_lse` [B, Hq, num_splits] (float32). Chunks past seq_len (short requests)
write nothing.

Given the new tokens' K/V (`new_kv`), the program whose chunk ends at seq_len writes its KV
head's row of them into the pool first (a barrier, then it reads its keys, the new one
included): no separate store launch.

Stage 2, grid (B, Hq): merges the non-empty chunks of one (request, head) by their
log-sum-exp weights into `out` [B, Hq, D]. Or, given `merge_counter`, inside stage 1: every
program of a (request, KV head) adds one to its count (atomically, acquire-release, after a
barrier that puts the program's stores first), and the one that completes it merges the
group's heads from the other programs' chunks and zeroes the count: one launch a layer instead
of two (the merge kernel cost ~2.6 us plus a launch gap a layer on the H100).

Scores use exp2 with log2(e) folded into the scale. The split count is fixed per call (not
per request), so the launch shape depends on B only, as CUDA graphs need; `kv_splits_for` is
how the Triton backend picks it from the batch size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_common import attend_paged_keys, sink_log2
from kernels.jit import (
    LOG2E,
    compute_dtype,
    dot_dtype,
    dot_precision,
    launch_opts,
    next_pow2,
    pdl_prologue,
)
from kernels.reference import as_heads


@triton.jit
def _first_key(seq_len, WINDOW_LEFT: tl.constexpr):
    """The first key the last query sees: 0, or with a sliding window (WINDOW_LEFT >= 0) the
    first of its last WINDOW_LEFT + 1 keys."""
    if WINDOW_LEFT >= 0:
        return tl.maximum(seq_len - 1 - WINDOW_LEFT, 0)
    return 0


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    counter_ptr,
    k_new_ptr,
    v_new_ptr,
    loc_ptr,
    sinks_ptr,
    stride_qb,
    stride_qh,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_buf_s,
    stride_buf_h,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    FUSE_MERGE: tl.constexpr,
    STORE_KV: tl.constexpr,
    SINKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    lo = _first_key(seq_len, WINDOW_LEFT)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        row = tl.load(req_pool_indices_ptr + req).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + offs_h
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        if STORE_KV:
            if end == seq_len:  # the chunk that holds the new token: its K/V into the pool
                slot = tl.load(loc_ptr + req).to(tl.int64)
                buf_off = slot * stride_buf_s + kv_head * stride_buf_h + offs_d
                r = req.to(tl.int64)
                new_k = tl.load(k_new_ptr + r * stride_knb + kv_head * stride_knh + offs_d,
                                mask=mask_d)  # fmt: skip
                new_v = tl.load(v_new_ptr + r * stride_vnb + kv_head * stride_vnh + offs_d,
                                mask=mask_d)  # fmt: skip
                tl.store(k_buf_ptr + buf_off, new_k.to(k_buf_ptr.dtype.element_ty), mask=mask_d)
                tl.store(v_buf_ptr + buf_off, new_v.to(v_buf_ptr.dtype.element_ty), mask=mask_d)
                tl.debug_barrier()  # the key blocks below read the slot back
        q_off = req.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        q = q.to(DOT_DTYPE)
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        m_i, l_i, acc = attend_paged_keys(
            q, m_i, l_i, acc, k_buf_ptr, v_buf_ptr, req_to_token_ptr, row, stride_r2t,
            stride_buf_s, stride_buf_h, kv_head, start, end, scale_log2, offs_d, mask_d, 0,
            BLOCK_N, False, LOGIT_CAP, DOT_DTYPE, PRECISION,
        )  # fmt: skip
        mid_row = req.to(tl.int64) * stride_mob + heads * stride_moh + split * stride_mos
        out_mask = mask_h[:, None] & mask_d[None, :]
        tl.store(mid_o_ptr + mid_row[:, None] + offs_d[None, :], acc / l_i[:, None], mask=out_mask)
        lse_off = req.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(mid_lse_ptr + lse_off, m_i + tl.log2(l_i), mask=mask_h)
    if FUSE_MERGE:
        # Every program of the (request, KV head) counts itself in, empty chunks included;
        # the last one merges. The barrier puts all of this program's stores before the
        # count's release (one thread performs a scalar atomic); acquire on the count, then
        # loads that bypass L1, read the chunks other SMs wrote.
        tl.debug_barrier()
        count_ptr = counter_ptr + req * tl.num_programs(1) + kv_head
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") == NUM_SPLITS - 1:
            _merge_group(
                mid_o_ptr, mid_lse_ptr, out_ptr, sinks_ptr, req.to(tl.int64), kv_head * GROUP,
                seq_len - lo, split_len, stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
                stride_ob, stride_oh, GROUP, HEAD_DIM, NUM_SPLITS, SINKS, BLOCK_H, BLOCK_D,
                BLOCK_S,
            )  # fmt: skip
            tl.store(count_ptr, 0)  # zero again for the next launch (the next layer, a replay)


@triton.jit
def _merge_group(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    sinks_ptr,
    req,
    first_head,
    span,
    split_len,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SINKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Stage 2 for the GROUP heads of one KV head, inside the last stage-1 program: the
    merge kernel's weights (chunk log-sum-exps against their maximum, empty chunks out),
    summed one chunk at a time; with SINKS each head's sink joins the denominator."""
    offs_h = tl.arange(0, BLOCK_H)
    heads = first_head + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_S)
    used = (offs_s < NUM_SPLITS) & (offs_s * split_len < span)
    lse_row = req * stride_lb + heads * stride_lh
    lse = tl.load(
        mid_lse_ptr + lse_row[:, None] + offs_s[None, :],
        mask=mask_h[:, None] & used[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    top = tl.where(mask_h, tl.max(lse, 1), 0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    mid_row = req * stride_mob + heads * stride_moh
    for s in range(0, NUM_SPLITS):
        # (a vector compare: the interpreter cannot mask with a block & a scalar)
        ok = mask_h & (tl.full([BLOCK_H], s, tl.int32) * split_len < span)
        lse_s = tl.load(
            mid_lse_ptr + lse_row + s, mask=ok, other=float("-inf"), cache_modifier=".cg"
        )
        weight = tl.exp2(lse_s - top)
        part = tl.load(
            mid_o_ptr + (mid_row + s * stride_mos)[:, None] + offs_d[None, :],
            mask=ok[:, None] & mask_d[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += weight[:, None] * part
        den += weight
    if SINKS:
        den += tl.exp2(sink_log2(sinks_ptr, heads, mask_h) - top)
    out_off = req * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    out = acc / tl.where(den > 0, den, 1.0)[:, None]  # padded heads, empty requests: zeros
    tl.store(
        out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :]
    )


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    span = seq_len - _first_key(seq_len, WINDOW_LEFT)
    split_len = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    used = (offs_s < NUM_SPLITS) & (offs_s * split_len < span)
    lse_off = req * stride_lb + head * stride_lh + offs_s
    lse = tl.load(mid_lse_ptr + lse_off, mask=used, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - top)
    mid_off = req * stride_mob + head * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :]
    mid_mask = used[:, None] & (offs_d < HEAD_DIM)[None, :]
    part = tl.load(mid_o_ptr + mid_off, mask=mid_mask, other=0.0)
    den = tl.sum(weight, 0)
    if SINKS:
        den += tl.exp2(sink_log2(sinks_ptr, head, True) - top)
    out = tl.sum(weight[:, None] * part, 0) / den
    out_off = req * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def split_warps(dtype: torch.dtype, block_d: int, num_splits: int = 8) -> int:
    """Warps of the stage-1 kernel. 4, except for float32 (ieee FMA dots, see
    `extend_attention.launch_config`) above head_dim 64: at 4 warps ptxas for sm_90a hit 255
    registers and spilled (triton 3.6 and 3.9); at 8 it uses 73-80 and spills nothing. At
    head_dim 256 8 warps spill again (255 registers, 28-56 B); 16 use 78. float32 at head_dim
    64 with more than 16 splits (batch 1's 32) spilled 4 B at 4 warps (triton 3.9): 8."""
    if dtype != torch.float32 or (block_d <= 64 and num_splits <= 16):
        return 4
    return 8 if block_d <= 128 else 16


def kv_splits_for(
    batch_size: int, num_kv_heads: int, num_sms: int, lo: int = 8, hi: int = 32
) -> int:
    """Stage-1 splits for a batch of `batch_size` requests: the largest power of two that keeps
    the grid (batch x KV heads x splits) within about two programs per SM, clamped to
    [lo, hi]. Batch 1 of Llama 3.2 1B (8 KV heads) on the H100's 132 SMs gets 32, batch 2
    16, batch 4 and more 8 (the fixed count before). A request's keys are cut into at most
    cdiv(seq_len, BLOCK_N) non-empty chunks whatever the count, so short contexts do the same
    work either way; long ones at small batch spread over more of the GPU."""
    room = max(1, 2 * num_sms // max(1, batch_size * num_kv_heads))
    return max(lo, min(hi, 1 << (room.bit_length() - 1)))


def decode_scratch(
    batch_size: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 buffers (mid_o, mid_lse) for a batch; reusable by every layer."""
    mid_o = torch.empty(batch_size, num_heads, num_splits, head_dim, device=device)
    mid_lse = torch.empty(batch_size, num_heads, num_splits, device=device)
    return mid_o, mid_lse


def merge_counters(batch_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The per-(request, KV head) counts of `decode_attention`'s fused merge: zeros, and
    zeros again after every call, so one buffer serves every layer, step and graph replay."""
    return torch.zeros(batch_size * num_kv_heads, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 8,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    window_left: int = -1,
    logit_cap: float = 0.0,
    merge_counter: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> out [B, Hq, D] (q's dtype); a float8 pool's values are read as stored
    (`scale` includes its k_scale, the caller applies v_scale). `scratch` from
    `decode_scratch` (with the same num_splits) avoids two allocations per call.
    `window_left` >= 0: a sliding-window layer, each query sees its last window_left + 1 keys
    (split among the chunks: the window, not the whole context, is what the splits cut).
    `logit_cap` > 0: scores s = scale * q.k become logit_cap * tanh(s / logit_cap) (one
    compiled variant per cap).
    `merge_counter`: int32 zeros, at least B x Hk of them (`merge_counters`), reusable by
    every call: the last stage-1 program of each (request, KV head) merges its chunks and
    zeroes its count again, one launch instead of two. None: the merge kernel.
    `new_kv` (k, v, loc): the batch's new tokens' K/V ([B, Hk, D] or [B, Hk * D], any row
    stride) not yet in the pool; the program whose chunk holds a request's last key writes
    them at `loc` [B] (as `kernels.kv_store.store_kv` would, cast to the pool's dtype) before
    it reads its keys, which saves the store's launch.
    `sinks` [Hq] (gpt-oss's attention sinks): each head's logit joins its softmax's
    denominator, applied once, where the splits are merged."""
    batch_size, num_heads, head_dim = q.shape
    _, num_kv_heads, _ = k_buffer.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_buffer.is_contiguous() and v_buffer.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    if batch_size == 0:
        return out
    mid_o, mid_lse = scratch or decode_scratch(
        batch_size, num_heads, head_dim, num_splits, q.device
    )
    block_d = next_pow2(head_dim, 16)
    dtype = compute_dtype(q.dtype, k_buffer.dtype)
    fuse = merge_counter is not None
    if fuse:
        assert merge_counter.dtype == torch.int32 and merge_counter.is_contiguous()
        assert merge_counter.numel() >= batch_size * num_kv_heads, "merge_counter too short"
    if new_kv is not None:
        k_new, v_new, loc = new_kv
        k_new = as_heads(k_new, num_kv_heads, head_dim)
        v_new = as_heads(v_new, num_kv_heads, head_dim)
        assert k_new.shape[0] == batch_size and k_new.stride(-1) == 1 and v_new.stride(-1) == 1
    else:
        k_new = v_new = k_buffer  # (unread)
        loc = seq_lens
    _decode_split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        merge_counter if fuse else seq_lens, k_new, v_new, loc,
        sinks if sinks is not None else seq_lens,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        WINDOW_LEFT=window_left,
        LOGIT_CAP=logit_cap * LOG2E,
        FUSE_MERGE=fuse,
        STORE_KV=new_kv is not None,
        SINKS=sinks is not None,
        BLOCK_H=next_pow2(group, 16),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_S=next_pow2(num_splits),
        DOT_DTYPE=dot_dtype(dtype),
        PRECISION=dot_precision(dtype),
        **launch_opts(split_warps(dtype, block_d, num_splits)),
    )  # fmt: skip
    if fuse:
        return out
    _decode_merge_kernel[(batch_size, num_heads)](
        mid_o, mid_lse, seq_lens, out, sinks if sinks is not None else seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        WINDOW_LEFT=window_left,
        SINKS=sinks is not None,
        BLOCK_S=next_pow2(num_splits),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **launch_opts(4),
    )  # fmt: skip
    return out
