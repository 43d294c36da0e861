"""`HybridSWABackend`: attention over hybrid sliding-window memory.

The windowed layers' K/V live in buffers addressed by swa slots (engine/mem_cache/
swa_allocator.py), the others' by full slots. This backend holds two backends of the same
kind: `full` is planned over the batch as it comes, `swa` over a view of it whose slots are
translated through `full_to_swa` (the new tokens' slots, and the rows of the batch's
requests, cut to the longest sequence). Each layer goes to the one that holds its K/V.

Positions whose swa KV is freed translate to slot 0, the padding slot: only keys outside
every query's window are freed, and every backend masks those (or does not read them).
The translation reads the allocator's map when the batch is planned, on the device side:
the scheduler changes it meanwhile only for slots the batch does not read in its window.

CUDA graphs (when the inner backend can be captured): the swa view of a captured batch lives
in static buffers (`init_cuda_graph_state`), translated in place before each replay, after
the graph runner has filled its own static buffers; the graph reads only those.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionLayer

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


def swa_rows(fb: ForwardBatch, full_to_swa: torch.Tensor) -> torch.Tensor:
    """The batch's requests' rows (row i: request i's), cut to the longest sequence, in swa
    slots (int64)."""
    width = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else 1
    rows = fb.req_to_token[:, :width].index_select(0, fb.req_pool_indices).to(torch.int64)
    return full_to_swa.index_select(0, rows.flatten()).view(rows.shape)


def swa_view(fb: ForwardBatch, full_to_swa: torch.Tensor) -> ForwardBatch:
    """`fb` with swa slots: its new tokens' slots and its requests' rows translated."""
    return dataclasses.replace(
        fb,
        out_cache_loc=full_to_swa.index_select(0, fb.out_cache_loc),
        req_to_token=swa_rows(fb, full_to_swa).to(torch.int32),
        req_pool_indices=torch.arange(fb.batch_size, device=fb.req_pool_indices.device),
    )


class HybridSWABackend(AttentionBackend):
    def __init__(
        self, full: AttentionBackend | None, swa: AttentionBackend, allocator: object
    ) -> None:
        """`full` is None when every layer is windowed; `allocator` is read for its
        `full_to_swa` at each batch (the device process swaps in the scheduler's map)."""
        self.full = full
        self.swa = swa
        self.allocator = allocator
        self._swa_batch: ForwardBatch | None = None
        self.supports_cuda_graph = swa.supports_cuda_graph
        self.supports_tree_mask = swa.supports_tree_mask and (
            full is None or full.supports_tree_mask
        )  # (draft trees: each inner backend masks its layers' over the same batch)
        self.cuda_graph_seq_len_fill_value = swa.cuda_graph_seq_len_fill_value
        self._graph_rows = self._graph_loc = self._graph_rids = torch.empty(0)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self.full is not None:
            self.full.init_forward_metadata(forward_batch)
        self._swa_batch = swa_view(forward_batch, self.allocator.full_to_swa)
        self.swa.init_forward_metadata(self._swa_batch)

    # -- CUDA graphs ----------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        if self.full is not None:
            self.full.init_cuda_graph_state(max_bs, max_context_len)
        self.swa.init_cuda_graph_state(max_bs, max_context_len)
        dev = self.allocator.full_to_swa.device
        self._graph_rows = torch.zeros((max_bs, max_context_len), dtype=torch.int32, device=dev)
        self._graph_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self._graph_rids = torch.arange(max_bs, dtype=torch.int64, device=dev)

    def _static_swa_view(self, fb: ForwardBatch) -> ForwardBatch:
        """`fb` (the graph runner's static batch) translated into this backend's buffers."""
        bs = fb.batch_size
        full_to_swa = self.allocator.full_to_swa
        torch.index_select(full_to_swa, 0, fb.out_cache_loc, out=self._graph_loc[:bs])
        rows = swa_rows(fb, full_to_swa)
        self._graph_rows[:bs, : rows.shape[1]] = rows
        self._swa_batch = self._graph_view(fb)
        return self._swa_batch

    def _graph_view(self, fb: ForwardBatch) -> ForwardBatch:
        """The static batch over this backend's graph buffers (what `_static_swa_view` fills)."""
        bs = fb.batch_size
        return dataclasses.replace(
            fb,
            out_cache_loc=self._graph_loc[:bs],
            req_to_token=self._graph_rows,
            req_pool_indices=self._graph_rids[:bs],
        )

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        if self.full is not None:
            self.full.init_forward_metadata_capture_cuda_graph(forward_batch)
        self.swa.init_forward_metadata_capture_cuda_graph(self._static_swa_view(forward_batch))

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        if self.full is not None:
            self.full.init_forward_metadata_replay_cuda_graph(forward_batch)
        self.swa.init_forward_metadata_replay_cuda_graph(self._static_swa_view(forward_batch))

    def cuda_graph_prologue(self, forward_batch: ForwardBatch) -> None:
        if self.full is not None:
            self.full.cuda_graph_prologue(forward_batch)
        self.swa.cuda_graph_prologue(self._graph_view(forward_batch))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if getattr(layer, "sliding_window", None) is None:
            assert self.full is not None, "a full-attention layer in an all-windowed model"
            return self.full.forward(q, k, v, layer, forward_batch, kv_stored)
        assert self._swa_batch is not None, "init_forward_metadata was not called"
        return self.swa.forward(q, k, v, layer, self._swa_batch, kv_stored)

    def kv_store_target(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The window layers' K/V go to the window pool at the batch's slots there."""
        if getattr(layer, "sliding_window", None) is None:
            assert self.full is not None, "a full-attention layer in an all-windowed model"
            return self.full.kv_store_target(layer, forward_batch)
        assert self._swa_batch is not None, "init_forward_metadata was not called"
        return self.swa.kv_store_target(layer, self._swa_batch)

    def _attend(self, *args: object) -> torch.Tensor:  # pragma: no cover - forward routes
        raise NotImplementedError
