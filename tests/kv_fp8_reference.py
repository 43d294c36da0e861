"""Reference for FP8 KV-cache tests: transformers with every attention layer's keys and values
(after RoPE and the key norm, as the cache holds them) rounded to float8 and back, K / k_scale
and V / v_scale per layer, before its own eager attention runs. That is what an FP8 cache
computes: every key a query sees, its own included, as stored."""

from __future__ import annotations

import sys
from typing import Any

import torch

from engine.mem_cache.kv_quant import quantize_kv

NAME = "sluice_fp8_kv_reference"


def round_trip(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return quantize_kv(x, scale, dtype).to(x.dtype) * scale


def hf_fp8_kv_logits(
    path: str,
    seqs: Any,
    kv_dtype: torch.dtype | None,
    scales: dict[int, tuple[float, float]] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list:
    """transformers' logits (float32, on the CPU) at every position of `seqs`, with K/V rounded
    to `kv_dtype` (None: not rounded; the same eager attention) with `scales`
    ({layer: (k_scale, v_scale)}, 1.0 for a layer not named)."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.masking_utils import eager_mask

    scales = scales or {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if kv_dtype is not None:
            k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
            key, value = round_trip(key, k_scale, kv_dtype), round_trip(value, v_scale, kv_dtype)
        # the model's own eager attention (soft-capping, its mask handling)
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # additive masks, never skipped
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=NAME)
    model = model.to(device, dtype).eval()
    with torch.inference_mode():
        out = [model(torch.tensor([list(s)], device=device)).logits[0].float().cpu() for s in seqs]
    del model
    return out
