"""The fused elementwise kernels (RMSNorm with and without the residual add, SiLU-and-mul,
gelu_new, rotary) against the engine's torch layer code, their references (in the Triton
interpreter on CPU, compiled on CUDA).

float32 must agree to float32 rounding; half precision to one or two ulps: the kernels round
once where the torch code may round after every op, and the interpreter converts float32 to
bfloat16 by truncation where CUDA rounds to nearest. Shapes are odd on purpose (hidden not a
power of two, strided rows, many rows), so a wrong mask, stride or offset shows as values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

from engine.layers.activation import gelu_new_torch, silu_and_mul_torch  # noqa: E402
from engine.layers.layernorm import rms_norm  # noqa: E402
from engine.layers.rotary import compute_inv_freq, rotate_torch  # noqa: E402
from kernels import fused_norm  # noqa: E402
from kernels.activation import gelu_new, silu_and_mul  # noqa: E402
from kernels.rotary import apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0) -> None:
    """Same shape and dtype, and within `ulps` units of want's dtype (relative), plus a tiny
    absolute slack for values near zero."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    eps = torch.finfo(want.dtype).eps
    atol = 1e-6 if want.dtype == torch.float32 else eps * 1e-2
    torch.testing.assert_close(got, want, rtol=ulps * eps, atol=atol)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 1000, 2048])
def test_rms_norm(dtype, hidden):
    x = _randn(37, hidden, dtype=dtype, seed=0, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=1)
    got = fused_norm.rms_norm(x, w, 1e-6)
    assert got.is_contiguous()
    assert_close(got, rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 1000])
def test_fused_add_rms_norm(dtype, hidden):
    x = _randn(300, hidden, dtype=dtype, seed=2)
    residual = _randn(300, hidden, dtype=dtype, seed=3, scale=10.0)
    w = _randn(hidden, dtype=dtype, seed=4)
    x_before, res_before = x.clone(), residual.clone()
    want_res = x + residual  # RMSNorm.forward's torch path (on CUDA it takes the kernel)
    want_out = rms_norm(want_res, w, 1e-5)
    got_out, got_res = fused_norm.fused_add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # inputs only read
    # the sum is one rounding of x + residual, as torch's; the interpreter truncates bf16
    assert_close(got_res, want_res, ulps=0 if dtype != torch.bfloat16 else 1)
    # normalising a truncated sum moves the output by up to ~2 ulps more
    assert_close(got_out, want_out, ulps=2 if dtype != torch.bfloat16 else 4)


def test_norm_and_silu_round_where_torch_rounds():
    """float16 (which the interpreter rounds to nearest, as CUDA does): the kernels round the
    normalised row before the weight and silu before the product, as the torch code does, so
    all but the rare rsqrt / exp last-bit ties agree bit for bit (skipping either rounding
    changes about a quarter of the values)."""
    x = _randn(64, 1000, dtype=torch.float16, seed=13, scale=3.0)
    w = _randn(1000, dtype=torch.float16, seed=14)
    assert (fused_norm.rms_norm(x, w, 1e-6) != rms_norm(x, w, 1e-6)).float().mean() < 0.01
    x = _randn(64, 2000, dtype=torch.float16, seed=15, scale=4.0)
    assert (silu_and_mul(x) != silu_and_mul_torch(x)).float().mean() < 0.01


def test_rms_norm_of_per_head_slices_of_a_fused_qkv():
    """Qwen3's q/k norm: x [tokens, heads, head_dim] read in place from a wider qkv row, with
    a float32 weight over bfloat16 x (the output promotes to float32, as torch's does)."""
    tokens, heads, head_dim = 9, 5, 64
    qkv = _randn(tokens, (heads + 3) * head_dim, dtype=torch.bfloat16, seed=5)
    x = qkv[:, head_dim : (heads + 1) * head_dim].view(tokens, heads, head_dim)
    assert not x.is_contiguous()
    w = _randn(head_dim, dtype=torch.float32, seed=6)
    got = fused_norm.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert_close(got, rms_norm(x, w, 1e-6), ulps=2**16 * 2)  # ulps of bf16, h is rounded to it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,residual,bias", [(768, True, True), (80, False, True),
                                                  (1000, True, False)])  # fmt: skip
def test_layer_norm(dtype, hidden, residual, bias):
    """GPT-2's LayerNorm with the residual add before it (x + residual rounded to the dtype,
    as torch adds) against F.layer_norm of that sum; x rows strided (a column slice), values
    off-centre (a mean far from zero shows a variance computed without centring)."""
    wide = _randn(70, hidden + 24, dtype=dtype, seed=20, scale=2.0) + 5.0
    x = wide[:, :hidden]
    res = _randn(70, hidden, dtype=dtype, seed=21, scale=4.0) if residual else None
    w = _randn(hidden, dtype=dtype, seed=22)
    b = _randn(hidden, dtype=dtype, seed=23) if bias else None
    x_before = x.clone()
    got, got_res = fused_norm.fused_add_layer_norm(x, res, w, b, 1e-5)
    assert torch.equal(x, x_before) and got.is_contiguous()
    if res is None:
        assert got_res is None
        normed = x
    else:  # one rounding of the sum (the interpreter truncates bf16 where CUDA rounds)
        assert_close(got_res, x + res, ulps=0 if dtype != torch.bfloat16 else 1)
        normed = got_res
    # of that sum: float32 arithmetic rounded once, as torch's CUDA kernel
    want = F.layer_norm(normed.float(), (hidden,), w.float(), None if b is None else b.float(),
                        1e-5).to(dtype)  # fmt: skip
    assert_close(got, want, ulps=2)


def test_layer_norm_layer_off_cuda_is_torch_with_the_add_before():
    """engine.layers.layernorm.LayerNorm on CPU: nn.LayerNorm's parameters and output, and with
    a residual (norm(x + residual), x + residual), the GPT-2 block's sums."""
    from engine.layers.layernorm import LayerNorm

    norm = LayerNorm(48, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x, r = torch.randn(3, 48), torch.randn(3, 48)
    assert set(norm.state_dict()) == {"weight", "bias"}
    assert torch.equal(norm(x), F.layer_norm(x, (48,), norm.weight, norm.bias, 1e-5))
    out, summed = norm(x, r)
    assert torch.equal(summed, x + r)
    assert torch.equal(out, F.layer_norm(x + r, (48,), norm.weight, norm.bias, 1e-5))


def test_rms_norm_rejects_a_row_wider_than_the_kernel():
    x = torch.zeros(1, fused_norm.MAX_HIDDEN + 1, device=DEVICE)
    with pytest.raises(ValueError, match="hidden"):
        fused_norm.rms_norm(x, torch.ones(x.shape[1], device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1000, 1536])
def test_silu_and_mul(dtype, inter):
    x = _randn(2, 33, 2 * inter, dtype=dtype, seed=7, scale=4.0)
    got = silu_and_mul(x, block=512)  # several column blocks, the last partial
    assert got.shape == (2, 33, inter)
    # float32: exp and the division may differ from torch's by an ulp each, then two roundings
    assert_close(got, silu_and_mul_torch(x), ulps=4)


def test_silu_and_mul_of_strided_rows():
    """The rows of a wider tensor (a column slice), read in place."""
    wide = _randn(50, 3 * 200, dtype=torch.float32, seed=8)
    x = wide[:, 100:500]
    assert_close(silu_and_mul(x), silu_and_mul_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_new(dtype):
    x = _randn(7, 3 * 1000 + 17, dtype=dtype, seed=9, scale=3.0)
    x[0, :4] = torch.tensor([-30.0, -9.0, 0.0, 30.0], dtype=dtype)  # saturated tails
    got = gelu_new(x, block=1024)
    # the float32 formula rounded once (float32: a different but equal formula, a few ulps)
    once = gelu_new_torch(x.float()).to(dtype)
    assert_close(got, once, ulps=8 if dtype == torch.float32 else 1)
    # the op-by-op half precision reference loses up to a few ulps of x where 1 + tanh cancels
    err = (got.float() - gelu_new_torch(x).float()).abs()
    assert (err <= 4 * torch.finfo(dtype).eps * x.float().abs() + 1e-6).all()


def test_linear_gelu_off_cuda_is_the_layer_then_the_activation(monkeypatch):
    """GPT-2's c_fc + GELU goes to cuBLASLt's GELU epilogue on CUDA only: torch's CPU
    `_addmm_activation` applies GELU's erf form, not the tanh form GPT-2 uses, so off CUDA
    (even where the layer kernels would run, as the interpreter tests arrange) it must stay
    the layer then the activation, bit for bit."""
    import kernels.jit
    from engine.layers.activation import gelu_new as gelu_new_layer
    from engine.layers.activation import linear_gelu_tanh

    monkeypatch.setattr(kernels.jit, "compiled_on", lambda x: True)
    torch.manual_seed(0)
    fc = torch.nn.Linear(24, 40)
    x = torch.randn(5, 24) * 3
    got = linear_gelu_tanh(x, fc, gelu_new_layer)
    assert torch.equal(got, gelu_new_layer(fc(x)))
    erf = torch._addmm_activation(fc.bias, x, fc.weight.t(), use_gelu=True)
    assert (got - erf).abs().max() > 1e-4  # what the CUDA path would give here: another GELU


def _cos_sin_cache(head_dim: int, max_pos: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = compute_inv_freq(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 32, 8), (128, 7, 1), (80, 3, 3)])
def test_rotary_on_a_slice_of_a_fused_qkv(dtype, head_dim, heads, kv_heads):
    """q and k stacked, read in place from a qkv row (as llama.py passes them)."""
    tokens = 23
    cache = _cos_sin_cache(head_dim, 4096, dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=10, scale=2.0)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    got = apply_rotary(positions, qk, cache, head_dim)
    want = rotate_torch(positions, qk, cache, head_dim)
    assert got.is_contiguous()
    # float32: the same products, possibly fused into FMAs; half: each product and the sum
    # rounded as torch does, bit for bit
    if dtype == torch.float32:
        assert_close(got, want)
    else:
        assert torch.equal(got, want), (got != want).sum().item()


@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 96), (16, 12), (64, 32)])
def test_partial_rotary_from_the_layer(head_dim, rotary_dim):
    """A partial rotary dimension (Phi-4-mini: 96 of 128): the layer hands the kernel the
    first `rotary_dim` features of each head, in place in the fused qkv row, and passes the
    rest through; the kernel's half-tile is then not a power of two (6, 48)."""
    from engine.layers.rotary import RotaryEmbedding

    tokens, heads, kv_heads = 7, 5, 1
    params = {"rope_type": "default", "rope_theta": 10000.0,
              "partial_rotary_factor": rotary_dim / head_dim}  # fmt: skip
    rope = RotaryEmbedding(head_dim, 256, params)
    assert rope.rotary_dim == rotary_dim and rope.cos_sin_cache.shape == (256, rotary_dim)
    cache = rope.cos_sin_cache.to(DEVICE)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.float32, seed=13)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    positions = torch.tensor([0, 1, 5, 77, 200, 254, 255], device=DEVICE)
    got = apply_rotary(positions, qk[..., :rotary_dim], cache, rotary_dim)
    assert_close(got, rotate_torch(positions, qk[..., :rotary_dim], cache, rotary_dim))
    layer = rope.to(DEVICE)(positions, qk)  # (the torch code off CUDA)
    assert torch.equal(layer[..., rotary_dim:], qk[..., rotary_dim:])
    assert_close(layer[..., :rotary_dim], got)
    assert not torch.equal(layer[1:, :, :rotary_dim], qk[1:, :, :rotary_dim])


def test_rotary_many_heads_split_over_programs():
    """More heads than one program's tile (block_h < heads), a partial last block; heads
    padded apart in memory (head stride != head_dim)."""
    tokens, heads, head_dim = 3, 100, 64
    cache = _cos_sin_cache(head_dim, 64, torch.float32)
    x = _randn(tokens, heads, head_dim + 16, dtype=torch.float32, seed=12)[..., :head_dim]
    positions = torch.tensor([63, 0, 17], device=DEVICE)
    assert_close(
        apply_rotary(positions, x, cache, head_dim), rotate_torch(positions, x, cache, head_dim)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,heads,kv_heads", [(64, 32, 8), (80, 3, 3), (256, 12, 4)]  # 256: two head blocks
)
def test_rotary_with_kv_store_is_rotary_then_store(dtype, head_dim, heads, kv_heads):
    """`kv_store`: the same rotated q/k, and the pool afterwards holds exactly what the store
    kernel writes after the plain rotary (rotated K, V; other slots untouched), with q, k and v
    read in place from one qkv row; a float32 pool under a half-precision model (the cast)."""
    from kernels.kv_store import store_kv
    from kernels.rotary import KVStore

    tokens, slots = 9, 40
    cache = _cos_sin_cache(head_dim, 512, dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=40, scale=2.0)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :]
    gen = torch.Generator().manual_seed(41)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    loc = torch.randperm(slots - 1, generator=gen)[:tokens].add(1).to(DEVICE)
    for pool_dtype in {dtype, torch.float32}:
        want_k = torch.full((slots, kv_heads, head_dim), 7.0, dtype=pool_dtype, device=DEVICE)
        want_v, got_k, got_v = want_k.clone(), want_k.clone(), want_k.clone()
        want = apply_rotary(positions, qk, cache, head_dim)
        store_kv(want_k, want_v, loc, want[:, heads:], v)
        store = KVStore(got_k, got_v, loc, v, heads)
        got = apply_rotary(positions, qk, cache, head_dim, kv_store=store)
        assert torch.equal(got, want)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert (got_k[0] == 7.0).all()  # slot 0 (no token's) untouched
