"""The small-batch GEMV (kernels/gemv.py) against a float64 matmul, in the Triton interpreter on
CPU and compiled on CUDA: one row (the reduction path) and 2-16 rows (the dot path), float32 /
bfloat16 / float16, with and without bias, N and K that are and are not multiples of the
tile, strided x rows and a strided output (the lm_head's padded rows), and tile overrides."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

from kernels.gemv import MAX_M, gemv, gemv_config  # noqa: E402

MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within one unit in the last place of y's dtype (the interpreter truncates its float32
    -> 16-bit casts where CUDA rounds to nearest) plus float32 accumulation error."""
    want = x.double().cpu() @ w.double().cpu().T
    if b is not None:
        want += b.double().cpu()
    magnitude = x.double().cpu().abs() @ w.double().cpu().abs().T
    tol = want.abs() * 2.0 ** -MANTISSA[y.dtype] + magnitude * x.shape[1] * 2.0**-24 + 1e-30
    err = (y.double().cpu() - want).abs()
    assert y.dtype == x.dtype and y.shape == want.shape
    assert (err <= tol).all(), f"max error {err.max():.3g}, tolerance there {tol[err.argmax()]}"


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,bias",
    [
        (1, 256, 512, False),  # every tile full
        (1, 100, 70, True),  # ragged N and K
        (2, 64, 256, True),
        (3, 100, 70, False),
        (5, 130, 600, True),
        (MAX_M, 48, 96, False),
    ],
)
def test_matches_float64_matmul(dtype, m, n, k, bias):
    x, w, b = _inputs(m, n, k, dtype, bias, seed=m * n + k)
    _check(gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [1, 4])
def test_strided_input_rows_and_padded_output_rows(m):
    """x a column slice of a wider tensor; out the first n columns of rows 64 wide (what the
    lm_head writes into): the padding stays untouched."""
    n, k = 50, 96
    wide = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = wide[:, :k]
    _, w, b = _inputs(m, n, k, torch.float32, True)
    buf = torch.full((m, 64), 7.0, device=DEVICE)
    y = gemv(x, w, b, out=buf[:, :n])
    assert y.data_ptr() == buf.data_ptr()
    _check(y, x, w, b)
    assert (buf[:, n:] == 7.0).all()


@pytest.mark.parametrize(
    "m,config",
    [
        (1, {"BLOCK_N": 1, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}),
        (1, {"BLOCK_N": 64, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 4}),
        (6, {"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2}),
    ],
)
def test_tile_overrides(m, config):
    """The benchmark's sweep passes tiles other than gemv_config's: any of them is exact."""
    x, w, b = _inputs(m, 200, 300, torch.bfloat16, True, seed=3)
    _check(gemv(x, w, b, config=config), x, w, b)


def test_config_takes_the_h100_sweeps_tiles():
    """The Llama 3.2 1B projections: the tiles the H100 sweep measured fastest
    (results/gpu_gemv.json), within the register budget of a one-row program."""
    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
              "down": (2048, 8192), "lm_head": (128256, 2048)}  # fmt: skip
    one_row = {name: gemv_config(1, n, k) for name, (n, k) in shapes.items()}
    for name in ("o", "gate_up"):
        assert one_row[name] == {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2}
    assert one_row["down"]["BLOCK_K"] == 2048 and one_row["qkv"]["BLOCK_N"] == 4
    assert one_row["lm_head"] == {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 2}
    for cfg in one_row.values():  # a float32 accumulator of <= 64 registers a thread
        assert cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 64 * 32 * cfg["num_warps"]
    for m in (2, 8, 16):
        for n, k in shapes.values():
            assert gemv_config(m, n, k) == {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4,
                                            "num_stages": 4}
    assert gemv_config(1, 300, 200)["BLOCK_K"] == 256  # no wider than K needs
    assert gemv_config(8, 24, 2048)["BLOCK_N"] == 32
    # float32: 64 x 256 in 4 stages overflowed the H100's shared memory; with a prologue
    # (gate and up) tiles of 128 spilled (kernels/compile_check.py): 64 there
    assert gemv_config(4, 3072, 2048, itemsize=4)["BLOCK_K"] == 128
    assert gemv_config(4, 2048, 8192, itemsize=4, prologue=True)["BLOCK_K"] == 64
    assert gemv_config(4, 2048, 8192, itemsize=2, prologue=True)["BLOCK_K"] == 128


def test_rejects_what_it_cannot_compute():
    x, w, _ = _inputs(1, 8, 16, torch.float32, False)
    with pytest.raises(AssertionError, match="rows"):
        gemv(torch.empty(MAX_M + 1, 16, device=DEVICE), w)
    with pytest.raises(AssertionError, match="columns"):
        gemv(torch.empty(1, 15, device=DEVICE), w)
    with pytest.raises(AssertionError):
        gemv(x.to(torch.bfloat16), w)  # mixed dtypes
    with pytest.raises(AssertionError, match="act 'gelu'"):
        gemv(x, w, act="gelu")
    with pytest.raises(AssertionError, match="needs 32"):
        gemv(x, w, act="silu_mul")  # silu_mul takes the gate_up output, 2K columns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,bias",
    [(1, 64, 256, False), (1, 50, 70, True), (3, 50, 70, False), (MAX_M, 64, 96, True)],
)
def test_silu_mul_prologue_is_the_activation_kernel_then_the_gemv(dtype, m, n, k, bias):
    """act="silu_mul" on the gate_up output [M, 2K] gives bit for bit what the activation
    kernel followed by the plain GEMV with the same tile gives (same rounding, same
    accumulation order), and that
    is the float64 product of the activation within the usual tolerance."""
    from kernels.activation import silu_and_mul

    gen = torch.Generator().manual_seed(m * 1000 + k)
    # rows a column slice of wider rows (the kernel takes a row stride), gate values wide
    # enough that silu's negative side and its saturation both show up
    wide = (4 * torch.randn(m, 2 * k + 16, generator=gen)).to(dtype).to(DEVICE)
    gate_up = wide[:, : 2 * k]
    _, w, b = _inputs(m, n, k, dtype, bias, seed=k)
    act = silu_and_mul(gate_up)
    tile = gemv_config(m, n, k, itemsize=gate_up.element_size(), prologue=True)
    want = gemv(act, w, b, config=tile)  # the same tile: the same accumulation order
    got = gemv(gate_up, w, b, act="silu_mul")
    assert torch.equal(got, want), f"max diff {(got - want).abs().max()}"
    _check(got, act, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,residual",
    [(1, 64, 256, True), (1, 50, 70, False), (1, 50, 70, True), (3, 50, 70, True),
     (MAX_M, 64, 96, False)],
)  # fmt: skip
def test_rms_norm_prologue_is_the_norm_kernel_then_the_gemv(dtype, m, n, k, residual):
    """`norm=RMSNormInput(...)`: the GEMV of RMSNorm(x + residual) with the new residual
    stream written bit for bit as kernels.fused_norm writes it; the product is the plain GEMV's
    of that norm's output but for its sum of squares, taken in another order (each normalised
    input within an ulp or two of the norm kernel's), and agrees with float64 likewise."""
    from kernels.fused_norm import fused_add_rms_norm, rms_norm
    from kernels.gemv import RMSNormInput

    gen = torch.Generator().manual_seed(m * 100 + k)
    wide = (3 * torch.randn(m, k + 8, generator=gen)).to(dtype).to(DEVICE)
    x = wide[:, :k]  # strided rows
    r = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    nw = (1 + torch.randn(k, generator=gen) / 4).to(dtype).to(DEVICE)
    _, w, b = _inputs(m, n, k, dtype, True, seed=k + 1)
    res_out = torch.full((m, k), 9.0, dtype=dtype, device=DEVICE)
    if residual:
        normed, summed = fused_add_rms_norm(x, r, nw, 1e-6)
        norm = RMSNormInput(nw, 1e-6, r, res_out)
    else:
        normed, norm = rms_norm(x, nw, 1e-6), RMSNormInput(nw, 1e-6)
    got = gemv(x, w, b, norm=norm)
    if residual:
        assert torch.equal(res_out, summed)
    else:
        assert (res_out == 9.0).all()
    tile = gemv_config(m, n, k, itemsize=x.element_size(), prologue=True)
    want = gemv(normed, w, b, config=tile)  # the same tile: the same accumulation order
    magnitude = normed.double().cpu().abs() @ w.double().cpu().abs().T
    ulps = 2.0 * 2.0 ** -MANTISSA[dtype] if dtype != torch.float32 else 2.0**-20
    err = (got.double().cpu() - want.double().cpu()).abs()
    assert (err <= magnitude * ulps + 1e-30).all(), f"max {err.max():.3g}"


def test_rms_norm_prologue_refusals():
    from kernels.gemv import RMSNormInput

    x, w, _ = _inputs(2, 8, 16, torch.float32, False)
    nw = torch.ones(16, device=DEVICE)
    with pytest.raises(AssertionError, match="not both"):
        gemv(torch.empty(2, 32, device=DEVICE), w, act="silu_mul", norm=RMSNormInput(nw, 1e-6))
    with pytest.raises(AssertionError, match="norm's weight"):
        gemv(x, w, norm=RMSNormInput(torch.ones(15, device=DEVICE), 1e-6))
    with pytest.raises(AssertionError):  # a residual needs somewhere to write the sum
        gemv(x, w, norm=RMSNormInput(nw, 1e-6, x.clone()))
