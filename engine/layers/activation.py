"""Activation functions, written as the Hugging Face reference computes them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_GELU_NEW_COEF = math.sqrt(2.0 / math.pi)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU (HF `NewGELUActivation`, same op order)."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_NEW_COEF * (x + 0.044715 * torch.pow(x, 3.0))))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_new,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported; choose one of {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for a fused [..., 2 * intermediate] gate_up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
