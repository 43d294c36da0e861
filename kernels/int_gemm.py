"""Weight-only integer GEMM (W4A16 / W8A16): y = x @ dequant(W).T, with W stored as
compressed-tensors' "pack-quantized" checkpoints store it.

Layout (llm-compressor's W4A16 / W8A16 schemes, the format of vLLM's and SGLang's
`compressed-tensors` method): the weight [N, K] of `bits`-bit integers q in
[-2^(bits-1), 2^(bits-1)) is stored as u = q + 2^(bits-1) packed densely along K into int32
words, element j of a word at bits j * bits (`32 // bits` elements a word, low bits first).
Each row has a scale per `group` columns ([N, K / group]; one group of K: per channel) and,
asymmetric, a zero point z per group (q - z then). So w = (u - offset - z) * scale.

Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): a program owns a BLOCK_M x BLOCK_N tile of y. Its
K loop loads BLOCK_K / (32 // bits) words per weight row, expands them to BLOCK_K integers
with shifts, applies the group's scale (and zero point; BLOCK_K divides the group, so one
group a step), and accumulates tl.dot(x, w.T) in float32. One row of x (decode at batch 1)
goes to `_int_gemv_kernel` instead: 4 weight rows a program (512 programs for 2048 outputs,
where the GEMM's 64-column tiles made 32), no MMA padded to 16 rows, each word loaded once.
Reference: `int_gemm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import (
    cdiv,
    dot_dtype,
    dot_precision,
    interpreting,
    launch_opts,
    next_pow2,
    pdl_prologue,
)


@triton.jit
def _int_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_ym,
    gidx_ptr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    GIDX: tl.constexpr = False,  # each column's scale group in gidx (any columns a step)
):
    pdl_prologue(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # each column's word and the bits of the word it sits at
    word = offs_k // PER_WORD
    shift = (offs_k % PER_WORD) * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // PER_WORD + word)[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0)  # fmt: skip
        u = (words >> shift[None, :]) & MASK  # [BLOCK_N, BLOCK_K] in 0 .. 2^bits - 1
        q = u - OFFSET
        if GIDX:  # (a scale and zero point gathered per column)
            g = tl.load(gidx_ptr + cols, mask=mask_k, other=0)[None, :]
            mask_s = mask_n[:, None] & mask_k[None, :]
            scale = tl.load(scale_ptr + offs_n[:, None] * stride_sn + g, mask=mask_s, other=0.0)
            if HAS_ZERO:
                z = tl.load(zero_ptr + offs_n[:, None] * stride_zn + g, mask=mask_s, other=0)
                q = q - z.to(tl.int32)
            w = q.to(tl.float32) * scale.to(tl.float32)
        else:
            g = k0 // GROUP
            scale = tl.load(scale_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
            if HAS_ZERO:
                z = tl.load(zero_ptr + offs_n * stride_zn + g, mask=mask_n, other=0)
                q = q - z[:, None]
            w = q.to(tl.float32) * scale.to(tl.float32)[:, None]
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _int_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    gidx_ptr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
    GIDX: tl.constexpr = False,  # each column's scale group in gidx
):
    """One row of x: a program owns BLOCK_N weight rows and walks K BLOCK_W words at a time.
    Each word is loaded once and expanded into its 32 // BITS integers along a third axis;
    its group's scale (and zero point) is gathered per word (a group is whole words). The
    [BLOCK_N, BLOCK_W, PER_WORD] float32 products are summed once at the end, as the 16-bit
    GEMV (kernels/gemv.py) sums its one-row tiles: no MMA padded to 16 rows."""
    pdl_prologue(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    MASK: tl.constexpr = (1 << BITS) - 1
    GROUP_WORDS: tl.constexpr = GROUP // PER_WORD
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, PER_WORD)
    mask_n = offs_n < N
    words_k = K // PER_WORD
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = scale_ptr + offs_n[:, None] * stride_sn
    z_rows = zero_ptr + offs_n[:, None] * stride_zn
    shifts = (offs_j * BITS)[None, None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_W, PER_WORD), dtype=tl.float32)
    for w0 in range(0, words_k, BLOCK_W):
        cols = w0 + offs_w
        mask_w = cols < words_k
        mask = mask_n[:, None] & mask_w[None, :]
        words = tl.load(w_rows + cols[None, :], mask=mask, other=0)
        q = ((words[:, :, None] >> shifts) & MASK) - OFFSET  # [BLOCK_N, BLOCK_W, PER_WORD]
        x = tl.load(x_ptr + cols[:, None] * PER_WORD + offs_j[None, :], mask=mask_w[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
        if GIDX:  # (each integer's own group: [1, BLOCK_W, PER_WORD])
            g = tl.load(gidx_ptr + cols[:, None] * PER_WORD + offs_j[None, :],
                        mask=mask_w[:, None], other=0)[None, :, :]  # fmt: skip
            mask3 = mask[:, :, None]
            scale3 = tl.load(s_rows[:, :, None] + g, mask=mask3, other=0.0).to(tl.float32)
            if HAS_ZERO:
                q = q - tl.load(z_rows[:, :, None] + g, mask=mask3, other=0).to(tl.int32)
            acc += (q.to(tl.float32) * scale3) * x[None, :, :]
        else:
            g = (cols // GROUP_WORDS)[None, :]
            scale = tl.load(s_rows + g, mask=mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                q = q - tl.load(z_rows + g, mask=mask, other=0).to(tl.int32)[:, :, None]
            acc += (q.to(tl.float32) * scale[:, :, None]) * x[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_config(k: int, bits: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_W, num_warps) of the one-row kernel: the 16-bit GEMV's one-row tile
    (kernels/gemv.py's `gemv_config`: 4 rows a program, 1024 columns a step, 2048 from K =
    8192, 4 warps), in words."""
    block_k = min(next_pow2(k, 16), 2048 if k >= 8192 else 1024)
    return 4, block_k // (32 // bits), 4


def launch_config(m: int, dtype: torch.dtype, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): 16-row tiles for decode-sized inputs, 64 for
    prefills; BLOCK_K at most the group (one scale a step) and 64; float32 (the exactness
    path, FMA loops) in 32 x 32 tiles."""
    block_k = 64 if group % 64 == 0 else 32 if group % 32 == 0 else 16
    if dtype == torch.float32:
        return 16 if m <= 16 else 32, 32, min(block_k, 32), 4
    return (16, 64, block_k, 4) if m <= 16 else (64, 64, block_k, 4)


def int_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    gemv: bool = True,
    gidx: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times the packed weight [N, K * bits / 32] int32 with
    `scale` [N, K / group] and `zero` [N, K / group] int (asymmetric) or None -> [M, N] in
    x's dtype. `group` must be a multiple of 16 (and divide K). One row goes to the GEMV
    kernel unless `gemv` is false. `gidx` [K] int32: column k's scale and zero point are
    those of group gidx[k] (scales [N, any groups]; a row-parallel part of a weight with
    activation ordering), any group; K whole words."""
    m, k = x.shape
    n = packed.shape[0]
    if gidx is not None:
        if k % (32 // bits) or gidx.shape != (k,):
            raise ValueError(f"int_gemm: K {k} must be whole words with a group index of K")
    elif group % 16 or k % group:
        raise ValueError(f"int_gemm: group {group} must be a multiple of 16 dividing K {k}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if m == 1 and gemv:
        block_n, block_w, num_warps = gemv_config(k, bits)
        opts = launch_opts(num_warps)
        if not interpreting():
            opts["num_stages"] = 2
        _int_gemv_kernel[(cdiv(n, block_n),)](
            x, packed, scale, zero if zero is not None else scale,
            bias if bias is not None else scale, y, n, k, packed.stride(0), scale.stride(0),
            zero.stride(0) if zero is not None else 0, gidx if gidx is not None else scale,
            GROUP=group, BITS=bits, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
            BLOCK_N=block_n, BLOCK_W=block_w, GIDX=gidx is not None, **opts,
        )  # fmt: skip
        return y
    block_m, block_n, block_k, num_warps = launch_config(m, x.dtype,
                                                         64 if gidx is not None else group)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _int_gemm_kernel[grid](
        x, packed, scale, zero if zero is not None else scale,
        bias if bias is not None else scale, y,
        m, n, k, x.stride(0), packed.stride(0), scale.stride(0),
        zero.stride(0) if zero is not None else 0, y.stride(0),
        gidx if gidx is not None else scale,
        GROUP=group, BITS=bits, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype), PRECISION=dot_precision(x.dtype), GIDX=gidx is not None,
        **launch_opts(num_warps),
    )  # fmt: skip
    return y


def unpack_int(
    packed: torch.Tensor, bits: int, columns: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """[R, ceil(columns * bits / 32)] int32 words -> [R, columns] int32 of 0 .. 2^bits - 1
    (bits 4 or 8: whole elements a word, element j of a word at its j-th `bits` bits, low
    first; `order`: at its order[j]-th instead, AutoAWQ's interleaved layout)."""
    per_word = 32 // bits
    slots = range(per_word) if order is None else order
    shifts = torch.tensor([s * bits for s in slots], dtype=torch.int32, device=packed.device)
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return u.reshape(packed.shape[0], -1)[:, :columns]


def pack_int(
    values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """`unpack_int`'s inverse: [R, C] integers of 0 .. 2^bits - 1 (C whole words) -> [R, C *
    bits / 32] int32 (the fields do not overlap: their sum is their bitwise or)."""
    per_word = 32 // bits
    rows, cols = values.shape
    v = values.to(torch.int32).reshape(rows, cols // per_word, per_word)
    slots = range(per_word) if order is None else order
    shifts = torch.tensor([s * bits for s in slots], dtype=torch.int32, device=values.device)
    return (v << shifts).sum(-1, dtype=torch.int32)


def dequantize_int(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    columns: int,
    dtype: torch.dtype,
    gidx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight [N, columns] in `dtype`: (u - 2^(bits-1) - zero) * scale, group by group
    (`gidx`: column k's group is gidx[k])."""
    q = unpack_int(packed, bits, columns) - (1 << (bits - 1))

    def per_column(t: torch.Tensor) -> torch.Tensor:
        if gidx is not None:
            return t.index_select(1, gidx.to(device=t.device, dtype=torch.int64))
        return t.repeat_interleave(group, 1)[:, :columns]

    if zero is not None:
        q = q - per_column(zero.to(torch.int32))
    w = q.to(torch.float32) * per_column(scale.to(torch.float32))
    return w.to(dtype)


def int_gemm_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    gidx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int_gemm` in torch: the weight dequantized (float32), one matmul in x's dtype."""
    w = dequantize_int(packed, scale, zero, bits, group, x.shape[1], x.dtype, gidx)
    return torch.nn.functional.linear(x, w, bias)
