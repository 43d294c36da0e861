"""Triton glue shared by the kernels: the optional import, the interpreter check, and the
launch settings that differ between the GPU and the interpreter.

Triton chooses compiled or interpreted execution when it is *imported*: with
`TRITON_INTERPRET=1` in the environment at that moment, every `@triton.jit` function (its
standard library's included) becomes an interpreter function that runs on CPU tensors. A
process therefore runs Triton one way only; tests that use the interpreter must set the
variable before anything imports triton (torch._dynamo does, when triton is installed).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # kernels then fall back to their torch references where they have one
    triton = None
    tl = None
try:  # grid dependency control (Triton 3.3+): programmatic dependent launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

HAS_TRITON = triton is not None
HAS_GDC = gdc_wait is not None

LOG2E = 1.4426950408889634  # kernels compute softmax with exp2 and fold log2(e) into the scale


@functools.cache
def interpreting() -> bool:
    """Whether this process's Triton runs kernels in the CPU interpreter."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.max, InterpretedFunction)


def compiled_on(x: torch.Tensor) -> bool:
    """Whether a kernel on `x` runs compiled: on CUDA with Triton installed and not in the
    interpreter. The engine's layers take their torch code otherwise (CPU stays bit-exact)."""
    return x.is_cuda and HAS_TRITON and not interpreting()


_LAYER_KERNELS = [True]  # (a list: set by `use_layer_kernels`)


def use_layer_kernels(on: bool) -> None:
    """`--disable-layer-kernels` off: the model layers' fused kernels (norms, activations,
    rotary and its K/V store) give way to their torch code, in this process."""
    _LAYER_KERNELS[0] = on


def layer_kernel_on(x: torch.Tensor) -> bool:
    """Whether a model layer runs its fused kernel on `x`: compiled there, and not turned
    off by `use_layer_kernels(False)` (A/B runs, or a kernel to rule out)."""
    return _LAYER_KERNELS[0] and compiled_on(x)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SM count; off CUDA (the interpreter) the H100's 132, so that the tiles and
    split counts chosen from it match the GPU's."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on `device`: CUDA, or CPU under the interpreter."""
    return HAS_TRITON and (device.type == "cuda" or interpreting())


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in: the cache's, or q's over a float8 cache (whose values
    the kernels convert as they load them; the caller folds the scales in)."""
    return q_dtype if kv_dtype.itemsize == 1 else kv_dtype


def dot_dtype(dtype: torch.dtype) -> Any:
    """Operand type of `tl.dot` for K/V of `dtype`: the native half type on the GPU (tensor
    cores), float32 under the interpreter (which multiplies bf16 bit patterns as integers)."""
    if interpreting() or dtype == torch.float32:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 K/V is the exactness path: no TF32 rounding of `tl.dot` operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


# --- Programmatic dependent launch (Hopper and later) ----------------------------------------
# A kernel launched with the PDL attribute may start while the kernel before it in the stream
# is still running: its programs are scheduled once every program of that kernel has executed
# `griddepcontrol.launch_dependents` (or exited). It must therefore wait
# (`griddepcontrol.wait`: the earlier kernel complete, its writes visible) before it touches
# memory an earlier kernel writes or reads. What it gains is the launch and ramp-up gap between
# two kernels (~1 us in a CUDA graph: 0.6 us measured between the kernels of a decode step on
# the H100, plus the tail of the earlier one), which at batch 1 is paid ~100 times a step.
#
# The rule the kernels keep (`pdl_prologue`, the first thing each does, in every program):
# wait, then let the next kernel launch. Waiting in every program before any load or store
# makes it safe next to any kernel: one launched without the attribute (cuBLAS, torch's) waits
# for the whole of the one before it as always, and since a waiting kernel completes only after
# the one before it did, the order is transitive along the chain. Calling launch_dependents
# right after the wait lets the next kernel's programs be placed (and run their own prologue
# up to their wait) while this one computes.
_PDL = [False]  # (a list: set by `use_pdl`)


def use_pdl(on: bool) -> None:
    """`--enable-pdl`: the Triton kernels launch as programmatic dependent launches in this
    process. The caller checks `pdl_supported` first."""
    _PDL[0] = on


def pdl_on() -> bool:
    """Whether the kernels' launchers launch with PDL now (`use_pdl`)."""
    return _PDL[0]


def launch_opts(num_warps: int) -> dict[str, Any]:
    """A launch's options: the kernel's `PDL` constexpr (every sluice kernel begins with
    `pdl_prologue(PDL)`; true while `use_pdl` is on) and, compiled, its warps and with PDL the
    launch attribute (the interpreter takes neither)."""
    pdl = _PDL[0]
    if interpreting():
        return {"PDL": pdl}
    return {"PDL": pdl, "num_warps": num_warps, **({"launch_pdl": True} if pdl else {})}


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL: compiled Triton (the interpreter has
    no grid dependency control) on a GPU of compute capability 9.0 (Hopper) or later."""
    if not HAS_GDC or interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


if HAS_GDC:

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr):
        """With PDL: wait for the kernel before this one (complete, its writes visible), then
        let the next one launch. Called first, in every program, before any load or store."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

elif HAS_TRITON:

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr):
        """(A Triton without grid dependency control: `pdl_supported` is False, PDL never on.)"""
        pass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())
