"""The weight-only integer GEMM (kernels/int_gemm.py, under TRITON_INTERPRET=1) against the
weight compressed-tensors' own packing and the plain formula give: 4 and 8 bits, groups of
16 to 64 and per channel, symmetric and with zero points, one row (the GEMV kernel, and the
GEMM) and several, ragged tiles, with and
without a bias, in float32 (tight) and 16 bits (to their rounding); the torch reference
(the CPU path of IntWeightLinear) against the same; zero points unpacked as
compressed-tensors packs them (along the rows)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.int_weight import unpack_zero_points
from kernels.int_gemm import dequantize_int, int_gemm, int_gemm_reference

pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32

DEVICE = "cpu"


def _case(bits: int, group: int, symmetric: bool, n: int = 40, k: int = 128, seed: int = 0):
    """(packed, scale, zero, the float weight) of a random n x k weight."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zero = None if symmetric else torch.randint(lo, hi, (n, k // group), generator=gen,
                                                dtype=torch.int8)  # fmt: skip
    z = 0.0 if zero is None else zero.float().repeat_interleave(group, 1)
    weight = (q.float() - z) * scale.repeat_interleave(group, 1)
    return pack(q, bits), scale, zero, weight


@pytest.mark.parametrize(("bits", "group", "symmetric"), [
    (4, 16, True), (4, 32, False), (4, 128, True), (8, 64, True), (8, 16, False),
])  # fmt: skip
@pytest.mark.parametrize("m", [1, 19])
def test_int_gemm_matches_the_unpacked_weight(bits: int, group: int, symmetric: bool, m: int):
    packed, scale, zero, weight = _case(bits, group, symmetric)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, weight.shape[1], generator=gen)
    bias = torch.randn(weight.shape[0], generator=gen)
    want = x.double() @ weight.double().T + bias.double()
    for b in (None, bias):
        for gemv in (True, False) if m == 1 else (True,):  # (one row: the GEMV kernel first)
            got = int_gemm(x, packed, scale, zero, bits, group, b, gemv=gemv)
            expected = want if b is not None else want - bias.double()
            torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    ref = int_gemm_reference(x, packed, scale, zero, bits, group, bias)
    torch.testing.assert_close(ref.double(), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dequantize_int(packed, scale, zero, bits, group, 128,
                                              torch.float32), weight)  # fmt: skip


@pytest.mark.parametrize(("bits", "symmetric", "k"), [(4, False, 120), (8, True, 1040)])
@pytest.mark.parametrize("m", [1, 19])
def test_a_group_index_gives_each_column_its_groups_scale(bits: int, symmetric: bool, k: int,
                                                          m: int):  # fmt: skip
    """`gidx` (a row-parallel part of a weight with activation ordering: its columns in the
    input's order, each of any of the full weight's groups): column c's scale and zero point
    are those of group gidx[c], in the GEMM (64-column steps across groups), the GEMV (each
    integer gathers its own) and the torch reference; K 120 is no whole number of 16-column
    tiles, 1040 is two GEMV steps."""
    gen = torch.Generator().manual_seed(5)
    n, groups = 37, 9
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=gen) * 0.05 + 0.01
    zero = None if symmetric else torch.randint(lo, hi, (n, groups), generator=gen,
                                                dtype=torch.int8)  # fmt: skip
    gidx = torch.randint(0, groups, (k,), generator=gen, dtype=torch.int32)
    z = 0.0 if zero is None else zero.float()[:, gidx.long()]
    weight = (q.float() - z) * scale[:, gidx.long()]
    packed = pack(q, bits)
    x = torch.randn(m, k, generator=gen)
    want = x.double() @ weight.double().T
    for gemv in (True, False) if m == 1 else (True,):
        got = int_gemm(x, packed, scale, zero, bits, 16, gemv=gemv, gidx=gidx)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    ref = int_gemm_reference(x, packed, scale, zero, bits, 16, gidx=gidx)
    torch.testing.assert_close(ref.double(), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="whole words"):
        int_gemm(x[:, :-1], packed, scale, zero, bits, 16, gidx=gidx[:-1])


@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 16, False), (8, 1040, True)])
def test_gemv_over_ragged_rows_and_several_steps(bits: int, group: int, symmetric: bool):
    """The one-row kernel where neither the rows (37, programs of 4) nor K (1040: a step of
    1024 columns and a masked one) fill its tiles: groups of 16 (words of 8 four-bit
    integers: two a group) and a whole-row group of 8-bit ones."""
    packed, scale, zero, weight = _case(bits, group, symmetric, n=37, k=1040, seed=6)
    x = torch.randn(1, 1040, generator=torch.Generator().manual_seed(7))
    got = int_gemm(x, packed, scale, zero, bits, group)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, atol=1e-4,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int_gemm_in_16_bits(dtype: torch.dtype) -> None:
    """16-bit activations and scales: the kernel's float32 accumulation is within the
    output's rounding of the float64 product (the torch path rounds the weight first)."""
    packed, scale, zero, weight = _case(4, 32, False, n=72, k=256, seed=3)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = x.double() @ weight.double().T
    scale_err = (scale.to(dtype).double() - scale.double()).abs().max() / scale.min()
    tol = want.abs().max().item() * (2 * 2.0 ** -8 + scale_err.item())
    for rows in (slice(None), slice(0, 1)):  # (one row: the GEMV)
        got = int_gemm(x[rows], packed, scale.to(dtype), zero, 4, 32)
        assert got.dtype == dtype
        assert (got.double() - want[rows]).abs().max().item() < tol


def test_per_channel_is_one_group_of_the_whole_row() -> None:
    packed, scale, zero, weight = _case(8, 128, True, k=128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    got = int_gemm(x, packed, scale, None, 8, 128)
    torch.testing.assert_close(got, x @ weight.T, atol=1e-4, rtol=1e-5)


def test_zero_points_unpack_as_compressed_tensors_packs_them() -> None:
    """Zero points [rows, groups] packed along the rows (`packed_dim=0`), 4 and 8 bits."""
    for bits in (4, 8):
        lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
        zero = torch.randint(lo, hi, (40, 6), generator=torch.Generator().manual_seed(bits),
                             dtype=torch.int8)  # fmt: skip
        got = unpack_zero_points(pack(zero, bits, packed_dim=0), bits, 40)
        assert torch.equal(got, zero)


def test_groups_must_be_whole_tiles() -> None:
    packed, scale, zero, _ = _case(4, 16, True)
    with pytest.raises(ValueError, match="multiple of 16 dividing K"):
        int_gemm(torch.randn(2, 128), packed, scale, zero, 4, 24)
