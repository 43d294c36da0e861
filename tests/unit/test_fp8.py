"""FP8 pieces: block quantization, the Triton W8A8 GEMM against its torch reference (the
interpreter on CPU, compiled on CUDA), `Fp8Linear`'s loading of checkpoint shards, the
pairing of checkpoint weights with their scales, and which quantization a config asks for."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

from engine.checkpoint_parts import pair_fp8_scales  # noqa: E402
from engine.layers.fp8 import Fp8Linear, QuantizedWeight, fp8_linear  # noqa: E402
from engine.quantization import (  # noqa: E402
    Fp8Config,
    quantized_linear_names,
    resolve_quantization,
)
from kernels.fp8_gemm import (  # noqa: E402
    FP8_DTYPE,
    dequantize_groups,
    fp8_gemm_reference,
    quantize_groups,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("group", [(1, 100), (16, 16), (32, 64), (48, 100)])
def test_quantize_groups_round_trip_within_e4m3_precision(group):
    x = _randn(70, 100) * torch.logspace(-3, 2, 100)  # columns of very different sizes
    q, scale = quantize_groups(x, *group)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.shape == (-(-70 // group[0]), -(-100 // group[1]))
    back = dequantize_groups(q, scale, group)
    full = scale.repeat_interleave(group[0], 0)[:70].repeat_interleave(group[1], 1)[:, :100]
    # e4m3: 3 mantissa bits (half an ulp is 1/16 relative); below 2^-6 subnormal steps of 2^-9
    bound = x.abs() / 16 + full * 2.0**-10
    assert ((back - x).abs() <= bound * 1.0001).all()
    # each block's largest magnitude is exactly +-448: requantizing changes nothing
    q2, scale2 = quantize_groups(back, *group)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(scale2, scale, rtol=1e-6, atol=0)


def test_a_zero_block_gets_a_finite_scale():
    x = torch.zeros(4, 32)
    x[0, 0] = 3.0
    q, scale = quantize_groups(x, 1, 16)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(dequantize_groups(q, scale, (1, 16)), x)


@needs_triton
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize(
    "n,k,group",
    [(48, 64, (1, 64)), (130, 100, (1, 100)), (64, 96, (16, 16)), (80, 100, (32, 32))],
    ids=["per-channel", "per-channel-ragged", "block16", "block32-ragged"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_gemm_matches_reference(m, n, k, group, bias, out_dtype):
    from kernels.fp8_gemm import fp8_gemm

    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2) * 0.1
    b = _randn(n, seed=3) if bias else None
    x_q, x_s = quantize_groups(x, 1, group[1])
    w_q, w_s = quantize_groups(w, *group)
    args = [t.to(DEVICE) if t is not None else None for t in (x_q, x_s, w_q, w_s)]
    bias_dev = b.to(DEVICE) if b is not None else None
    got = fp8_gemm(*args, group, bias_dev, out_dtype).float().cpu()
    want = fp8_gemm_reference(x_q, x_s, w_q, w_s, group, b, torch.float32)
    # a bf16 ulp: the GPU rounds to nearest (half an ulp), the interpreter truncates
    rounding = 2.0**-7 * want.abs() if out_dtype == torch.bfloat16 else 0
    if out_dtype == torch.float32 or DEVICE == "cpu" or m <= 16 or k < 32:
        # float32 outputs multiply in float32 on the GPU too (`upcast`): the float32
        # arithmetic to its rounding
        assert ((got - want).abs() <= rounding + 1e-5 + 1e-5 * want.abs()).all()
    else:
        # A 16-bit output compiled with M > 16 (64-row tiles: Hopper's wgmma): the float8 MMA
        # accumulates with about 14 mantissa bits within a K step (DeepSeek-V3 report,
        # 3.3.2), not in float32: bounded relative to the sum of the products' magnitudes
        size = dequantize_groups(x_q, x_s, (1, group[1])).abs()
        size = size @ dequantize_groups(w_q, w_s, group).abs().T
        assert ((got - want).abs() <= 2.0**-11 * size + rounding + 1e-5).all()
    # and the arithmetic is the quantized operands', close to the full-precision product
    exact = x @ w.T + (b if b is not None else 0)
    assert (got - exact).norm() / exact.norm() < 0.06


@needs_triton
@pytest.mark.parametrize("rows,cols,group_cols", [
    (1, 64, 64), (5, 100, 100), (7, 256, 128), (3, 300, 128), (2, 2500, 2500), (4, 96, 4096),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_rows_is_quantize_groups_to_the_bit(rows, cols, group_cols, dtype):
    """The one-launch activation quantization (fp8_linear's on the GPU) against the torch
    one: the same scales and float8 bits, ragged last groups and groups longer than a
    kernel step included; values spread over 2^-20..2^8 so that float8 subnormals and ties
    of the rounding occur."""
    from kernels.fp8_gemm import quantize_rows

    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 8, (rows, cols),
                                                                        generator=g).float())
    if rows:
        x[0, : min(cols, 7)] = torch.tensor([0.0, 448.0, -3.0, 2.5, -0.0, 1e-30, 7.0])[:cols]
    x = x.to(dtype)
    want_q, want_s = quantize_groups(x, 1, group_cols)
    q, s = quantize_rows(x.to(DEVICE), group_cols)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    if dtype == torch.float32:  # no rows (quantize_groups divides by the row count)
        q, s = quantize_rows(x[:0].to(DEVICE), group_cols)
        assert q.shape == (0, cols) and s.shape == (0, -(-cols // min(group_cols, cols)))


@needs_triton
def test_quantize_rows_rounds_every_float8_tie_to_even():
    """With a row whose largest magnitude is 448 (scale exactly 1) the kernel's float8 values
    are its rounding of the inputs: every value of e4m3fn, every midpoint between two
    neighbours (the ties, normal and subnormal) and the floats just either side of each,
    both signs, against torch's conversion."""
    from kernels.fp8_gemm import quantize_rows

    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    values = codes.view(FP8_DTYPE).float()  # 0 .. 448, increasing
    mids = (values[:-1] + values[1:]) / 2  # exact in float32
    near = torch.cat([torch.nextafter(mids, torch.zeros_like(mids)),
                      torch.nextafter(mids, torch.full_like(mids, 1e9))])  # fmt: skip
    row = torch.cat([values, mids, near])
    row = torch.cat([torch.tensor([448.0]), row, -row])[None, :]
    q, scale = quantize_rows(row.to(DEVICE), row.shape[1])
    assert scale.item() == 1.0
    want = row.to(FP8_DTYPE)
    assert torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8))


def test_float32_outputs_multiply_in_float32():
    """The float8 tensor cores only for 16-bit outputs, and K steps of 32 or more; the
    interpreter always multiplies in float32."""
    from kernels import fp8_gemm

    for interp in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fp8_gemm, "interpreting", lambda interp=interp: interp)
            assert fp8_gemm.upcast(torch.float32, 128)
            assert fp8_gemm.upcast(torch.bfloat16, 16)
            assert fp8_gemm.upcast(torch.bfloat16, 128) == interp
            assert fp8_gemm.upcast(torch.float16, 64) == interp


@needs_triton
@pytest.mark.parametrize(
    "n,k,group",
    [(48, 64, (1, 64)), (130, 300, (1, 300)), (64, 300, (16, 128)), (90, 2100, (32, 128)),
     (70, 2100, (128, 128))],
    ids=["per-channel", "per-channel-ragged", "block-in-one-step", "blocks-3-steps",
         "block128-ragged-rows"],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_one_row_gemv_matches_reference(n, k, group, bias, out_dtype):
    """The float8 GEMV (one row; K steps of up to 1024 columns that span several scale groups,
    weight rows in 4s across blocks of 16-128) computes the reference's W8A8 arithmetic: in
    float32, to its rounding."""
    from kernels.fp8_gemm import fp8_gemv

    x, w = _randn(1, k, seed=4), _randn(n, k, seed=5) * 0.1
    w = w * torch.linspace(0.05, 3.0, k)  # column groups of different sizes, so scales differ
    b = _randn(n, seed=6) if bias else None
    x_q, x_s = quantize_groups(x, 1, group[1])
    w_q, w_s = quantize_groups(w, *group)
    args = [t.to(DEVICE) for t in (x_q, x_s, w_q, w_s)]
    got = fp8_gemv(*args, group, b.to(DEVICE) if b is not None else None, out_dtype)
    assert got.shape == (1, n) and got.dtype == out_dtype
    want = fp8_gemm_reference(x_q, x_s, w_q, w_s, group, b, torch.float32)
    size = dequantize_groups(x_q, x_s, (1, group[1])).abs()
    size = size @ dequantize_groups(w_q, w_s, group).abs().T  # the sum's own rounding scale
    rounding = 2.0**-7 * want.abs() if out_dtype == torch.bfloat16 else 0
    assert ((got.float().cpu() - want).abs() <= rounding + 1e-6 * size + 1e-6).all()


@needs_triton
def test_fp8_layer_takes_the_gemv_for_one_row_only():
    """`gemv_max_rows` (set by use_triton_gemv): one row through the float8 GEMV, equal to the
    GEMM's result; more rows keep the GEMM."""
    from engine.layers.linear import use_triton_gemv
    from kernels import fp8_gemm

    linear = torch.nn.Linear(256, 72, bias=True)
    model = torch.nn.Sequential(Fp8Linear.quantize(linear, (8, 128))).to(DEVICE)
    layer = model[0]
    x = _randn(3, 256, seed=7).to(DEVICE)
    with torch.no_grad():
        off = layer(x)
        use_triton_gemv(model, 1)
        assert layer.gemv_max_rows == 1
        calls = []
        real = fp8_gemm.fp8_gemv
        with pytest.MonkeyPatch.context() as mp:
            import engine.layers.fp8 as fp8_layer

            mp.setattr(fp8_layer, "fp8_gemv", lambda *a: calls.append(a) or real(*a))
            rows = [layer(x[i : i + 1]) for i in range(3)]
            three = layer(x)
    assert len(calls) == 3  # the rows of one, not the batch of three
    torch.testing.assert_close(torch.cat(rows), off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(three, off, rtol=0, atol=0)


@pytest.mark.parametrize("group", [None, (16, 16)])
def test_fp8_linear_quantize_is_close_to_the_linear(group):
    linear = torch.nn.Linear(64, 96, bias=True)
    torch.nn.init.normal_(linear.bias)
    layer = Fp8Linear.quantize(linear, group)
    assert layer.weight.dtype == FP8_DTYPE and layer.bias.dtype == torch.float32
    x = _randn(3, 7, 64)
    with torch.no_grad():
        want, got = linear(x), layer(x)
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() < 0.05
    # what the layer computes is exactly the reference W8A8 arithmetic
    torch.testing.assert_close(
        got.view(-1, 96),
        fp8_linear(x.view(-1, 64), layer.weight, layer.weight_scale, layer.group, layer.bias),
    )


def _merged(group):
    return Fp8Linear(64, 128, bias=False, group=group, shards=[("q", 64), ("k", 32), ("v", 32)])


def test_per_tensor_shards_keep_their_own_scales_bit_exact():
    layer = _merged(None)
    shards = {}
    for shard, size, seed in (("q", 64, 0), ("k", 32, 1), ("v", 32, 2)):
        w = _randn(size, 64, seed=seed) * (seed + 1)
        q, s = quantize_groups(w, size, 64)  # one scale for the tensor
        shards[shard] = (q, s.reshape(()))
        layer.load_shard(layer.weight, QuantizedWeight(q, s.reshape(())), shard)
    want_q = torch.cat([shards[s][0] for s in "qkv"])
    assert torch.equal(layer.weight.view(torch.uint8), want_q.view(torch.uint8))
    want_s = torch.cat([shards[s][1].expand(n) for s, n in (("q", 64), ("k", 32), ("v", 32))])
    assert torch.equal(layer.weight_scale.view(-1), want_s)


def test_block_shards_copy_bit_exact_and_16_bit_shards_are_quantized():
    layer = _merged((16, 16))
    q, s = quantize_groups(_randn(64, 64), 16, 16)
    layer.load_shard(layer.weight, QuantizedWeight(q, s, (16, 16)), "q")
    assert torch.equal(layer.weight[:64].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale[:4], s)
    k = _randn(32, 64, seed=5)
    layer.load_shard(layer.weight, k, "k")  # a 16/32-bit tensor: quantized in the layer's blocks
    k_q, k_s = quantize_groups(k, 16, 16)
    assert torch.equal(layer.weight[64:96].view(torch.uint8), k_q.view(torch.uint8))
    assert torch.equal(layer.weight_scale[4:6], k_s)
    # other blocks in the checkpoint: requantized to ours, close to the original values
    v = _randn(32, 64, seed=6)
    v_q, v_s = quantize_groups(v, 32, 32)
    layer.load_shard(layer.weight, QuantizedWeight(v_q, v_s, (32, 32)), "v")
    back = dequantize_groups(layer.weight[96:], layer.weight_scale[6:], (16, 16))
    assert (back - v).abs().max() <= v.abs().max() / 8


def test_bad_shards_are_refused_with_the_reason():
    layer = _merged((16, 16))
    with pytest.raises(ValueError, match="does not match expected"):
        layer.load_shard(layer.weight, _randn(30, 64), "k")
    odd = Fp8Linear(64, 40, bias=False, group=(16, 16), shards=[("a", 8), ("b", 32)])
    with pytest.raises(ValueError, match="not whole"):
        odd.load_shard(odd.weight, _randn(32, 64), "b")


def test_pairing_joins_weights_and_scales_in_either_order():
    q, s = quantize_groups(_randn(32, 32), 16, 16)
    qt, st = quantize_groups(_randn(32, 32), 32, 32)
    stream = [
        ("a.weight_scale_inv", s),
        ("a.weight", q),
        ("b.weight", qt),
        ("b.input_scale", torch.tensor(0.1)),
        ("b.weight_scale", st.reshape(())),
        ("norm.weight", torch.ones(32)),
    ]
    out = dict(pair_fp8_scales(stream, (16, 16)))
    assert sorted(out) == ["a.weight", "b.weight", "norm.weight"]
    assert out["a.weight"].block == (16, 16) and out["a.weight"].scale is s
    assert out["b.weight"].block is None
    torch.testing.assert_close(out["b.weight"].dequantize(torch.float32), dequantize_groups(qt, st))
    with pytest.raises(ValueError, match="without a scale"):
        list(pair_fp8_scales([("c.weight", q)], (16, 16)))
    with pytest.raises(ValueError, match="without weight_block_size"):
        list(pair_fp8_scales([("c.weight_scale_inv", s)], None))


class _Config:
    def __init__(self, qc=None):
        if qc is not None:
            self.quantization_config = qc


def test_resolve_quantization():
    assert resolve_quantization(None, _Config()) is None
    assert resolve_quantization("fp8", _Config()) == Fp8Config(checkpoint=False)
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128],
          "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}  # fmt: skip
    got = resolve_quantization(None, _Config(qc))
    assert got == Fp8Config(True, (128, 128), ("model.layers.0.mlp.down_proj",))
    assert resolve_quantization("fp8", _Config(qc)) == got
    with pytest.raises(ValueError, match="'bitsandbytes'"):  # (AWQ, GPTQ run: test_int_weight.py,
        resolve_quantization(None, _Config({"quant_method": "bitsandbytes"}))  # test_gptq.py)
    with pytest.raises(ValueError, match="not in"):
        resolve_quantization("int4", _Config())
    with pytest.raises(ValueError, match="e5m2"):
        resolve_quantization(None, _Config({"quant_method": "fp8", "fmt": "e5m2"}))


def test_only_the_blocks_projections_are_quantized():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(8, 8)
            self.gate = torch.nn.Linear(8, 4)  # an MoE router
            self.down_proj = torch.nn.Linear(8, 8)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.lm_head = torch.nn.Linear(8, 16)

    names = quantized_linear_names(Model(), Fp8Config(True, skip=("layers.1.down_proj",)))
    assert names == ["layers.0.qkv_proj", "layers.0.down_proj", "layers.1.qkv_proj"]
