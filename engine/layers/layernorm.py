"""Normalisation layers.

`RMSNorm` follows Hugging Face's Llama op order exactly (upcast to float32, mean of
squares, rsqrt, cast back, scale) so float32 outputs match the reference bit for bit.
It optionally fuses the residual add that precedes it, as SGLang's does:
`norm(x, residual)` returns `(norm(x + residual), x + residual)`. On CUDA both forms run as
one Triton kernel (kernels/fused_norm.py, same op order; torch elsewhere).

`LayerNorm` (GPT-2) is `nn.LayerNorm` (same parameters) with the same optional residual add;
on CUDA one Triton kernel as well, whose float32 arithmetic is `F.layer_norm`'s up to the
last bit of the mean and variance.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_norm
from kernels.jit import layer_kernel_on


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise over the last dim; `weight` broadcasts against it."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if layer_kernel_on(x):
            if residual is None:
                return fused_norm.rms_norm(x, self.weight, self.eps)
            return fused_norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (
            layer_kernel_on(x)
            and self.weight is not None
            and self.weight.dtype == x.dtype
            and x.shape[-1] <= fused_norm.MAX_HIDDEN
        ):
            out, summed = fused_norm.fused_add_layer_norm(
                x, residual, self.weight, self.bias, self.eps
            )
            return out if summed is None else (out, summed)
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (`x * (1 + weight)`), and the
    scaling happens in float32 before the cast back (Llama casts first). Same op order as
    transformers' Gemma3RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
