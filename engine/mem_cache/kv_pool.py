"""Per-layer K/V buffers addressed by slot index.

Layout: `k_buffer[layer]` and `v_buffer[layer]` are [num_slots, num_kv_heads, head_dim],
contiguous, so a slot index addresses one token's K (or V) for all heads. With
`page_size` P, slots p*P .. p*P+P-1 form page p (flashinfer's NHD paged layout is a view
[num_pages, P, H, D] of the same memory). Slot 0 (page 0) is never handed out: padded
tokens write there harmlessly.

With hybrid sliding-window memory (engine/mem_cache/swa_allocator.py) the layers in
`swa_layers` have buffers of `swa_num_slots` slots, addressed by swa slots.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        swa_layers: frozenset[int] = frozenset(),
        swa_num_slots: int = 0,
    ) -> None:
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.swa_layers = swa_layers
        self.swa_num_slots = swa_num_slots

        def buffer(layer: int) -> torch.Tensor:
            n = swa_num_slots if layer in swa_layers else num_slots
            return torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device)

        self.k_buffer = [buffer(i) for i in range(num_layers)]
        self.v_buffer = [buffer(i) for i in range(num_layers)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] (or flattened heads)."""
        k = k.view(-1, self.num_kv_heads, self.head_dim).to(self.dtype)
        v = v.view(-1, self.num_kv_heads, self.head_dim).to(self.dtype)
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )
