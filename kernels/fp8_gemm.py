"""W8A8 float8 GEMM with block scales: y = (a_q * a_s) @ (w_q * w_s).T (+ bias), as SGLang's
and vLLM's `w8a8_block_fp8_matmul` compute it for DeepSeek-style FP8 checkpoints.

* `a_q` [M, K] float8_e4m3fn activations, `a_s` [M, cdiv(K, group_k)] float32: one scale per
  row and group of `group_k` columns (`quantize_groups(x, 1, group_k)`, done per forward);
* `w_q` [N, K] float8_e4m3fn weights, `w_s` [cdiv(N, group_n), cdiv(K, group_k)] float32: one
  scale per `group_n` x `group_k` block (the checkpoint's `weight_block_size`).

Per-channel weights with per-token activations are the same with group_n = 1, group_k = K.
The kernel walks K in BLOCK_K steps that never straddle a group, multiplies the float8 tiles
(tensor cores on the GPU for 16-bit outputs, in float32 for float32 ones: `upcast`) and adds
each partial product times its row's activation scale and its column's weight scale.
`fp8_gemm_reference` is the same in torch. `fp8_gemv` takes one row: batch-1 decode, where
the GEMM's tiles leave most SMs idle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.jit import (
    HAS_TRITON,
    cdiv,
    interpreting,
    launch_opts,
    next_pow2,
    tl,
    triton,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12  # an all-zero group still gets a usable scale


def quantize_groups(
    x: torch.Tensor, group_rows: int, group_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8 [R, C], float32 scales [cdiv(R, group_rows), cdiv(C, group_cols)]) with
    x ~= q * scale of its block, each block's largest magnitude mapped to 448."""
    rows, cols = x.shape
    gr, gc = min(group_rows, rows), min(group_cols, cols)
    nr, nc = cdiv(rows, gr), cdiv(cols, gc)
    xf = x.float()
    if nr * gr != rows or nc * gc != cols:
        xf = F.pad(xf, (0, nc * gc - cols, 0, nr * gr - rows))
    blocks = xf.view(nr, gr, nc, gc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=_MIN_SCALE)
    # divided by a tensor: CUDA divides by a Python scalar as a multiplication by its
    # reciprocal, a scale an ulp off the CPU's, which flips float8 roundings of the values
    # (the same weights and activations quantized differently per device, seen on the H100)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nr * gr, nc * gc)[:rows, :cols]
    return q.contiguous(), scale


def dequantize_groups(
    q: torch.Tensor,
    scale: torch.Tensor,
    group: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q * its block's scale, in `dtype`, blocks of `group` = (rows, columns); None: one
    scale for the whole tensor, or one per row."""
    rows, cols = q.shape
    scale = scale.float().reshape(scale.shape if scale.dim() == 2 else (1, 1))
    if group is None:
        group = (cdiv(rows, scale.shape[0]), cols)
    gr, gc = min(group[0], rows), min(group[1], cols)
    if rows % gr == 0 and cols % gc == 0:  # whole blocks: a broadcast multiply
        blocks = q.to(dtype).view(rows // gr, gr, cols // gc, gc)
        return (blocks * scale.to(dtype)[:, None, :, None]).view(rows, cols)
    full = scale.repeat_interleave(gr, 0)[:rows].repeat_interleave(gc, 1)[:, :cols]
    return (q.float() * full).to(dtype)


def fp8_gemm_reference(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group: tuple[int, int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The kernel's result in torch: both operands dequantized (the weight's blocks are
    `group` = (group_n, group_k), the activations' groups (1, group_k)), one float32 matmul
    (transformers' arithmetic on dequantized weights, which the CPU tests compare against)."""
    a = dequantize_groups(a_q, a_s, (1, group[1]))
    y = a @ dequantize_groups(w_q, w_s, group).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


if HAS_TRITON:
    from kernels.jit import pdl_prologue

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr,
        a_s_ptr,
        w_ptr,
        w_s_ptr,
        bias_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_asm,
        stride_wn,
        stride_wsn,
        stride_cm,
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,  # multiply in float32 (`upcast`)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        a_s_ptrs = a_s_ptr + offs_m * stride_asm
        w_s_ptrs = w_s_ptr + (offs_n // GROUP_N) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            group = k0 // GROUP_K
            a_s = tl.load(a_s_ptrs + group, mask=m_mask, other=0.0)
            w_s = tl.load(w_s_ptrs + group, mask=n_mask, other=0.0)
            if UPCAST:
                part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, w)
            acc += part * a_s[:, None] * w_s[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def upcast(out_dtype: torch.dtype, block_k: int) -> bool:
    """Whether the kernel multiplies its float8 tiles in float32 (IEEE) rather than on the
    float8 tensor cores: in the interpreter, for K steps under 32 (the MMAs take steps of 32),
    and for float32 outputs, the exactness path (as attention's float32 dots). On the H100 a
    float32 model's FP8 layers on the float8 MMAs missed transformers' float32 W8A8 by a mean
    |delta logprob| of 0.22 (0.014 on the CPU, whose interpreter multiplies in float32):
    Hopper's float8 MMAs are known to accumulate with fewer bits than float32 (DeepSeek-V3's
    report: about 14), and every next layer's float8 rounding of its input magnifies that."""
    return interpreting() or block_k < 32 or out_dtype == torch.float32


def block_k_for(group_k: int, k: int) -> int | None:
    """The K step: at most 128, never straddling a scale group (None: no such power of two
    of at least 16, as `tl.dot` needs)."""
    if group_k >= k:
        return min(128, max(16, next_pow2(k)))
    step = min(128, group_k & -group_k)  # the largest power of two dividing group_k
    return step if step >= 16 else None


def fp8_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group: tuple[int, int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """As `fp8_gemm_reference`, in Triton: a_q [M, K], a_s [M, cdiv(K, group_k)], w_q [N, K],
    w_s [cdiv(N, group_n), cdiv(K, group_k)]."""
    m, k = a_q.shape
    n = w_q.shape[0]
    group_n, group_k = min(group[0], n), min(group[1], k)
    block_k = block_k_for(group_k, k)
    if block_k is None or a_s.shape[1] != w_s.shape[1]:
        raise ValueError(
            f"fp8_gemm: scale groups of {group_k} columns (activation groups "
            f"{a_s.shape[1]}, weight groups {w_s.shape[1]}) have no K step"
        )
    assert a_q.stride(1) == 1 and w_q.stride(1) == 1
    a_s, w_s = a_s.float().contiguous(), w_s.float().contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    block_m = 16 if m <= 16 else 64
    block_n = 64 if m <= 16 else 128
    slow = upcast(out_dtype, block_k)
    if slow and not interpreting():  # float32 tiles in registers: smaller ones (no spills)
        block_m, block_n, block_k = min(block_m, 32), 64, min(block_k, 32)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        a_q, a_s, w_q, w_s, bias if bias is not None else out, out,
        m, n, k, a_q.stride(0), a_s.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0),
        GROUP_N=group_n,
        GROUP_K=group_k if group_k < k else k + block_k,  # one group: every step is group 0
        HAS_BIAS=bias is not None,
        UPCAST=slow,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **launch_opts(4),
    )  # fmt: skip
    return out


# -- one row: the GEMV's reduction over float8 weights ----------------------------------------
if HAS_TRITON:

    @triton.jit
    def _fp8_gemv_kernel(
        a_ptr,
        a_s_ptr,
        w_ptr,
        w_s_ptr,
        bias_ptr,
        c_ptr,
        N,
        K,
        stride_wn,
        stride_wsn,
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
        INT8: tl.constexpr = False,
    ):
        """One program per BLOCK_N weight rows; a [BLOCK_N, BLOCK_K] float32 tile of products
        walks K and is summed once at the end (kernels/gemv.py's one-row reduction). Each
        product carries its activation group's and its weight block's scales, gathered per
        column, so a step may span scale groups. `INT8`: W8A8 int8 per token and channel
        (engine/layers/int8.py) instead: an int32 tile of the integers' products (exact, as
        `torch._int_mm`'s), then `int8_linear`'s float32 epilogue in its order, (sum * a_s) *
        w_s (+ bias): its result to the bit."""
        pdl_prologue(PDL)
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        w_s_rows = w_s_ptr + (offs_n // GROUP_N)[:, None] * stride_wsn
        if INT8:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            k_mask = cols < K
            mask = n_mask[:, None] & k_mask[None, :]
            if INT8:
                a = tl.load(a_ptr + cols, mask=k_mask, other=0).to(tl.int32)
                acc += tl.load(w_rows + cols[None, :], mask=mask, other=0).to(tl.int32) * a
            else:
                group = cols // GROUP_K
                a = tl.load(a_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
                a_s = tl.load(a_s_ptr + group, mask=k_mask, other=0.0)
                w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w_s = tl.load(w_s_rows + group[None, :], mask=mask, other=0.0)
                acc += (w * w_s) * (a * a_s)[None, :]
        if INT8:  # (one scale per row and per channel: GROUP_N 1, GROUP_K K)
            w_s = tl.load(w_s_ptr + offs_n * stride_wsn, mask=n_mask, other=0.0)
            y = (tl.sum(acc, axis=1).to(tl.float32) * tl.load(a_s_ptr)) * w_s
        else:
            y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + offs_n, y.to(c_ptr.dtype.element_ty), mask=n_mask)


def fp8_gemv(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group: tuple[int, int],
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    int8: bool = False,
) -> torch.Tensor:
    """`fp8_gemm` of one row (a_q [1, K]) as a GEMV: 4-row programs (768 for an N of 3072)
    where the GEMM's 64-column tiles gave 48 programs to 132 SMs, and no MMA padded to 16
    rows. Tiles: `kernels.gemv.gemv_config`'s one-row ones (the H100 sweep's, for 16-bit
    weights). Products in float32, as the reference's. `int8`: W8A8 int8 (int8 a_q and w_q,
    a scale per row and per channel: group (1, K)), `engine.layers.int8.int8_linear`'s
    arithmetic for one row."""
    from kernels.gemv import one_row_launch

    m, k = a_q.shape
    n = w_q.shape[0]
    assert m == 1, f"fp8_gemv: one row, not {m}"
    assert a_q.stride(1) == 1 and w_q.stride(1) == 1
    group_n, group_k = min(group[0], n), min(group[1], k)
    if a_s.shape[1] != w_s.shape[1] or w_s.shape[0] != cdiv(n, group_n):
        raise ValueError(f"fp8_gemv: scales {tuple(a_s.shape)} / {tuple(w_s.shape)} do not "
                         f"match groups {group} of a [{n}, {k}] weight")  # fmt: skip
    a_s, w_s = a_s.float().contiguous(), w_s.float().contiguous()
    out = torch.empty(1, n, dtype=out_dtype, device=a_q.device)
    grid, opts = one_row_launch(n, k)
    _fp8_gemv_kernel[grid](
        a_q, a_s, w_q, w_s, bias if bias is not None else out, out, n, k,
        w_q.stride(0), w_s.stride(0),
        GROUP_N=group_n, GROUP_K=group_k, HAS_BIAS=bias is not None, INT8=int8, **opts,
    )  # fmt: skip
    return out


# -- activations quantized in one launch (the GPU's per-forward `quantize_groups(x, 1, gc)`) --
QUANT_BLOCK = 1024  # columns a step: two passes over a group (its largest magnitude, then q)

if HAS_TRITON:
    _FP8_MAX_C, _MIN_SCALE_C = tl.constexpr(FP8_MAX), tl.constexpr(_MIN_SCALE)

    @triton.jit
    def _round_to_e4m3(v):
        """float32 v (|v| <= 448) rounded to the nearest float8 e4m3fn value, ties to even
        (torch's conversion), still in float32: the cast after it is then exact whatever
        rounding the cast has (the interpreter's truncates). Normal values keep 3 of their 23
        mantissa bits (integer rounding of the bit pattern); below 2^-6 the subnormals are
        multiples of 2^-9 (adding and taking away 1.5 * 2^23 rounds to an integer, to even);
        zeros keep their sign."""
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = (((bits + 0x7FFFF + lsb) >> 20) << 20).to(tl.float32, bitcast=True)
        subnormal = ((tl.abs(v) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign, of zero too
        return tl.where(tl.abs(v) < 0.015625, subnormal, normal)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
        INT8: tl.constexpr = False,
    ):
        """One program per (row, group of GROUP columns): quantize_groups' arithmetic to the
        bit (IEEE divisions, round-to-nearest-even float8 of the clamped quotient). `INT8`:
        engine.layers.int8.quantize_rows_int8's instead (largest magnitude / 127, 1 for a
        zero group; the quotient rounded half to even, clamped to [-128, 127])."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        group = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        q_row = q_ptr + row.to(tl.int64) * stride_qm
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, GROUP, BLOCK):
            cols = group * GROUP + c + offs
            mask = (c + offs < GROUP) & (cols < K)
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        if INT8:
            top = tl.max(amax, axis=0)
            scale = tl.where(top > 0, tl.math.div_rn(top, 127.0), 1.0)
        else:
            top = tl.maximum(tl.max(amax, axis=0), _MIN_SCALE_C)
            scale = tl.math.div_rn(top, _FP8_MAX_C)  # IEEE, as torch's division
        tl.store(s_ptr + row.to(tl.int64) * stride_sm + group, scale)
        for c in range(0, GROUP, BLOCK):
            cols = group * GROUP + c + offs
            mask = (c + offs < GROUP) & (cols < K)
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if INT8:  # (adding and taking away 1.5 * 2^23 rounds |v| < 2^22 to even)
                v = tl.math.div_rn(x, scale)
                v = tl.minimum(tl.maximum((v + 12582912.0) - 12582912.0, -128.0), 127.0)
                tl.store(q_row + cols, v.to(tl.int8), mask=mask)
            else:
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX_C), _FP8_MAX_C)
                tl.store(q_row + cols, _round_to_e4m3(q).to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.layers.int8.quantize_rows_int8` in one Triton launch, bit for bit: int8 rows
    and their float32 scales [M] (W8A8 int's per-token activations)."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(rows, cols, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows, 1)](
            x, q, scale, cols, x.stride(0), q.stride(0), scale.stride(0),
            GROUP=cols, BLOCK=min(QUANT_BLOCK, next_pow2(cols, 16)), INT8=True,
            **launch_opts(4),
        )  # fmt: skip
    return q, scale.view(rows)


def quantize_rows(x: torch.Tensor, group_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups(x, 1, group_cols)` in one Triton launch, bit for bit: per row and
    group of `group_cols` columns, float8 values and float32 scales. On the GPU the torch
    version is about ten kernels (the conversion, abs, amax, clamp, two divisions, the
    float8 cast...) per linear layer and forward: a thousand a decode step of an FP8
    Llama-3.2-1B, which the H100 measured at 0.55-0.58x of bf16's decode speed."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    gc = min(group_cols, cols)
    groups = cdiv(cols, gc)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    _quantize_rows_kernel[(rows, groups)](
        x, q, scale, cols, x.stride(0), q.stride(0), scale.stride(0),
        GROUP=gc, BLOCK=min(QUANT_BLOCK, next_pow2(gc, 16)), **launch_opts(4),
    )  # fmt: skip
    return q, scale
