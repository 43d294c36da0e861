"""Mixture-of-experts feed-forward as two grouped GEMMs (the GPU path of
`engine.layers.moe.fused_experts`; the torch loop there is the reference).

1. `moe_align`: the T * k (token, choice) pairs sorted by expert, each expert's run padded to
   a multiple of BLOCK_M with the sentinel T * k, so that every BLOCK_M rows belong to one
   expert. All in torch with shapes fixed by (T, k, E, BLOCK_M) and no host read, so the
   whole layer can be captured in a CUDA graph: the buffers are sized for the worst case
   (T * k + E * (BLOCK_M - 1) rows) and blocks past the padded total return at once.
2. `_grouped_gemm_kernel` (grid: row blocks x column blocks): a block loads its expert id and
   its BLOCK_M pair ids, gathers their A rows (token = pair // k for the first GEMM, the pair's
   own row for the second) and multiplies them by that expert's [N, K] weight; the second
   GEMM scales each row by its routing weight. Rows are written per pair: [T * k, N].
3. SiLU-and-mul between the two (or the model's activation: gpt-oss's clamped SwiGLU), and
   the sum over each token's k rows after, in torch.

Weights may be any strided [E, N, K] view, and each expert may have a bias (gpt-oss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.jit import cdiv, dot_dtype, dot_precision, launch_opts, pdl_prologue


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [capacity], expert of each BLOCK_M rows [capacity / block_m],
    padded total [1]) for `topk_ids` [T, k]. Padding rows hold T * k; blocks past the total
    hold expert id `num_experts`."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    capacity = num_pairs + num_experts * (block_m - 1)
    capacity = cdiv(capacity, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts  # of each expert's run in the sorted order
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - start[expert_sorted]
    dest = padded_end[expert_sorted] - padded[expert_sorted] + rank
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_ids, block_experts, padded_end[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    bias_ptr,
    routed_weight_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    total_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_cm,
    scale_ptr,
    zero_ptr,
    stride_se,
    stride_sn,
    cols_ptr,
    stride_ce,
    k_offset,  # (float8: a rank's columns start this far into their first scale group)
    A_ROWS_PER_PAIR: tl.constexpr,  # top_k for the first GEMM (rows of x), 1 for the second
    HAS_BIAS: tl.constexpr,  # the expert's bias [N], added before the routing weight
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    BITS: tl.constexpr = 0,  # integer weights (4 / 8; 0: the weights are floats)
    GROUP: tl.constexpr = 1,  # their (or float8 ones') columns per scale (BLOCK_K divides it)
    HAS_ZERO: tl.constexpr = False,  # their zero points (the scales' strides)
    FP8: tl.constexpr = False,  # float8 weights, a scale per row and GROUP columns
    # activation ordering (integer weights; cols [E, K]): weight column j is A's column
    # cols[e, j] (HAS_PERM), or its scale group is cols[e, j] (GIDX: a row-parallel part)
    HAS_PERM: tl.constexpr = False,
    GIDX: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_mask = pairs < num_pairs
    rows = pairs // A_ROWS_PER_PAIR
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    c_ptrs = cols_ptr + expert * stride_ce + offs_k  # (activation ordering)
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    if BITS == 0:
        w_ptrs += offs_k[:, None] * stride_wk
    else:  # packed words along K: each column's word and the bits it sits at
        PER_WORD: tl.constexpr = 32 // BITS
        w_ptrs += (offs_k // PER_WORD)[:, None]
        shift = ((offs_k % PER_WORD) * BITS)[:, None]
        z_ptrs = zero_ptr + expert * stride_se + offs_n * stride_sn
    s_ptrs = scale_ptr + expert * stride_se + offs_n * stride_sn  # (quantized weights)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        if HAS_PERM:  # (the expert's input columns of this step, gathered)
            cols = tl.load(c_ptrs, mask=k_mask, other=0).to(tl.int64)
            a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :],
                        mask=pair_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        else:
            a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BITS > 0:  # (w = (u - 2^(bits-1) - zero) * scale, one group a step)
            q = ((w >> shift) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
            if GIDX:  # (each column's own group: the scales and zero points gathered)
                g = tl.load(c_ptrs, mask=k_mask, other=0)[:, None]
                mask_s = k_mask[:, None] & n_mask[None, :]
                if HAS_ZERO:
                    q -= tl.load(z_ptrs[None, :] + g, mask=mask_s, other=0).to(tl.int32)
                w = q.to(tl.float32) * tl.load(s_ptrs[None, :] + g, mask=mask_s,
                                               other=0.0).to(tl.float32)  # fmt: skip
            else:
                g = k0 // GROUP
                if HAS_ZERO:
                    q -= tl.load(z_ptrs + g, mask=n_mask, other=0).to(tl.int32)[None, :]
                scale = tl.load(s_ptrs + g, mask=n_mask, other=0.0).to(tl.float32)
                w = q.to(tl.float32) * scale[None, :]
            w_ptrs += BLOCK_K // PER_WORD
        else:
            if FP8:  # (w = float8 * its row's scale of this GROUP of columns)
                scale = tl.load(s_ptrs + (k0 + k_offset) // GROUP, mask=n_mask, other=0.0)
                w = w.to(tl.float32) * scale[None, :]
            w_ptrs += BLOCK_K * stride_wk
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
        a_ptrs += BLOCK_K
        c_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(routed_weight_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


def _block_sizes(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): short row blocks when experts get few tokens each (decode),
    64-row blocks for prefill; float32 halves BLOCK_K (twice the bytes per element)."""
    block_m = 16 if num_pairs <= 4 * num_experts else 64
    return block_m, 64, 32 if dtype == torch.float32 else 64


def _grouped_gemm(a, w, c, bias, routed_weight, align, num_pairs, rows_per_pair, block_sizes):
    """c = a @ w[e].T (+ bias[e]) (x routed weight) per pair: w [E, N, K] of any strides (a
    transposed view too: gpt-oss stores its experts [E, K, N]), integer experts
    (`engine.layers.int_experts.IntExperts`: packed words, a scale per group of K columns
    (BLOCK_K is cut to divide the group), zero points, each expert's input order under
    activation ordering: A's columns gathered; or a row-parallel part's group of each
    column: the scales gathered) or float8 ones
    (`engine.layers.fp8_experts.Fp8Experts`: a scale per row and group of K columns)."""
    sorted_ids, block_experts, total = align
    block_m, block_n, block_k = block_sizes
    num_experts, n, k = w.shape
    assert a.stride(1) == 1 and c.stride(1) == 1
    assert bias is None or (bias.shape == (num_experts, n) and bias.stride(1) == 1)
    quant: dict = {}
    scale = zero = cols = c
    scale_strides = (0, 0)
    cols_stride = k_offset = 0
    if isinstance(w, torch.Tensor):
        strides = (w.stride(0), w.stride(1), w.stride(2))
    else:  # (quantized experts: a scale per row and group of K columns)
        if getattr(w, "gidx", None) is None:  # (the largest power of two dividing it)
            block_k = min(block_k, w.group & -w.group)
        if a.dtype == torch.float32:  # (the expanded float32 tiles spill at 32 columns)
            block_k = min(block_k, 16)
        scale = w.scale
        scale_strides = (scale.stride(0), scale.stride(1))
        if hasattr(w, "packed"):  # (integer: the words' strides; the zero points' the scales')
            quant = {"BITS": w.bits, "GROUP": w.group, "HAS_ZERO": w.zero is not None,
                     "HAS_PERM": w.perm is not None, "GIDX": w.gidx is not None}  # fmt: skip
            zero = w.zero if w.zero is not None else w.scale
            assert w.zero is None or w.zero.stride() == w.scale.stride()
            per_expert = w.perm if w.perm is not None else w.gidx
            if per_expert is not None:
                cols, cols_stride = per_expert, per_expert.stride(0)
                assert per_expert.stride(1) == 1 and scale.stride(2) == 1
                if a.dtype == torch.float32:  # (its gathers spill 64-column float32 tiles)
                    block_n = 32
            w = w.packed
            strides = (w.stride(0), w.stride(1), 1)
        else:  # (float8; a step must not cross a group from the part's first column either)
            quant = {"FP8": True, "GROUP": w.group}
            k_offset = w.offset
            if k_offset:
                block_k = min(block_k, k_offset & -k_offset)
            w = w.data
            strides = (w.stride(0), w.stride(1), w.stride(2))
    grid = (sorted_ids.numel() // block_m, cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, bias if bias is not None else c, routed_weight, sorted_ids, block_experts,
        total, num_pairs, n, k, a.stride(0), *strides,
        bias.stride(0) if bias is not None else 0, c.stride(0), scale, zero, *scale_strides,
        cols, cols_stride, k_offset,
        A_ROWS_PER_PAIR=rows_per_pair,
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=routed_weight is not None,
        DOT_DTYPE=dot_dtype(a.dtype),
        PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **quant,
        **launch_opts(4),
    )  # fmt: skip


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """As `engine.layers.moe.fused_experts`: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, k] (float32), topk_ids [T, k] -> [T, H] in x's dtype. gpt-oss: the
    experts' biases w13_bias [E, 2I] and w2_bias [E, H] (the second added before the routing
    weight), and `act` [pairs, 2I] -> [pairs, I] in place of SiLU(first half) * second half."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, hidden = w13.shape
    num_pairs = num_tokens * top_k
    x = x.contiguous()
    block_sizes = _block_sizes(num_pairs, num_experts, x.dtype)
    align = moe_align(topk_ids, num_experts, block_sizes[0])
    gate_up = torch.empty(num_pairs, inter2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, w13_bias, None, align, num_pairs, top_k, block_sizes)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        inner = F.silu(gate) * up
    else:
        inner = act(gate_up).to(x.dtype).contiguous()
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(inner, w2, down, w2_bias, weights, align, num_pairs, 1, block_sizes)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
