"""Rotary position embedding (RoPE) with the `default`, `linear`, `llama3`, `yarn` and
`longrope` frequency rules, over the whole head or its first `partial_rotary_factor` part.

The cos/sin table is precomputed for every position up to `max_position` as
`cos_sin_cache[pos] = cat(cos(pos * inv_freq), sin(pos * inv_freq)) * attention_factor`
([max_position, rotary_dim]), computed in float32 exactly as Hugging Face computes its
per-step cos/sin, then cast to the model dtype. It is a derived (non-checkpoint) buffer: the
loader materialises models on the meta device, so the table is (re)built by `init_buffers()`
once parameters exist.

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

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# older names of the same rules (Phi-3's first configs: "su"; transformers maps them too)
_ROPE_ALIASES = {"su": "longrope"}


def rope_parameters(config: object) -> dict:
    """The RoPE settings of a HF config as one dict with `rope_type` and `rope_theta`.

    Reads transformers 5 `rope_parameters` or the older `rope_scaling` + `rope_theta` pair;
    `partial_rotary_factor` and, for the scaled types, `original_max_position_embeddings` and
    `max_position_embeddings` are taken from the config where the dict lacks them (the
    config's own `original_max_position_embeddings` first, as transformers does for Phi-3).
    """
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(raw)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = _ROPE_ALIASES.get(rope_type, rope_type)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    partial = getattr(config, "partial_rotary_factor", None)
    if params.get("partial_rotary_factor") is None and partial is not None:
        params["partial_rotary_factor"] = partial
    max_positions = getattr(config, "max_position_embeddings", None)
    params.setdefault("max_position_embeddings", max_positions)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", max_positions)
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many leading features of a head rope rotates (`partial_rotary_factor` of them)."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def compute_inv_freq(head_dim: int, params: dict, context_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for the configured rope type; `head_dim`
    is the rotated dimension. `context_len` picks LongRoPE's factor set (`_longrope_factors`)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    if rope_type == "longrope":
        factors = _longrope_factors(head_dim, params, context_len)
        return 1.0 / (factors * params["rope_theta"] ** exponents)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, params)
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


def attention_factor(params: dict) -> float:
    """The factor on cos and sin (so on the attention scores, squared) of YaRN and LongRoPE:
    the config's `attention_factor`, else the one their papers derive from the scale."""
    rope_type = params["rope_type"]
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = scale_factor(params)
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def scale_factor(params: dict) -> float:
    """`factor`, else (Phi-3, DeepSeek-V3) max / original max positions."""
    if params.get("factor") is not None:
        return float(params["factor"])
    return params["max_position_embeddings"] / params["original_max_position_embeddings"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_factors(dim: int, params: dict, context_len: int | None) -> torch.Tensor:
    """LongRoPE's per-frequency divisors: `long_factor` when the served context is longer than
    the pretraining one (`original_max_position_embeddings`), else `short_factor`.
    transformers picks per forward by the longest sequence in it, so keys cached under one set
    would be read under the other once a sequence crosses that length; vLLM (and so sluice)
    fix the set by the context length instead (serve with `--context-length` at most the
    original length for the short factors)."""
    original = params["original_max_position_embeddings"]
    long = context_len is not None and context_len > original
    factors = params["long_factor" if long else "short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(
            f"rope {'long' if long else 'short'}_factor has {len(factors)} values; "
            f"the rotary dimension {dim} needs {dim // 2}"
        )
    return torch.tensor(factors, dtype=torch.float32)


def _yarn_inv_freq(dim: int, params: dict) -> torch.Tensor:
    """YaRN (Qwen2.5 / Qwen3 long context, DeepSeek): the low frequencies interpolated by
    `factor`, the high ones kept, a linear ramp between `beta_fast` and `beta_slow` turns."""
    base, factor = params["rope_theta"], scale_factor(params)
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no zero division)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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
    """`context_len`: the longest sequence served (LongRoPE's factor set depends on it)."""

    def __init__(
        self, head_dim: int, max_position: int, params: dict, context_len: int | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, params)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(
                f"rotary embedding needs an even rotary dimension of at most head_dim "
                f"{head_dim}, got {self.rotary_dim}"
            )
        self.max_position = max_position
        self.params = params
        self.context_len = context_len
        self.dtype = torch.get_default_dtype()
        # fail at construction on an unsupported rope type or a wrong factor list
        compute_inv_freq(self.rotary_dim, params, context_len)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        if not self.cos_sin_cache.is_meta:
            self.init_buffers()

    def init_buffers(self) -> None:
        device = self.cos_sin_cache.device
        inv_freq = compute_inv_freq(self.rotary_dim, self.params, self.context_len)
        pos = torch.arange(self.max_position, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        scale = attention_factor(self.params)
        if scale != 1.0:
            cache = cache * scale
        self.cos_sin_cache = cache.to(self.dtype).to(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, num_heads, head_dim] (any number of heads, e.g. q and k
        stacked) at `positions` [num_tokens]; returns a new contiguous tensor. With a partial
        rotary dimension the rest of each head is passed through."""
        dim = self.rotary_dim
        rot = x if dim == self.head_dim else x[..., :dim]
        if layer_kernel_on(x):
            out = apply_rotary(positions, rot, self.cos_sin_cache, dim)
        else:
            out = rotate_torch(positions, rot, self.cos_sin_cache, dim)
        return out if dim == self.head_dim else torch.cat((out, x[..., dim:]), dim=-1)

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
        if layer_kernel_on(qk) and self.rotary_dim == self.head_dim:
            target = forward_batch.attn_backend.kv_store_target(layer, forward_batch)
            if target is not None:
                store = KVStore(*target, v=v, q_heads=layer.num_heads)
                return apply_rotary(positions, qk, self.cos_sin_cache, self.head_dim, store), True
        return self(positions, qk), False

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, {self.params}"
        )


def rotate_torch(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """`RotaryEmbedding.forward` in torch, in the model dtype op by op (the kernel's
    reference)."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
