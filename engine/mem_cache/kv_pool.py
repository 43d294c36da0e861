"""Per-layer K/V buffers addressed by slot index.

Layout: `k_buffer[layer]` and `v_buffer[layer]` are [num_slots, num_kv_heads, head_dim],
contiguous, so a slot index addresses one token's K (or V) for all heads. With
`page_size` P, slots p*P .. p*P+P-1 form page p (flashinfer's NHD paged layout is a view
[num_pages, P, H, D] of the same memory). Slot 0 (page 0) is never handed out: padded
tokens write there harmlessly.

With hybrid sliding-window memory (engine/mem_cache/swa_allocator.py) the layers in
`swa_layers` have buffers of `swa_num_slots` slots, addressed by swa slots.

An FP8 KV cache (`kv_cache_dtype` float8, engine/mem_cache/kv_quant.py) stores K / k_scale and
V / v_scale in float8, per layer scales (1.0 unless the checkpoint has them). `dtype` is then
the buffers' float8 type and `compute_dtype` the model's; attention reads the float8 values
as they are (converted to `compute_dtype`) and applies the scales itself: k_scale inside the
softmax scale, v_scale on the output (engine/attention/base.py).
"""

from __future__ import annotations

import torch

from engine.mem_cache.kv_quant import quantize_kv


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
        kv_cache_dtype: torch.dtype | None = None,
        shared: bool = False,
    ) -> None:
        """`dtype`: the model's; `kv_cache_dtype`: the buffers' when it differs (float8);
        `shared`: the V buffers are the K buffers (multi-head latent attention caches one
        latent per token, read as both; what is stored as V is what was stored as K)."""
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = dtype
        self.dtype = kv_cache_dtype or dtype  # what the buffers hold
        self.quantized = self.dtype != dtype
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        self.swa_layers = swa_layers
        self.swa_num_slots = swa_num_slots

        def buffer(layer: int) -> torch.Tensor:
            n = swa_num_slots if layer in swa_layers else num_slots
            return torch.zeros((n, num_kv_heads, head_dim), dtype=self.dtype, device=device)

        self.shared = shared
        self.k_buffer = [buffer(i) for i in range(num_layers)]
        self.v_buffer = self.k_buffer if shared else [buffer(i) for i in range(num_layers)]

    def set_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Per layer (k_scale, v_scale) of a quantized cache; layers not named get 1.0."""
        assert self.quantized, "KV scales apply to a float8 cache only"
        for layer in scales:
            if not 0 <= layer < self.num_layers:
                raise ValueError(
                    f"KV cache scales for layer {layer}: the model has {self.num_layers} layers"
                )
        if self.shared and any(k != v for k, v in scales.values()):
            raise ValueError(
                "KV cache scales: a latent cache stores K and V as one tensor, so each layer's "
                "k_scale and v_scale must be equal"
            )
        self.k_scales[:] = [1.0] * self.num_layers
        self.v_scales[:] = [1.0] * self.num_layers
        for layer, (k_scale, v_scale) in scales.items():
            self.k_scales[layer], self.v_scales[layer] = float(k_scale), float(v_scale)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer once (a shared pool's V buffers are its K buffers)."""
        return list(self.k_buffer) if self.shared else self.k_buffer + self.v_buffer

    def copy_slots(
        self, src: torch.Tensor, dst: torch.Tensor, full_to_swa: torch.Tensor | None = None
    ) -> None:
        """Every layer's K/V of (full) slots `src` into slots `dst` (int64, on the pool's
        device), the windowed layers' at their swa slots (`full_to_swa`, hybrid memory);
        every source is read before any destination is written, so a slot may be both."""
        windowed = (src, dst)
        if self.swa_layers:
            assert full_to_swa is not None, "hybrid memory: the windowed layers' slot map"
            windowed = (full_to_swa[src], full_to_swa[dst])
        for layer in range(self.num_layers):
            s, d = windowed if layer in self.swa_layers else (src, dst)
            k, v = self.k_buffer[layer], self.v_buffer[layer]
            for buf in (k,) if self.shared else (k, v):
                buf[d] = buf[s]  # (the right side is gathered first: overlaps are safe)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def quantize(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [num_tokens, num_kv_heads * head_dim] (or [.., heads, head_dim]) as the cache
        stores them: [num_tokens, num_kv_heads, head_dim] in `dtype`."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        k, v = k.view(shape), v.view(shape)
        if not self.quantized:
            return k.to(self.dtype), v.to(self.dtype)
        return (
            quantize_kv(k, self.k_scales[layer_id], self.dtype),
            quantize_kv(v, self.v_scales[layer_id], self.dtype),
        )

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] (or flattened heads), in the model's
        dtype or already quantized (`quantize`)."""
        if k.dtype != self.dtype:
            k, v = self.quantize(layer_id, k, v)
        shape = (-1, self.num_kv_heads, self.head_dim)
        self.k_buffer[layer_id][loc] = k.view(shape)
        self.v_buffer[layer_id][loc] = v.view(shape)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, shared: bool = False
    ) -> int:
        size = num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return size if shared else 2 * size
