"""Attention backends: one interface, chosen by name through a registry with lazy imports
(so the package imports on a machine without CUDA, triton or flashinfer)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class AttentionLayer(Protocol):
    """What a backend reads from the model's attention layer."""

    layer_id: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None  # keys seen, the query's own included; None: all
    logit_cap: float | None  # scores soft-capped to c * tanh(s / c); None: not capped
    sinks: torch.Tensor | None  # [num_heads] logits of a key with no value (not flashinfer)


def window_left(layer: AttentionLayer) -> int:
    """flashinfer's convention, used by every backend: the query at position p sees keys
    p - window_left .. p; -1 means the whole context."""
    window = getattr(layer, "sliding_window", None)
    return -1 if window is None else window - 1


def softmax_scale(layer: AttentionLayer, forward_batch: ForwardBatch) -> float:
    """The layer's softmax scale times its k_scale: a float8 KV cache's keys are read as stored
    (K / k_scale), so the scale goes on the scores (1.0 for any other cache)."""
    return layer.scaling * forward_batch.kv_pool.k_scales[layer.layer_id]


def logit_cap(layer: AttentionLayer) -> float:
    """flashinfer's convention (`logits_soft_cap`), used by every backend: 0.0 is no cap."""
    return float(getattr(layer, "logit_cap", None) or 0.0)


class AttentionBackend(ABC):
    """Computes paged attention for one layer of one batch.

    `init_forward_metadata` runs once per batch (plan index tensors, masks, wrappers) into
    `metadata`, reused by every layer. `forward` first writes the new tokens' K/V into the
    pool at `forward_batch.out_cache_loc` (`_store_kv`), then attends over each request's
    full context (`req_to_token[req_pool_indices[i], :seq_lens[i]]`), causal within the new
    tokens (`_attend`, what each backend implements).

    With a float8 KV cache (engine/mem_cache/kv_quant.py) `forward` quantizes the new K/V
    first: `_store_kv` and `_attend` get them as stored ([tokens, kv_heads, head_dim], float8,
    divided by their scales), and every key a query sees, new or cached, is a stored one.
    `_attend` reads them as they are, converted to q's dtype, with `softmax_scale` (k_scale
    folded in); `forward` multiplies the output by v_scale.

    Shapes: q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim];
    returns [num_tokens, num_heads * head_dim] in q's dtype.

    A backend whose decode forward can be captured in a CUDA graph sets `supports_cuda_graph`
    and implements the three `*cuda_graph*` hooks below; the others keep the defaults.
    """

    # -- CUDA graphs of decode steps (engine/cuda_graph_runner.py) ---------------------------
    supports_cuda_graph: bool = False
    # whether an extend forward masks a verify step's draft trees (ForwardBatch.spec_parents)
    supports_tree_mask: bool = False
    # seq_len given to the padded rows of a captured batch (their req_to_token row points at
    # KV slot 0, and their new token is written to slot 0, which is never handed out)
    cuda_graph_seq_len_fill_value: int = 1

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        """Allocate, once, the device tensors that captured decode graphs will read as
        metadata, sized for batches of up to `max_bs` requests of up to `max_context_len`
        tokens. Called before any capture."""
        raise NotImplementedError

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Like `init_forward_metadata`, for a DECODE batch about to be captured.

        `forward_batch` has `bs` rows (the captured size); its tensors (`input_ids`,
        `positions`, `out_cache_loc`, `req_pool_indices`, `seq_lens`) are the graph runner's
        static buffers cut to `bs`, `req_to_token` is the pool's tensor, and `seq_lens_cpu`
        holds `cuda_graph_seq_len_fill_value` for every row. Every device tensor that
        `forward` will read must live in the state of `init_cuda_graph_state` (or be one of
        the batch's static buffers): the graph keeps reading those addresses on replay.
        """
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Refresh, in place, the metadata of the captured graph of size `forward_batch.
        batch_size`, right before it replays (outside the graph).

        The runner has already copied the real batch into the static buffers and padded it:
        rows past the real batch have `seq_lens_cpu` (and `seq_lens`) equal to
        `cuda_graph_seq_len_fill_value`, `out_cache_loc` 0, and a `req_pool_indices` row whose
        `req_to_token` entries are all slot 0. Nothing the graph reads may be reallocated here:
        write into the tensors of `init_cuda_graph_state` (copies, in-place ops).
        """
        raise NotImplementedError

    # -- CUDA graphs of speculative verify steps (engine/speculative/verify_graphs.py) ---------
    # A verify batch is an EXTEND of `width` tokens per request (the last token and up to
    # width - 1 drafts, padded), causal within them, over each request's cached context.
    supports_verify_cuda_graph: bool = False

    def init_verify_cuda_graph_state(self, max_bs: int, width: int, max_context_len: int) -> None:
        """Like `init_cuda_graph_state`, for verify graphs of up to `max_bs` requests of
        `width` tokens each (called after it, before any verify capture)."""
        raise NotImplementedError

    # `init_forward_metadata_capture_cuda_graph` and `..._replay_cuda_graph` then also take
    # such an EXTEND batch: `batch_size` requests, `extend_seq_lens` (and its host list) all
    # `width`, `extend_start_loc` i * width, `seq_lens` each request's prefix + width (a padded
    # request's: `width`, over the padding row), and on the host `seq_lens_cpu` and
    # `extend_prefix_lens_cpu` (the capture's: every request padded). As for decode, a device
    # tensor the layers read must be static state or computed in the graph (the prefix
    # lengths, `seq_lens - extend_seq_lens`: in `cuda_graph_prologue`).

    def cuda_graph_prologue(self, forward_batch: ForwardBatch) -> None:
        """Device work a captured graph runs first, before the layers, on the static batch
        (recorded at capture; every replay runs it again on the refreshed buffers): metadata
        a backend would rather compute in the graph than launch from the host at replay.
        None by default."""
        return None

    # what `init_forward_metadata` planned for the current batch (a backend's own type)
    metadata: object | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """`kv_stored`: the new K/V are in the pool already, written where `kv_store_target`
        said (by the rotary kernel); the store is skipped."""
        md = self.metadata
        assert md is not None, "init_forward_metadata was not called for this batch"
        pool = forward_batch.kv_pool
        if not pool.quantized:
            if not kv_stored:
                out = self._attend_storing(q, k, v, layer, forward_batch, md)
                if out is not None:
                    return out
                self._store_kv(layer, forward_batch, k, v)
            return self._attend(q, k, v, layer, forward_batch, md)
        assert not kv_stored, "a float8 pool's K/V are quantized and stored by the backend"
        k, v = pool.quantize(layer.layer_id, k, v)
        self._store_kv(layer, forward_batch, k, v)
        out = self._attend(q, k, v, layer, forward_batch, md)
        v_scale = pool.v_scales[layer.layer_id]
        return out if v_scale == 1.0 else out * v_scale

    def kv_store_target(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where `forward` would store this layer's new K/V, for a kernel that writes them
        while it produces K (the rotary kernel's `kv_store`, one launch instead of two):
        (k_buffer, v_buffer, loc) of the Triton store's layout, or None where the backend
        stores them itself (a float8 pool, no Triton store). After such a write, call
        `forward` with `kv_stored=True`."""
        return None

    def _attend_storing(  # fmt: skip
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        forward_batch: ForwardBatch, md: object,
    ) -> torch.Tensor | None:
        """`_attend` by a kernel that also stores the new K/V (a 16-bit pool), or None where
        this backend stores them apart first (the default)."""
        return None

    def _store_kv(
        self, layer: AttentionLayer, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write the new tokens' K/V into the pool at `out_cache_loc`."""
        forward_batch.kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)

    @abstractmethod
    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        md: object,
    ) -> torch.Tensor:
        """Attention of this layer for the batch `md` was planned for (K/V already stored)."""


def triton_store_target(
    layer: AttentionLayer, forward_batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`kv_store_target` of a backend whose store is `kernels.kv_store.store_kv`: the layer's
    pool buffers and `out_cache_loc`, unless the pool is float8 (quantized before the store)."""
    pool = forward_batch.kv_pool
    if pool.quantized:
        return None
    k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
    return k_buf, v_buf, forward_batch.out_cache_loc


_BACKENDS = {
    "torch_native": "engine.attention.torch_native:TorchNativeAttnBackend",
    "triton": "engine.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "engine.attention.flashinfer_backend:FlashInferAttnBackend",
}


def create_attention_backend(name: str, **kwargs: object) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}; choose {sorted(_BACKENDS)}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**kwargs)
