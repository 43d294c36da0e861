"""flashinfer's page ids of a batch in one launch: `indices[indptr[i] + j]` is the page that
holds keys jP .. jP+P-1 of request i (P: page size).

The allocator hands out whole pages and keeps a page's slots together, so the page of keys
jP .. is `req_to_token[row_i, jP] // P`. The torch version (engine/attention/page_table.py)
takes about a dozen small device ops per batch (a repeat_interleave, cumsums, gathers); on a
GPU each costs the host a launch, on every decode step. Here one program per request reads
the lengths of all requests, sums the pages of those before it (its start in `indices`: no
host-side or separate prefix sum), and copies its own page ids.

The number of pages per request is cdiv(kv_len, P), kv_len = `kv_lens[i]` minus
`sub_lens[i]` when given (an extend's cached prefix: context minus new tokens, without a
subtraction op). Reference: `page_ids_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.jit import launch_opts, next_pow2, pdl_prologue


@triton.jit
def _page_ids_kernel(
    req_to_token_ptr,
    stride_row,
    rows_ptr,
    kv_lens_ptr,
    sub_lens_ptr,
    out_ptr,
    batch,
    PAGE: tl.constexpr,
    HAS_SUB: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    i = tl.program_id(0)
    reqs = tl.arange(0, BLOCK_B)
    lens = tl.load(kv_lens_ptr + reqs, mask=reqs < batch, other=0).to(tl.int64)
    if HAS_SUB:
        lens -= tl.load(sub_lens_ptr + reqs, mask=reqs < batch, other=0).to(tl.int64)
    pages = (lens + PAGE - 1) // PAGE
    start = tl.sum(tl.where(reqs < i, pages, 0), axis=0)
    count = tl.sum(tl.where(reqs == i, pages, 0), axis=0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    for first in range(0, count, BLOCK_P):
        j = first + tl.arange(0, BLOCK_P)
        mask = j < count
        slot = tl.load(req_to_token_ptr + row * stride_row + j * PAGE, mask=mask, other=0)
        tl.store(out_ptr + start + j, (slot // PAGE).to(tl.int32), mask=mask)


def page_ids(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
    sub_lens: torch.Tensor | None = None,
    block_pages: int = 128,
) -> torch.Tensor:
    """Writes into `out` (int32, at least the total page count long; its first total entries)
    the page ids of the first kv_lens[i] (- sub_lens[i]) keys of request i, whose slots are
    row rows[i] of `req_to_token` (int32 [rows, max_context], unit stride along a row).
    rows, kv_lens, sub_lens: [B] integer tensors on the same device. Returns `out`."""
    batch = rows.shape[0]
    if batch == 0:
        return out
    assert req_to_token.stride(1) == 1 and out.dtype == torch.int32
    _page_ids_kernel[(batch,)](
        req_to_token, req_to_token.stride(0), rows, kv_lens,
        kv_lens if sub_lens is None else sub_lens, out, batch,
        PAGE=page_size, HAS_SUB=sub_lens is not None, BLOCK_B=next_pow2(batch),
        BLOCK_P=block_pages, **launch_opts(4),
    )  # fmt: skip
    return out


def page_ids_ref(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    sub_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The page ids `page_ids` writes, one request at a time (int32 [total pages])."""
    lens = kv_lens if sub_lens is None else kv_lens - sub_lens
    parts = [
        req_to_token[int(row), : int(n) : page_size].long() // page_size
        for row, n in zip(rows.tolist(), lens.tolist())
    ]
    if not parts:
        return torch.empty(0, dtype=torch.int32, device=req_to_token.device)
    return torch.cat(parts).to(torch.int32)
