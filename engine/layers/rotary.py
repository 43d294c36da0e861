"""Rotary position embedding (RoPE) with the `default`, `linear` and `llama3` frequency rules.

The cos/sin table is precomputed for every position up to `max_position` as
`cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq))` ([max_position, head_dim]),
computed in float32 exactly as Hugging Face computes its per-step cos/sin, then cast to the
model dtype. It is a derived (non-checkpoint) buffer: the loader materialises models on the
meta device, so the table is (re)built by `init_buffers()` once parameters exist.

Rotation uses the "rotate half" (GPT-NeoX) layout of Llama-family checkpoints: the first and
second halves of each head are the two coordinates of each rotated pair. On CUDA the rotation
is one Triton kernel (kernels/rotary.py, float32 arithmetic rounded once); `rotate_torch`
elsewhere. `rotate_and_store` also writes the layer's new K/V into the KV pool in that
kernel where the attention backend lets it (`AttentionBackend.kv_store_target`): one launch a
layer instead of the rotary's and the store's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.jit import layer_kernel_on
from kernels.rotary import KVStore, apply_rotary

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch
    from engine.layers.attention import PagedAttention

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: object) -> dict:
    """The RoPE settings of a HF config as one dict with `rope_type` and `rope_theta`.

    Reads transformers 5 `rope_parameters` or the older `rope_scaling` + `rope_theta` pair.
    """
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(raw)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for the configured rope type."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.params = params
        self.dtype = torch.get_default_dtype()
        compute_inv_freq(head_dim, params)  # fail at construction on an unsupported rope type
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        if not self.cos_sin_cache.is_meta:
            self.init_buffers()

    def init_buffers(self) -> None:
        device = self.cos_sin_cache.device
        inv_freq = compute_inv_freq(self.head_dim, self.params)
        pos = torch.arange(self.max_position, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(self.dtype)
        self.cos_sin_cache = cache.to(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, num_heads, head_dim] (any number of heads, e.g. q and k
        stacked) at `positions` [num_tokens]; returns a new contiguous tensor."""
        if layer_kernel_on(x):
            return apply_rotary(positions, x, self.cos_sin_cache, self.head_dim)
        return rotate_torch(positions, x, self.cos_sin_cache, self.head_dim)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        v: torch.Tensor,
        layer: PagedAttention,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, bool]:
        """`forward(positions, qk)` for q and k stacked ([tokens, heads + kv_heads, head_dim]);
        on CUDA, where the batch's attention backend has a `kv_store_target` for `layer`, the
        same kernel writes the rotated K and `v` into the pool. Returns (rotated qk, whether
        the K/V are stored: pass it to the attention as `kv_stored`)."""
        if layer_kernel_on(qk):
            target = forward_batch.attn_backend.kv_store_target(layer, forward_batch)
            if target is not None:
                store = KVStore(*target, v=v, q_heads=layer.num_heads)
                return apply_rotary(positions, qk, self.cos_sin_cache, self.head_dim, store), True
        return self(positions, qk), False

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, {self.params}"


def rotate_torch(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """`RotaryEmbedding.forward` in torch, in the model dtype op by op (the kernel's
    reference)."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
