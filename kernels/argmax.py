"""Row-wise argmax over a vocabulary, in two stages: greedy sampling's last kernel.

`torch.argmax(logits, -1)` reduces a row with one block: at batch 1 over Llama 3's 128,256
logits it took 27 us of a 1.5 ms decode step on the H100 (benchmarks/gpu_session.md), while
the read itself is half a megabyte. Here each row is cut into BLOCK-wide chunks reduced in
parallel (stage 1: grid (rows, chunks), one (value, index) pair per chunk), then each row's
chunk results are reduced (stage 2: grid (rows,)).

Semantics are torch's: the index of the first maximal value, NaN counting as larger than any
number (the first NaN wins), -inf rows giving 0. Each stage keeps a chunk's first NaN apart
from its largest number and prefers it, so the two-stage order changes nothing.
"""

from __future__ import annotations

import torch

from kernels.jit import HAS_TRITON, cdiv, launch_opts, next_pow2, tl, triton

BLOCK = 4096

if HAS_TRITON:
    from kernels.jit import pdl_prologue

    @triton.jit
    def _first_max(vals, idx, valid, BIG: tl.constexpr):
        """(value, index) of the first NaN of `vals` where `valid`, else of the first maximal
        value; index BIG when nothing is valid."""
        is_nan = valid & (vals != vals)
        nan_at = tl.min(tl.where(is_nan, idx, BIG), axis=0)
        nums = tl.where(valid & (vals == vals), vals, float("-inf"))
        top = tl.max(nums, axis=0)
        top_at = tl.min(tl.where(valid & (nums == top), idx, BIG), axis=0)
        at = tl.where(nan_at < BIG, nan_at, top_at)
        value = tl.where(nan_at < BIG, float("nan"), top)
        return value, at

    @triton.jit
    def _argmax_chunks_kernel(
        x_ptr, stride_x, n_cols, val_ptr, idx_ptr, n_chunks, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        valid = cols < n_cols
        vals = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=0.0)
        value, at = _first_max(vals.to(tl.float32), cols, valid, 2147483647)
        tl.store(val_ptr + row * n_chunks + chunk, value)
        tl.store(idx_ptr + row * n_chunks + chunk, at)

    @triton.jit
    def _argmax_rows_kernel(
        val_ptr, idx_ptr, n_chunks, out_ptr, CHUNKS: tl.constexpr, PDL: tl.constexpr
    ):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, CHUNKS)
        valid = offs < n_chunks
        vals = tl.load(val_ptr + row * n_chunks + offs, mask=valid, other=0.0)
        idx = tl.load(idx_ptr + row * n_chunks + offs, mask=valid, other=2147483647)
        # chunks are in column order and each holds its own first index: the first NaN or
        # first maximal chunk value, by the chunk's index, is the row's
        _, at = _first_max(vals, idx, valid, 2147483647)
        tl.store(out_ptr + row, at.to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)` for a 2-D x (any float dtype, last axis contiguous): int64
    [rows], on x's device."""
    assert x.dim() == 2 and x.stride(1) == 1, "argmax_rows: a 2-D tensor, last axis contiguous"
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    assert cols > 0, "argmax_rows: an empty row has no argmax"
    chunks = cdiv(cols, block)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(rows, chunks)](
        x, x.stride(0), cols, vals, idx, chunks, BLOCK=block, **launch_opts(8)
    )
    _argmax_rows_kernel[(rows,)](
        vals, idx, chunks, out, CHUNKS=next_pow2(chunks, 2), **launch_opts(1)
    )
    return out
