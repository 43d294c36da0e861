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


class AttentionBackend(ABC):
    """Computes paged attention for one layer of one batch.

    `init_forward_metadata` runs once per batch (plan index tensors, masks, wrappers) and is
    reused by every layer. `forward` first writes the new tokens' K/V into the pool at
    `forward_batch.out_cache_loc`, then attends over each request's full context
    (`req_to_token[req_pool_indices[i], :seq_lens[i]]`), causal within the new tokens.

    Shapes: q [num_tokens, num_heads * head_dim], k/v [num_tokens, num_kv_heads * head_dim];
    returns [num_tokens, num_heads * head_dim] in q's dtype.
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...


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
