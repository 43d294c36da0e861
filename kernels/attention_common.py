"""Triton pieces shared by the attention kernels (decode_attention.py, extend_attention.py).

Jit functions called from a kernel are inlined into it, so a helper here costs nothing at run
time: the caller's loads, block shapes and dtypes are exactly what its own loop would have.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.jit import LOG2E

_TWO_LOG2E = tl.constexpr(2.0 * LOG2E)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def sink_log2(sinks_ptr, heads, mask):
    """The heads' attention sinks (gpt-oss's logits, natural-log units) in the kernels' log2
    units, as one more term of the softmax's denominator takes them: exp2(sink - max)."""
    return tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * _LOG2E


@triton.jit
def soft_cap(qk, CAP: tl.constexpr):
    """`CAP * tanh(qk / CAP)` (qk and CAP both in log2 units: a cap c on the scores s is
    CAP = c * log2(e) on s * log2(e)), never NaN.

    Written without libdevice's tanh, which the interpreter lacks: through exp2 where
    |qk / CAP| >= 1/8, where it loses only float32's absolute rounding (1e-7 of CAP), and as
    tanh's odd series to y^7 below (error under 2e-10), where that rounding would be large
    against the result (a cap far above the scores would otherwise blur all of them)."""
    y = qk * (1.0 / CAP)
    small = tl.abs(y) < 0.125
    ys = tl.where(small, y, 0.0)  # each branch sees only inputs it can take: no overflow
    y2 = ys * ys
    series = ys * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0 + y2 * (-17.0 / 315.0))))
    # exp2's argument stops at 64 (tanh is 1.0 in float32 long before)
    through_exp = 1.0 - 2.0 / (tl.exp2(tl.minimum(y * _TWO_LOG2E, 64.0)) + 1.0)
    return CAP * tl.where(small, series, through_exp)


@triton.jit
def attend_paged_keys(
    q,
    m_i,
    l_i,
    acc,
    k_buf_ptr,
    v_buf_ptr,
    req_to_token_ptr,
    row,
    stride_r2t,
    stride_buf_s,
    stride_buf_h,
    kv_head,
    start,
    end,
    scale_log2,
    offs_d,
    mask_d,
    row_lo,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Folds keys `start .. end - 1` of one request into the online-softmax state and returns
    the updated `(m_i, l_i, acc)`.

    q [ROWS, BLOCK_D] in DOT_DTYPE; m_i (running max, log2 units) and l_i (running sum) [ROWS],
    acc [ROWS, BLOCK_D], all float32 and unnormalised (the caller divides acc by l_i). Key j
    lives at pool slot `req_to_token[row, j]`, head `kv_head`, of k_buf / v_buf
    [num_slots, Hk, D]. Every key in the range is visible to every query row (no causal
    mask); `scale_log2` is scale * log2(e). Keys are read BLOCK_N at a time from `start`; the
    last block is masked at `end`. WINDOWED (a sliding-window layer whose rows see different
    ranges): key j is also hidden from row r when j < row_lo[r] ([ROWS] int32); otherwise
    row_lo is not read. LOGIT_CAP > 0 (log2 units): scores are soft-capped before the mask
    (`soft_cap`). A row that sees no key of a block keeps its state (its m_i stays above
    -inf, so exp2 of the masked scores is 0, never NaN).
    """
    offs_n = tl.arange(0, BLOCK_N)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + offs_n
        mask_n = pos < end
        # the row address stays inside the loop: hoisted, it changed the register allocation
        # (SASS) of the fp16/bf16 extend kernel on sm_90
        slots = tl.load(req_to_token_ptr + row * stride_r2t + pos, mask=mask_n, other=0)
        kv_off = (
            slots.to(tl.int64)[:, None] * stride_buf_s + kv_head * stride_buf_h + offs_d[None, :]
        )
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_buf_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if LOGIT_CAP > 0:
            qk = soft_cap(qk, LOGIT_CAP)
        if WINDOWED:
            qk = tl.where(mask_n[None, :] & (pos[None, :] >= row_lo[:, None]), qk, float("-inf"))
        else:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_buf_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc
