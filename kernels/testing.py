"""Random paged-KV batches for kernel tests and benchmarks (as `torch.testing` is for torch).

A `PagedCase` is one layer's view of a batch: a pool whose pages are handed out in shuffled
order (page 0 stays the padding page), requests in shuffled `req_to_token` rows, and the
cached prefix K/V already in the pool. Everything a kernel must not read is poisoned: free
slots hold large values and `req_to_token` past each request's length points at random
slots, so reading a wrong slot or a key past the end changes the result visibly.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from kernels.reference import store_kv_ref


def triton_test_device() -> tuple[str, str | None]:
    """Where kernel tests run, and why they cannot (None when they can).

    With CUDA: compiled kernels on "cuda". Without: the interpreter on "cpu", which needs
    TRITON_INTERPRET=1 before triton is first imported in the process: this sets it (unless
    it is set already), so call it before importing any kernel module.
    """
    if torch.cuda.is_available():
        return "cuda", None
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from kernels.jit import HAS_TRITON, interpreting

    if not HAS_TRITON:
        return "cpu", "triton is not installed (pip install triton)"
    if not interpreting():
        return "cpu", (
            "triton was imported before TRITON_INTERPRET=1 was set; set it in the environment "
            "(or tests/conftest.py) to run the kernels in the interpreter"
        )
    return "cpu", None


@dataclass
class PagedCase:
    q: torch.Tensor  # [N, Hq, D], the new tokens packed back to back
    k: torch.Tensor  # [N, Hk, D]
    v: torch.Tensor  # [N, Hk, D]
    k_buffer: torch.Tensor  # [num_slots, Hk, D]; prefixes stored, new tokens not yet
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [rows, max_context_len] int32
    req_pool_indices: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    extend_start_loc: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, prefix + extend
    out_cache_loc: torch.Tensor  # [N] int64, slot of each new token
    scale: float

    @property
    def max_extend_len(self) -> int:
        return int(self.extend_lens.max())

    def as_float8(self, dtype: torch.dtype) -> PagedCase:
        """The pool and the new K/V in float8 `dtype`, as an FP8 KV cache holds them (scale 1,
        the poison clamped into range); q keeps its dtype."""
        tensors = (self.k_buffer, self.v_buffer, self.k, self.v)
        self.k_buffer, self.v_buffer, self.k, self.v = (
            x.float().clamp(-240, 240).to(dtype) for x in tensors
        )
        return self

    def store_new_kv(self) -> None:
        """Write the new tokens' K/V into the pool (what a backend does before attending)."""
        store_kv_ref(self.k_buffer, self.v_buffer, self.out_cache_loc, self.k, self.v)


def make_paged_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedCase:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    batch_size = len(seq_lens)
    max_context_len = max(seq_lens) + page_size
    pages_needed = sum(-(-n // page_size) for n in seq_lens)
    num_pages = 1 + pages_needed + max(2, pages_needed // 4)  # some pages stay free
    free_pages = list(range(1, num_pages))
    rng.shuffle(free_pages)
    rows = list(range(batch_size + 2))
    rng.shuffle(rows)
    num_slots = num_pages * page_size
    req_to_token = torch.randint(0, num_slots, (len(rows), max_context_len), generator=gen)
    for row, seq_len in zip(rows, seq_lens, strict=False):
        pages = [free_pages.pop() for _ in range(-(-seq_len // page_size))]
        slots = [pages[j // page_size] * page_size + j % page_size for j in range(seq_len)]
        req_to_token[row, :seq_len] = torch.tensor(slots)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    poison = 30.0  # a stray read of a free slot dominates the softmax / output
    k_buffer = randn(num_slots, num_kv_heads, head_dim, std=poison)
    v_buffer = randn(num_slots, num_kv_heads, head_dim, std=poison)
    req_pool_indices = torch.tensor(rows[:batch_size])
    prefix_slots = torch.cat(
        [req_to_token[r, :p] for r, p in zip(rows, prefix_lens, strict=False)]
    ).long()
    k_buffer[prefix_slots] = randn(len(prefix_slots), num_kv_heads, head_dim)
    v_buffer[prefix_slots] = randn(len(prefix_slots), num_kv_heads, head_dim)
    out_cache_loc = torch.cat(
        [req_to_token[r, p:s] for r, p, s in zip(rows, prefix_lens, seq_lens, strict=False)]
    ).long()
    num_tokens = sum(extend_lens)
    lens = torch.tensor(extend_lens)
    case = PagedCase(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token.to(torch.int32),
        req_pool_indices=req_pool_indices,
        prefix_lens=torch.tensor(prefix_lens),
        extend_lens=lens,
        extend_start_loc=torch.cumsum(lens, 0) - lens,
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=out_cache_loc,
        scale=head_dim**-0.5,
    )
    return _to(case, torch.device(device))


def _to(case: PagedCase, device: torch.device) -> PagedCase:
    fields = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in vars(case).items()
    }
    return PagedCase(**fields)
