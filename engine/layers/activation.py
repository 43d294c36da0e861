"""Activation functions, written as the Hugging Face reference computes them.

On CUDA, `gelu_new` and `SiluAndMul` run as one Triton kernel each (kernels/activation.py):
SiLU-and-mul rounds as the torch code does; gelu_new computes in float32 and rounds once,
so in half precision it differs from the op-by-op torch code by rounding only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import activation as fused
from kernels.jit import layer_kernel_on

_GELU_NEW_COEF = math.sqrt(2.0 / math.pi)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU: the fused kernel on CUDA, else `gelu_new_torch`."""
    if layer_kernel_on(x):
        return fused.gelu_new(x)
    return gelu_new_torch(x)


def gelu_new_torch(x: torch.Tensor) -> torch.Tensor:
    """HF `NewGELUActivation`, same op order (the reference of the kernel)."""
    return 0.5 * x * (1.0 + torch.tanh(_GELU_NEW_COEF * (x + 0.044715 * torch.pow(x, 3.0))))


def linear_gelu_tanh(
    x: torch.Tensor, linear: nn.Linear, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`act(linear(x))` where `act` is GELU's tanh form (gelu_new, gelu_pytorch_tanh) and the
    layer has a bias: on CUDA, with the layer kernels on, one cuBLASLt GEMM whose epilogue
    adds the bias and applies the GELU to the float32 accumulator
    (`torch._addmm_activation`; the activation kernel and its launch go), else the layer then
    `act`. CUDA only: torch's CPU `_addmm_activation` applies the erf form, its CUDA one
    (epilogue or fallback) the tanh form."""
    if (
        x.is_cuda
        and x.dim() == 2
        and type(linear) is nn.Linear
        and linear.bias is not None
        and x.dtype == linear.weight.dtype
        and layer_kernel_on(x)
    ):
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)
    return act(linear(x))


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
        if layer_kernel_on(x):
            return fused.silu_and_mul(x)
        return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """`SiluAndMul` in torch (the reference of the kernel)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
