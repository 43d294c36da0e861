"""The two-stage argmax (kernels/argmax.py) against torch.argmax, in the Triton interpreter on
CPU and compiled on CUDA: ties (the first index wins, across chunks too), NaN (the first NaN
wins, in any chunk), all -inf rows, half and float32 inputs, a strided row, widths that are
not a multiple of the chunk, and one chunk or many."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

from kernels.argmax import argmax_rows  # noqa: E402


def _check(x: torch.Tensor, block: int) -> None:
    got = argmax_rows(x, block=block)
    want = torch.argmax(x.float().cpu(), dim=-1)  # (torch on CPU: the reference semantics)
    assert got.dtype == torch.int64 and got.device == x.device
    assert got.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols,block", [(1000, 64), (1000, 4096), (257, 16), (5, 4)])
def test_random_rows(dtype, cols, block):
    gen = torch.Generator().manual_seed(cols + block)
    x = torch.randn(7, cols, generator=gen).to(dtype).to(DEVICE)
    _check(x, block)


@pytest.mark.parametrize("block", [16, 64, 1024])
def test_ties_nan_and_inf(block):
    cols = 300
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(0))
    x[0, [17, 150, 299]] = 9.0  # ties in three chunks (block 16, 64): the first wins
    x[1, [20, 21]] = 9.0  # ties in one chunk
    x[2, [40, 250]] = float("nan")  # the first NaN wins over any number and the later NaN
    x[2, 10] = float("inf")
    x[3] = float("-inf")  # index 0
    x[4, 299] = float("nan")  # a NaN in the last, partial chunk
    x[5, :] = 1.0  # all equal
    x[6, 5] = float("inf")
    x[6, 200] = float("inf")
    x[7, 0] = float("nan")
    _check(x.to(DEVICE), block)


def test_strided_rows_and_empty_batch():
    x = torch.randn(4, 600, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _check(x[:, :500], 64)  # rows 600 apart
    assert argmax_rows(x[:0], 64).shape == (0,)
