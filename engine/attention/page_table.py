"""The page tables and merge that `FlashInferAttnBackend` plans with (plain torch: they run,
and are tested, on CPU too).

flashinfer reads the KV pool in its NHD paged layout: slot s is key s % P of page s // P. A
request's keys are a list of page ids, every page full but the last (`PageTable`); a batch of
extends names its new tokens' rows with a `qo_indptr`. The extend path attends over the new
tokens and the cached prefix separately and merges the two softmaxes through their
log-sum-exps (`merge_states_torch` where flashinfer's merge kernel cannot run the shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_tensors import int64_tensor


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


def build_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: list[int],
    page_size: int,
    kv_lens_device: torch.Tensor | None = None,
) -> PageTable:
    """The pages of the first `kv_lens[i]` keys of request i (row `req_pool_indices[i]`).

    The allocator hands out whole pages, so keys kP .. kP+P-1 of a request share the page
    `req_to_token[row, kP] // P`: one gather of each page's first slot. `kv_lens_device`: the
    same lengths already on `req_to_token`'s device, so the gather needs no host-to-device
    copy (on CUDA the host tables are also pinned: see `FlashInferAttnBackend`).
    """
    lens = int64_tensor(kv_lens)
    num_pages = (lens + page_size - 1) // page_size
    indptr = torch.cat([lens.new_zeros(1), num_pages.cumsum(0)])
    last_page_len = lens - (num_pages - 1).clamp(min=0) * page_size
    if kv_lens_device is not None:
        num_pages = (kv_lens_device + page_size - 1) // page_size
    indices = _page_ids(req_to_token, req_pool_indices, num_pages, int(indptr[-1]), page_size)
    indptr, last_page_len = indptr.to(torch.int32), last_page_len.to(torch.int32)
    if req_to_token.is_cuda:
        indptr, last_page_len = indptr.pin_memory(), last_page_len.pin_memory()
    return PageTable(indptr, indices, last_page_len)


def _page_ids(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_pages: torch.Tensor,
    total_pages: int,
    page_size: int,
) -> torch.Tensor:
    device = req_to_token.device
    num_pages = num_pages.to(device, non_blocking=True)  # (no copy when already there)
    # output_size spares repeat_interleave a device-to-host read of the total
    req = torch.repeat_interleave(
        torch.arange(len(num_pages), device=device), num_pages, output_size=total_pages
    )
    first_page = num_pages.cumsum(0) - num_pages  # where each request's pages start
    page_in_req = torch.arange(total_pages, device=device) - first_page[req]
    slots = req_to_token[req_pool_indices[req], page_in_req * page_size]
    return torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)


def build_qo_indptr(extend_lens: list[int], pin: bool = False) -> torch.Tensor:
    """[B + 1] int32 host tensor (pinned with `pin`): request i's new tokens are rows
    indptr[i] .. indptr[i+1]-1."""
    indptr = torch.tensor([0, *extend_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    return indptr.pin_memory() if pin else indptr


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
