"""The W8A8 int8 arithmetic (engine/layers/int8.py) against the formula written out here:
each input row scaled by its largest magnitude / 127, rounded half to even and clamped to
[-128, 127]; integer products summed, times the row's and the output channel's scales, plus
the bias. Zero rows stay zero; a row-parallel part is its own rows' arithmetic."""

from __future__ import annotations

import torch

from engine.layers.int8 import Int8Weight, int8_linear


def _reference(x, q_w, s_w, bias=None):
    x = x.float()  # (the scales and the rounding in float32, as the kernels compute them)
    s = x.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(x / s).clamp(-128, 127)
    y = (q.double() @ q_w.double().T) * s.double() * s_w.double()[None, :]
    return y if bias is None else y + bias.double()


def test_int8_linear_is_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g) * 3
    x[2] = 0.0  # (a zero row: scale 1, zeros out)
    x[4, :5] = torch.tensor([127.0, 0.5, -0.5, 1.5, 2.5]) * (x[4].abs().max() / 127)
    q_w = torch.randint(-128, 128, (40, 96), generator=g, dtype=torch.int8)
    s_w = torch.rand(40, generator=g) * 0.01
    bias = torch.randn(40, generator=g)
    for b in (None, bias):
        got = int8_linear(x, q_w, s_w, b)
        torch.testing.assert_close(got.double(), _reference(x, q_w, s_w, b), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
    assert torch.equal(int8_linear(x, q_w, s_w)[2], torch.zeros(40))
    half = int8_linear(x.bfloat16(), q_w, s_w)
    assert half.dtype == torch.bfloat16


def test_checkpoint_weight_parts() -> None:
    """Rows keep their scales, columns keep every row's (per output channel)."""
    w = Int8Weight(torch.arange(24, dtype=torch.int8).view(4, 6), torch.tensor([1.0, 2, 3, 4]))
    assert torch.equal(w.narrow(0, 1, 2).scale, torch.tensor([2.0, 3]))
    cols = w.narrow(1, 3, 3)
    assert torch.equal(cols.data, w.data[:, 3:]) and torch.equal(cols.scale, w.scale)
    torch.testing.assert_close(w.dequantize(torch.float32), w.data.float() * w.scale[:, None])


def test_the_triton_quantize_is_the_torch_one_bit_for_bit() -> None:
    """The one-launch quantization CUDA runs (kernels/fp8_gemm.quantize_rows_int8_triton,
    here in the interpreter) against the torch one: rows longer than its 1024-column steps,
    a zero row, ties at half steps; float32 and 16-bit inputs."""
    from engine.layers.int8 import quantize_rows_int8
    from kernels.fp8_gemm import quantize_rows_int8_triton
    from kernels.testing import triton_test_device

    device, skip = triton_test_device()
    if skip is not None:
        import pytest

        pytest.skip(skip)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 1300, generator=g) * 4
    x[1] = 0.0
    top = x[3].abs().max()
    x[3, :4] = torch.tensor([0.5, -1.5, 2.5, 126.5]) * (top / 127)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got_q, got_s = quantize_rows_int8_triton(x.to(dtype).to(device))
        want_q, want_s = quantize_rows_int8(x.to(dtype))
        assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_s.cpu(), want_s), dtype


def test_the_one_row_gemv_is_the_gemm_paths_arithmetic_bit_for_bit() -> None:
    """The batch-1 GEMV CUDA runs for one row (`int8_gemv`: kernels/fp8_gemm.py's GEMV in
    its int8 mode, here in the interpreter) against `int8_linear`'s other path (integer
    products summed exactly, here in float32 below 2^24, then (sum * s_x) * s_w + bias in
    float32): 37 rows (programs of 4) over 1300 columns (a 1024-column step and a masked
    one), with and without a bias, of float32 and bfloat16 inputs. (Its float32 result is
    compared before the cast to bfloat16: the interpreter truncates that cast, the GPU
    rounds to nearest as torch.)"""
    from engine.layers.int8 import int8_gemv, quantize_rows_int8
    from kernels.testing import triton_test_device

    device, skip = triton_test_device()
    if skip is not None:
        import pytest

        pytest.skip(skip)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1300, generator=g)
    q_w = torch.randint(-128, 128, (37, 1300), generator=g, dtype=torch.int8)
    s_w = torch.rand(37, generator=g) * 0.01
    bias = torch.randn(37, generator=g)
    for b in (None, bias):
        for dtype in (torch.float32, torch.bfloat16):
            q, s = quantize_rows_int8(x.to(dtype))
            want = int8_linear(x.to(dtype), q_w, s_w, None if b is None else b.to(dtype))
            got = int8_gemv(q.to(device), s.to(device), q_w.to(device), s_w.to(device),
                            None if b is None else b.to(dtype).to(device),
                            torch.float32)  # fmt: skip
            assert torch.equal(got.cpu().to(dtype), want), (b is None, dtype)
