"""The page tables and merge that `FlashInferAttnBackend` plans with (they run, and are
tested, on CPU too).

flashinfer reads the KV pool in its NHD paged layout: slot s is key s % P of page s // P. A
request's keys are a list of page ids, every page full but the last (`PageTable`); a batch of
extends names its new tokens' rows with a `qo_indptr`. The extend path attends over the new
tokens and the cached prefix separately and merges the two softmaxes through their
log-sum-exps (`merge_states_torch` where flashinfer's merge kernel cannot run the shape).

Planning runs on the host before every forward, so its cost is host time per step: the host
tables are numpy arithmetic on the batch's length lists, written into the caller's (pinned)
buffer, and the page ids one Triton launch on a GPU (kernels/page_table.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.host_tensors import int64_array
from kernels.jit import HAS_TRITON, compiled_on

if HAS_TRITON:
    from kernels.page_table import page_ids
else:  # no Triton: the torch gather below
    page_ids = None


@dataclass(frozen=True)
class PageTable:
    """Where each request's keys are, as flashinfer wants it (all int32).

    Request i's keys fill pages `indices[indptr[i]:indptr[i + 1]]` in order, every one full but
    the last, which holds `last_page_len[i]` keys; a request with no keys has no pages and
    `last_page_len` 0. `indptr` and `last_page_len` are host tensors (flashinfer plans on the
    host); `indices` is on `req_to_token`'s device.
    """

    indptr: torch.Tensor  # [B + 1]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [B]
    # the key counts it was built from (int64 numpy [B]), when known: a planner that needs
    # them takes these instead of converting the length list again
    kv_lens: np.ndarray | None = None


def table_host_ints(batch_size: int) -> int:
    """int32 entries of the host buffer `build_page_table` and `build_qo_indptr` of one batch
    write into, together (indptr, last_page_len, qo_indptr)."""
    return 3 * batch_size + 2


def build_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: list[int],
    page_size: int,
    kv_lens_device: torch.Tensor | None = None,
    sub_lens_device: torch.Tensor | None = None,
    host: torch.Tensor | None = None,
    indices_out: torch.Tensor | None = None,
    use_kernel: bool | None = None,
) -> PageTable:
    """The pages of the first `kv_lens[i]` keys of request i (row `req_pool_indices[i]`).

    The allocator hands out whole pages, so keys kP .. kP+P-1 of a request share the page
    `req_to_token[row, kP] // P`: one gather of each page's first slot.

    * The host tables are computed with numpy, no torch op: into `host` (an int32 CPU buffer of
      at least 2B + 1 entries: the backend passes pinned staging memory, see
      `FlashInferAttnBackend`), or into a new tensor.
    * The page ids: where Triton is compiled for `req_to_token`'s device (or `use_kernel`),
      one launch of `kernels.page_table.page_ids`, given the same lengths already on the
      device (`kv_lens_device`, minus `sub_lens_device` when given: no host-to-device copy);
      else a dozen torch ops. Into `indices_out[:total]` when given (a CUDA graph's buffer).
    """
    indptr, last_page_len, lens, num_pages, total = _host_tables(kv_lens, page_size, host)
    device = req_to_token.device
    if use_kernel is None:
        use_kernel = page_ids is not None and compiled_on(req_to_token)
    if use_kernel and kv_lens_device is not None:
        out = indices_out if indices_out is not None else torch.empty(
            total, dtype=torch.int32, device=device
        )
        assert out.numel() >= total, f"{total} page ids do not fit in {out.numel()}"
        page_ids(req_to_token, req_pool_indices, kv_lens_device, page_size, out,
                 sub_lens_device)  # fmt: skip
        return PageTable(indptr, out[:total], last_page_len, lens)
    if kv_lens_device is not None:
        if sub_lens_device is not None:
            kv_lens_device = kv_lens_device - sub_lens_device
        num_pages_dev = (kv_lens_device + page_size - 1) // page_size
    else:
        num_pages_dev = torch.from_numpy(num_pages).to(device)
    indices = _page_ids(req_to_token, req_pool_indices, num_pages_dev, total, page_size)
    return PageTable(indptr, indices, last_page_len, lens)


def host_page_table(
    kv_lens: list[int], page_size: int, indices: torch.Tensor, host: torch.Tensor | None = None
) -> PageTable:
    """The table of `build_page_table` whose page ids are (or will be, before any kernel reads
    them) in `indices`, on the device: the host tables alone are computed here. A captured
    decode graph writes its page ids itself (`FlashInferAttnBackend.cuda_graph_prologue`)."""
    indptr, last_page_len, lens, _, total = _host_tables(kv_lens, page_size, host)
    assert indices.numel() >= total, f"{total} page ids do not fit in {indices.numel()}"
    return PageTable(indptr, indices[:total], last_page_len, lens)


def _host_tables(
    kv_lens: list[int], page_size: int, host: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray, int]:
    """indptr [B + 1] and last_page_len [B] (int32 host tensors, the first 2B + 1 entries of
    `host` when given) of requests with `kv_lens` keys; the key and page counts (int64
    numpy) and the total."""
    batch = len(kv_lens)
    if host is None:
        host = torch.empty(2 * batch + 1, dtype=torch.int32)
    lens = int64_array(kv_lens)
    num_pages = (lens + page_size - 1) // page_size
    host_np = host.numpy()
    indptr_np, last_np = host_np[: batch + 1], host_np[batch + 1 : 2 * batch + 1]
    indptr_np[0] = 0
    np.cumsum(num_pages, out=indptr_np[1:], dtype=np.int32)
    np.subtract(lens, np.maximum(num_pages - 1, 0) * page_size, out=last_np, casting="unsafe")
    total = int(indptr_np[-1])
    return host[: batch + 1], host[batch + 1 : 2 * batch + 1], lens, num_pages, total


def _page_ids(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_pages: torch.Tensor,
    total_pages: int,
    page_size: int,
) -> torch.Tensor:
    device = req_to_token.device
    # output_size spares repeat_interleave a device-to-host read of the total
    req = torch.repeat_interleave(
        torch.arange(len(num_pages), device=device), num_pages, output_size=total_pages
    )
    first_page = num_pages.cumsum(0) - num_pages  # where each request's pages start
    page_in_req = torch.arange(total_pages, device=device) - first_page[req]
    slots = req_to_token[req_pool_indices[req], page_in_req * page_size]
    return torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)


def build_qo_indptr(extend_lens: list[int], host: torch.Tensor | None = None) -> torch.Tensor:
    """[B + 1] int32 host tensor (the first B + 1 entries of `host` when given): request i's
    new tokens are rows indptr[i] .. indptr[i+1]-1."""
    batch = len(extend_lens)
    indptr = torch.empty(batch + 1, dtype=torch.int32) if host is None else host[: batch + 1]
    out = indptr.numpy()
    out[0] = 0
    np.cumsum(int64_array(extend_lens), out=out[1:], dtype=np.int32)
    return indptr


def merge_states_torch(
    out: torch.Tensor, lse: torch.Tensor, out_other: torch.Tensor, lse_other: torch.Tensor
) -> None:
    """Merge into (out, lse), in place, the attention of the same queries over a disjoint
    second set of keys. out [N, H, D]; lse [N, H] float32, base-2 log-sum-exps of the scaled
    logits (flashinfer's convention), -inf where a set holds no key (not both)."""
    lse_max = torch.maximum(lse, lse_other)
    weight, weight_other = torch.exp2(lse - lse_max), torch.exp2(lse_other - lse_max)
    total = weight + weight_other
    merged = out.float() * (weight / total)[..., None]
    merged += out_other.float() * (weight_other / total)[..., None]
    out.copy_(merged)
    lse.copy_(lse_max + torch.log2(total))


def merge_kernel_fits(num_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """flashinfer's merge kernel runs (head_dim / vec) x num_heads threads per block."""
    vec = max(16 // dtype.itemsize, head_dim // 32)
    return head_dim // vec * num_heads <= 1024
