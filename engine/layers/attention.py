"""The model-side attention layer: shape facts plus a call into the batch's backend.

The layer holds no K/V and no kernels. The backend (`forward_batch.attn_backend`) writes the
new tokens' K/V into `forward_batch.kv_pool` at layer `layer_id` and attends over each
request's cached context, so the same model code runs on every backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    """Implements the backend's `AttentionLayer` protocol.

    `sliding_window` W (None: the whole context): the query at position p sees keys
    p - W + 1 .. p only, as transformers' sliding-window mask. The pool still holds every
    token's K/V; the backends skip or mask what lies outside the window.

    `logit_cap` c (None: none): each score s = scaling * q.k becomes c * tanh(s / c) before
    the mask and the softmax (Gemma 2's `attn_logit_softcapping`).

    `sinks` (gpt-oss's): a learned logit per query head, `self.sinks` [num_heads], that joins
    each softmax as one more key with no value: the weights of the real keys sum to less than
    one. The Triton and torch_native backends compute it (engine/runner_attention.py keeps
    such a model off flashinfer).

    q: [num_tokens, num_heads * head_dim] (or [num_tokens, num_heads, head_dim]);
    k, v: [num_tokens, num_kv_heads * head_dim]; returns [num_tokens, num_heads * head_dim].
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 (got {sliding_window})")
        self.sliding_window = sliding_window
        if logit_cap is not None and not logit_cap > 0:
            raise ValueError(f"logit_cap must be positive (got {logit_cap})")
        self.logit_cap = logit_cap
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """`kv_stored`: k and v are in the pool already (`RotaryEmbedding.rotate_and_store`)."""
        if kv_stored:
            return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, True)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scaling={self.scaling:.4g}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
            + (f", logit_cap={self.logit_cap}" if self.logit_cap else "")
            + (", sinks" if self.sinks is not None else "")
        )
