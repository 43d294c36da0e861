"""What the flashinfer backend (engine/attention/flashinfer_backend.py) needs and can run:
an importable flashinfer and a CUDA device, its dtypes and head sizes, the pool's page
layout, the model's sliding windows and attention soft-cap. Checked when the backend is
built, and by the model runner's default backend choice."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.mem_cache.kv_pool import KVPool

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
KERNEL_BACKEND = "fa2"  # flashinfer's FA2 kernels for every wrapper (flashinfer_backend.py)


@functools.cache
def flashinfer_available() -> bool:
    """A CUDA device is present and flashinfer imports (a broken install counts as absent)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def load_flashinfer(device: torch.device) -> ModuleType:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            f"attention_backend='flashinfer' needs a CUDA device (got {device}); "
            "use attention_backend='torch_native' on CPU"
        )
    try:
        import flashinfer
    except Exception as e:
        raise RuntimeError(
            "attention_backend='flashinfer' needs the flashinfer-python package "
            f"(pip install flashinfer-python; importing it failed: {e}); "
            "or use attention_backend='triton'"
        ) from e
    return flashinfer


def model_windows(model_config: ModelConfig) -> tuple[int, bool]:
    """(window_left of the model's sliding-window layers, or -1; whether some layer attends to
    the whole context). One window per model: flashinfer plans a wrapper per window."""
    windows = getattr(model_config, "sliding_windows", ()) or (None,)
    sizes = sorted({w for w in windows if w is not None})
    if len(sizes) > 1:
        raise ValueError(
            f"attention_backend='flashinfer' runs one sliding window per model (this one has "
            f"{sizes}); use attention_backend='triton'"
        )
    return (sizes[0] - 1 if sizes else -1), any(w is None for w in windows)


def model_logit_cap(model_config: ModelConfig) -> float:
    """The attention soft-cap of the model's layers (Gemma 2), 0.0 for none. flashinfer picks
    the capped kernel variant at plan time, and one plan serves every layer."""
    return float(getattr(model_config, "attn_logit_cap", None) or 0.0)


def check_supported(dtype: torch.dtype, head_dim: int, page_size: int, kv_pool: KVPool) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention_backend='flashinfer' runs float16 and bfloat16 (the model is {dtype}); "
            "use attention_backend='triton' or 'torch_native' for float32"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"attention_backend='flashinfer' supports head_dim {SUPPORTED_HEAD_DIMS} "
            f"(the model has {head_dim}); use attention_backend='triton'"
        )
    if kv_pool.page_size != page_size or kv_pool.num_slots % page_size:
        raise ValueError(
            f"KV pool of {kv_pool.num_slots} slots in pages of {kv_pool.page_size} "
            f"does not split into pages of {page_size}"
        )
