"""An FP8 KV cache (`kv_cache_dtype`, SGLang's and vLLM's flag): K and V stored in float8, half
the bytes of bfloat16, so twice the tokens fit in the same memory.

A token's K is stored as `K / k_scale` rounded to float8 (saturated at the format's largest
value), V likewise with `v_scale`; attention computes with the stored values times their
scale. The scales are per layer: 1.0 (what vLLM and SGLang use without calibration), or those
of the checkpoint, under the names calibration tools write (`take_kv_scales`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_FLOAT8 = {
    "fp8": torch.float8_e4m3fn,  # vLLM's name for e4m3
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# Checkpoint names of KV-cache scales (one scalar per layer), by what they scale:
# self_attn.{k,v}_scale (compressed-tensors, Quark, current ModelOpt), self_attn.kv_scale (one
# for both, older), {k,v}_proj.output_scale (AutoFP8, older ModelOpt), {k,v}_proj.{k,v}_scale.
_KV_SCALE = re.compile(
    r"(?:^|\.)(?:layers|layer|h)\.(\d+)\..*?"
    r"(?:\.(k|v|kv)_scale|\.(k|v)_proj\.output_scale)$"
)
# attention-side scales for FP8 queries and probabilities (Quark): attention runs in the model
# dtype here, so they have no use
_UNUSED = re.compile(r"\.self_attn\.(?:q_scale|prob_scale)$")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in _FLOAT8:
        raise ValueError(f"kv_cache_dtype: {name!r} not in {KV_CACHE_DTYPES}")
    return _FLOAT8[name]


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` in float8 `dtype`, saturated at its largest finite value (a plain cast would
    give NaN (e4m3fn) or inf (e5m2) on CUDA for larger values)."""
    if scale != 1.0:
        x = x.float() / scale
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def take_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[int, tuple[float, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its KV-cache scales, which go into `found` as
    {layer: (k_scale, v_scale)} (a layer with only one of them gets 1.0 for the other)."""
    for name, tensor in weights:
        if _UNUSED.search(name):
            continue
        match = _KV_SCALE.search(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(
                f"{name}: a KV-cache scale must be one number per layer (shape "
                f"{tuple(tensor.shape)}); per-head scales are not supported"
            )
        layer, which = int(match.group(1)), match.group(2) or match.group(3)
        value = float(tensor.float().item())
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}: KV-cache scale {value} must be a positive number")
        k_scale, v_scale = found.get(layer, (1.0, 1.0))
        found[layer] = (
            value if which in ("k", "kv") else k_scale,
            value if which in ("v", "kv") else v_scale,
        )
