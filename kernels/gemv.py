"""y = x @ w.T (+ bias) for a few rows of x: the linear layers of decode at small batch.

At batch 1 a decode step is a chain of matrix-vector products that read every weight once, so
its speed is the HBM bandwidth the GEMMs reach. On the H100 (benchmarks/gpu_session.md,
third session) cuBLAS's kernels for Llama 3.2 1B's projections reached 1.3-2.6 TB/s of the
3.35 peak (o_proj 6.3 us for 8 MB, gate_up 25.5 us for 67 MB), about 1.04 ms of a 1.36 ms
step whose roofline is 0.74.

Here a program owns BLOCK_N output columns (weight rows) for all M rows of x and walks K in
BLOCK_K steps, so the grid (cdiv(N, BLOCK_N),) has no split-K and nothing to reduce across
programs; a small BLOCK_N gives even the 2048-wide projections a few programs per SM.

* M == 1: the weight tile times the broadcast x, accumulated elementwise in float32 and
  summed over K once at the end (a reduction, not a dot: a dot would pad M to 16).
* 1 < M <= MAX_M: `tl.dot(w, x.T)` with M padded to 16 (BLOCK_M), float32 accumulation
  (IEEE for float32 weights).

`act="silu_mul"` folds Llama's MLP activation into the down projection: x is then the gate_up
projection's output [M, 2K] and each program computes `silu(x[:, :K]) * x[:, K:]` for its K
steps as it loads them (rounded as `kernels.activation.silu_and_mul` rounds, so the result is
bit for bit `gemv(silu_and_mul(x), w)`), which saves that kernel and its [M, K] round trip. Every
program recomputes the activation of the whole row: 2K loads from L2 and K exponentials against
BLOCK_N * K weight loads from HBM.

Weights [N, K] with the last axis contiguous; x [M, K] (or [M, 2K]) likewise; the output
[M, N] may be a strided view (the lm_head's padded rows). `gemv_config` picks the tile;
benchmarks/gpu_gemv.py sweeps the alternatives on a GPU. The engine uses this
kernel with `--gemv-backend triton` (`engine.layers.linear.use_triton_gemv`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.jit import (
    HAS_TRITON,
    cdiv,
    dot_dtype,
    dot_precision,
    interpreting,
    launch_opts,
    next_pow2,
    tl,
    triton,
)

MAX_M = 16  # rows of x the kernel takes; more go to torch's GEMM
TILE = 8192  # most weight elements a one-row program of 4 warps multiplies per step

ACTS = {None: 0, "silu_mul": 1}

if HAS_TRITON:
    from kernels.jit import pdl_prologue

    @triton.jit
    def _load_input(ptrs, mask, up_offset, ACT: tl.constexpr, NORM: tl.constexpr, res_ptrs,
                    nw_ptrs, rstd):  # fmt: skip
        """x at ptrs, or with ACT 1 silu(x at ptrs) * (x at ptrs + up_offset), each product
        rounded to x's dtype as kernels.activation's `silu_and_mul` rounds it; with NORM 1
        RMSNorm of x (`rstd` its rows' 1 / rms), with NORM 2 of x + residual (at res_ptrs),
        weighted by the norm's weight at nw_ptrs, rounded as kernels.fused_norm's."""
        x = _load(ptrs, mask)
        if ACT == 1:
            up = _load(ptrs + up_offset, mask)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
            x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
        if NORM > 0:
            if NORM == 2:
                x = _add_residual(x, res_ptrs, mask)
            h = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
            x = (_load(nw_ptrs, mask).to(tl.float32) * h).to(x.dtype)
        return x

    @triton.jit
    def _load(ptrs, mask):
        """tl.load, masked (zeros outside) unless `mask` is None (tiles known to be full)."""
        if mask is None:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0)
        return x

    @triton.jit
    def _add_residual(x, res_ptrs, mask):
        """x + the residual at res_ptrs, rounded to x's dtype (the new residual stream)."""
        r = _load(res_ptrs, mask)
        return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        res_ptr,
        nw_ptr,
        res_out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        stride_rm,
        eps,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr,
        ACT: tl.constexpr,
        NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        if BLOCK_M == 1:
            rstd = 1.0
            if NORM > 0:  # a first pass over the row: its sum of squares (and the residual)
                squares = tl.zeros([BLOCK_K], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    mask_k = k0 + offs_k < K
                    h = tl.load(x_ptr + k0 + offs_k, mask=mask_k, other=0.0)
                    if NORM == 2:
                        h = _add_residual(h, res_ptr + k0 + offs_k, mask_k)
                        if pid == 0:
                            tl.store(res_out_ptr + k0 + offs_k, h, mask=mask_k)
                    squares += h.to(tl.float32) * h.to(tl.float32)
                rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                at = k0 + offs_k
                if EVEN_K:
                    x = _load_input(x_ptr + at, None, K, ACT, NORM, res_ptr + at, nw_ptr + at,
                                    rstd)  # fmt: skip
                else:
                    x = _load_input(x_ptr + at, at < K, K, ACT, NORM, res_ptr + at,
                                    nw_ptr + at, rstd)  # fmt: skip
                if EVEN_N and EVEN_K:
                    w = tl.load(w_ptrs + k0)
                else:
                    w_mask = mask_n[:, None] & (k0 + offs_k < K)[None, :]
                    w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            y = tl.sum(acc, axis=1)
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)
        else:
            offs_m = tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
            res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
            nw_ptrs = nw_ptr + offs_m[:, None] * 0 + offs_k[None, :]
            rstd = tl.full([BLOCK_M, 1], 1.0, tl.float32)
            if NORM > 0:
                squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    mask = mask_m[:, None] & (k0 + offs_k < K)[None, :]
                    h = tl.load(x_ptrs + k0, mask=mask, other=0.0)
                    if NORM == 2:
                        h = _add_residual(h, res_ptrs + k0, mask)
                        if pid == 0:
                            res_out = res_out_ptr + offs_m[:, None] * K + k0 + offs_k[None, :]
                            tl.store(res_out, h, mask=mask)
                    squares += h.to(tl.float32) * h.to(tl.float32)
                rstd = tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mask_k = k0 + offs_k < K
                x = _load_input(x_ptrs + k0, mask_m[:, None] & mask_k[None, :], K, ACT, NORM,
                                res_ptrs + k0, nw_ptrs + k0, rstd)  # fmt: skip
                if EVEN_N and EVEN_K:
                    w = tl.load(w_ptrs + k0)
                else:
                    w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                acc = tl.dot(
                    w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc, input_precision=PRECISION
                )
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            out_mask = mask_n[:, None] & mask_m[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def gemv_config(
    m: int, n: int, k: int, itemsize: int = 2, prologue: bool = False
) -> dict[str, int]:
    """The tile for x [m, k] @ w[n, k].T: BLOCK_N, BLOCK_K, num_warps, num_stages.

    The H100 sweep of `benchmarks/gpu_gemv.py` (results/gpu_gemv.json, fourth GPU session) at
    Llama 3.2 1B's projections chose these; where its best tile differs, by how much it beat
    this one is in brackets.
    * One row: 4 weight rows a program (16 with 8 warps for a vocabulary-wide N: the lm_head),
      1024 columns a step, or 2048 from K = 8192 (the down projection), 4 warps, 2 stages
      (qkv's best had 2 warps and 1 stage, [1-9 %] of 6.3 us). The float32 accumulator tile
      stays at 64 registers a thread (BLOCK_N x BLOCK_K <= 2048 x warps: more spilled for
      sm_90a, kernels/compile_check.py). No SM count is needed: 3072 rows of 4 are 768
      programs.
    * The dot (2 to MAX_M rows): 64 x 256 tiles, 4 warps, 4 stages, the best at every shape
      but gate_up (64 x 128, [1-2 %]); 128 columns with a prologue (an activation or a norm
      computed per tile). float32 inputs keep 16 x 128 tiles in 3 stages (16 x 64 with a
      prologue): the 16-bit tiles spilled there, or took 240 KB of shared memory of the
      H100's 227."""
    if m == 1:
        wide = n >= 32768
        block_n, warps = (16, 8) if wide else (4, 4)
        cap = 2048 if k >= 8192 else 1024
        block_k = min(next_pow2(k, 16), cap, TILE * warps // (4 * block_n))
        return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": 2}
    stages = 4
    if itemsize > 2:  # float32: not swept; the 16-bit tiles overflow its registers or shared
        block_n, block_k, stages = 16, 64 if prologue else 128, 3  # memory (sm_90a)
    else:
        block_n, block_k = 64, 128 if prologue else 256
    block_n, block_k = min(next_pow2(n, 16), block_n), min(next_pow2(k, 16), block_k)
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": stages}


def one_row_launch(n: int, k: int) -> tuple[tuple[int], dict[str, int]]:
    """(grid, keyword arguments) of a one-row GEMV kernel over an [n, k] weight of 1-byte
    elements at `gemv_config`'s one-row tile (BLOCK_N, BLOCK_K, warps, and its stages where
    compiled): the float8 and int8 GEMVs'."""
    cfg = gemv_config(1, n, k)
    opts = launch_opts(cfg["num_warps"])
    if not interpreting():
        opts["num_stages"] = cfg["num_stages"]
    return (cdiv(n, cfg["BLOCK_N"]),), {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
                                        **opts}  # fmt: skip


class RMSNormInput(NamedTuple):
    """The GEMV's input is RMSNorm(x (+ residual)) with this weight [K] and eps: Llama's
    norm before its qkv and gate_up projections. With `residual` [M, K], x + residual (the
    new residual stream) is also written to `residual_out` [M, K] (contiguous)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    act: str | None = None,
    norm: RMSNormInput | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K] with M <= MAX_M (x, weight and bias of one
    dtype; last axes contiguous). `out` [M, N] (its rows may be strided) receives the result;
    `config` overrides `gemv_config` (the benchmark's sweep). `act="silu_mul"`:
    `F.linear(silu_and_mul(x), weight, bias)` for x [M, 2K]. `norm`: `F.linear` of the
    RMSNorm of x (plus the residual), as `kernels.fused_norm` computes it."""
    assert x.dim() == 2 and weight.dim() == 2, "gemv: x [M, K] and weight [N, K]"
    assert act in ACTS, f"gemv: act {act!r} not in {sorted(ACTS, key=str)}"
    assert act is None or norm is None, "gemv: an activation or a norm, not both"
    n, k = weight.shape
    m, x_cols = x.shape
    want_cols = 2 * k if act else k
    assert x_cols == want_cols, (
        f"gemv: x has {x_cols} columns, the weight's K {k} needs {want_cols}"
    )
    assert 0 < m <= MAX_M, f"gemv: {m} rows (1 to {MAX_M})"
    assert x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    res = res_out = norm_w = x
    eps, norm_kind = 0.0, 0
    if norm is not None:
        norm_w, eps, norm_kind = norm.weight, norm.eps, 1
        assert norm_w.shape == (k,) and norm_w.dtype == x.dtype, "gemv: the norm's weight"
        if norm.residual is not None:
            res, res_out, norm_kind = norm.residual, norm.residual_out, 2
            assert res.shape == x.shape and res.dtype == x.dtype and res.stride(1) == 1
            assert res_out is not None and res_out.shape == x.shape and res_out.is_contiguous()
    if config is None:
        prologue = act is not None or norm is not None
        config = gemv_config(m, n, k, x.element_size(), prologue)
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    opts = launch_opts(config["num_warps"])
    if not interpreting():
        opts["num_stages"] = config["num_stages"]
    block_m = 1 if m == 1 else max(16, next_pow2(m))
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, out, res, norm_w, res_out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), res.stride(0), eps,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, DOT_DTYPE=dot_dtype(x.dtype),
        PRECISION=dot_precision(x.dtype), ACT=ACTS[act], NORM=norm_kind,
        **opts,
    )  # fmt: skip
    return out
