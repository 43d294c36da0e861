"""Resolve FutureMap placeholders in a batch's input ids, on the device.

With the overlap scheduler, batch N+1 is launched before batch N's sampled tokens reach the
CPU; a token that is not known yet is written as a negative id `-i`, meaning "the token that
will be at `future_buffer[i]`" (i >= 1). `resolve_future_tokens` replaces every negative id
by `future_buffer[-id]` in place, without a device-to-host sync.

Kernel grid: (cdiv(num_tokens, BLOCK),); each program handles BLOCK ids and stores only the
negative ones.
"""

from __future__ import annotations

import torch

from kernels.jit import HAS_TRITON, cdiv, launch_opts, tl, triton

if HAS_TRITON:
    from kernels.jit import pdl_prologue

    @triton.jit
    def _resolve_kernel(ids_ptr, future_ptr, num_tokens, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_prologue(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < num_tokens
        ids = tl.load(ids_ptr + offs, mask=in_range, other=0)
        pending = in_range & (ids < 0)
        resolved = tl.load(future_ptr + (-ids).to(tl.int64), mask=pending, other=0)
        tl.store(ids_ptr + offs, resolved.to(ids_ptr.dtype.element_ty), mask=pending)


def resolve_future_tokens(input_ids: torch.Tensor, future_buffer: torch.Tensor) -> torch.Tensor:
    """In place: `input_ids[j] = future_buffer[-input_ids[j]]` where `input_ids[j] < 0`.

    input_ids [N] int32/int64, future_buffer [M] int on the same device. The Triton kernel
    runs on CUDA; elsewhere (the CPU engine) the torch version does. Returns `input_ids`.
    """
    if HAS_TRITON and input_ids.is_cuda and input_ids.is_contiguous():
        return resolve_future_tokens_triton(input_ids, future_buffer)
    return resolve_future_tokens_torch(input_ids, future_buffer)


def resolve_future_tokens_triton(
    input_ids: torch.Tensor, future_buffer: torch.Tensor, block: int = 1024
) -> torch.Tensor:
    num_tokens = input_ids.shape[0]
    if num_tokens:
        grid = (cdiv(num_tokens, block),)
        _resolve_kernel[grid](input_ids, future_buffer, num_tokens, BLOCK=block, **launch_opts(4))
    return input_ids


def resolve_future_tokens_torch(
    input_ids: torch.Tensor, future_buffer: torch.Tensor
) -> torch.Tensor:
    """Reference and fallback: one gather and one `where`, no host sync."""
    pending = input_ids < 0
    resolved = future_buffer[(-input_ids).clamp_min(0)].to(input_ids.dtype)
    return input_ids.copy_(torch.where(pending, resolved, input_ids))
