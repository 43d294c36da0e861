"""The fused elementwise kernels compiled on CUDA at real shapes, against the torch layer code.

RMSNorm (hidden 2048 / 4096, with and without the residual add, and Qwen3's per-head q/k norm
read from a fused qkv), GPT-2's LayerNorm with the residual add, SiLU-and-mul (Llama-3.2-1B's
and Llama-3-8B's intermediate sizes), GPT-2's gelu_new, rotary of q and k stacked (head_dim
64 / 128, GQA heads), in float32 / float16 / bfloat16; and the layers themselves on CUDA take
the kernels (their outputs differ from the torch path only by rounding). CUDA rounds to
nearest, so where the kernel rounds where torch does (norm, silu) half precision agrees bit
for bit but for rare last-bit ties.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from engine.layers.activation import (  # noqa: E402
    SiluAndMul,
    gelu_new_torch,
    silu_and_mul_torch,
)
from engine.layers.layernorm import RMSNorm, rms_norm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding, rotate_torch  # noqa: E402
from kernels import fused_norm  # noqa: E402
from kernels.activation import gelu_new, silu_and_mul  # noqa: E402
from kernels.rotary import apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, ulps: float | None = None) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    eps = torch.finfo(want.dtype).eps
    rtol = (ulps or ULPS[want.dtype]) * eps
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5 if eps < 1e-6 else eps * 1e-2)


def _mostly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096])
@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_rms_norm(dtype, hidden, tokens):
    x = _randn(tokens, hidden, dtype=dtype, seed=0, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=1)
    got, want = fused_norm.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
    _close(got, want)
    if dtype != torch.float32:
        _mostly_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_fused_add_rms_norm(dtype, hidden):
    x = _randn(513, hidden, dtype=dtype, seed=2)
    residual = _randn(513, hidden, dtype=dtype, seed=3, scale=8.0)
    w = _randn(hidden, dtype=dtype, seed=4)
    got_out, got_res = fused_norm.fused_add_rms_norm(x, residual, w, 1e-6)
    want_res = x + residual
    assert torch.equal(got_res, want_res)  # one rounding of the sum, as torch's
    _close(got_out, rms_norm(want_res, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_qk_norm(dtype):
    tokens, heads, kv_heads, head_dim = 300, 16, 8, 128
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    w = _randn(head_dim, dtype=dtype, seed=6)
    _close(fused_norm.rms_norm(qk[:, :heads], w, 1e-6), rms_norm(qk[:, :heads], w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [8192, 14336])
@pytest.mark.parametrize("tokens", [1, 1000])
def test_silu_and_mul(dtype, inter, tokens):
    x = _randn(tokens, 2 * inter, dtype=dtype, seed=7, scale=4.0)
    got, want = silu_and_mul(x), silu_and_mul_torch(x)
    _close(got, want)
    if dtype != torch.float32:
        _mostly_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_new(dtype):
    x = _randn(1000, 3072, dtype=dtype, seed=8, scale=3.0)
    got = gelu_new(x)
    _close(got, gelu_new_torch(x.float()).to(dtype), ulps=8 if dtype == torch.float32 else 1)
    err = (got.float() - gelu_new_torch(x).float()).abs()
    assert (err <= 4 * torch.finfo(dtype).eps * x.float().abs() + 1e-5).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 32, 8), (128, 32, 8), (128, 28, 4)])
@pytest.mark.parametrize("tokens", [1, 2000])
def test_rotary(dtype, head_dim, heads, kv_heads, tokens):
    params = {"rope_type": "default", "rope_theta": 500000.0}
    rope = RotaryEmbedding(head_dim, 8192, params)
    cache = rope.cos_sin_cache.to("cuda", dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9, scale=2.0)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(10)
    positions = torch.randint(0, 8192, (tokens,), generator=gen, device="cuda")
    got = apply_rotary(positions, qk, cache, head_dim)
    want = rotate_torch(positions, qk, cache, head_dim)
    if dtype == torch.float32:
        _close(got, want)
    else:  # x1 * cos - x2 * sin can cancel: the torch code's roundings against the magnitude
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 3 * torch.finfo(dtype).eps * qk.float().abs().amax().item(), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gpt2_fc_gelu_in_the_gemm_epilogue(dtype, tokens):
    """GPT-2's c_fc + gelu_new on CUDA is one GEMM (cuBLASLt's bias-GELU epilogue, its tanh
    form) with no activation kernel, and equals the float32 layer-then-gelu_new up to the
    GEMM's own rounding; with the layer kernels off it is the plain two steps."""
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from engine.layers.activation import gelu_new as gelu_new_layer
    from engine.layers.activation import linear_gelu_tanh
    from kernels.jit import use_layer_kernels

    fc = nn.Linear(768, 3072).to("cuda", dtype)
    with torch.no_grad():
        fc.weight.copy_(_randn(3072, 768, dtype=dtype, seed=30, scale=0.05))
        fc.bias.copy_(_randn(3072, dtype=dtype, seed=31, scale=0.5))
    x = _randn(tokens, 768, dtype=dtype, seed=32)
    with torch.no_grad():
        got = linear_gelu_tanh(x, fc, gelu_new_layer)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            linear_gelu_tanh(x, fc, gelu_new_layer)
            torch.cuda.synchronize()
        want = gelu_new_torch(x.double() @ fc.weight.double().t() + fc.bias.double())
        plain = gelu_new_layer(fc(x))
        use_layer_kernels(False)
        try:
            off = linear_gelu_tanh(x, fc, gelu_new_layer)
        finally:
            use_layer_kernels(True)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # neither the Triton gelu_new kernel nor torch's elementwise GELU (the CUDA fallback)
    assert names and not any("_gelu_new_kernel" in n or "GeluCUDAKernel" in n for n in names), (
        names
    )
    assert got.dtype == dtype and got.shape == (tokens, 3072)
    eps = torch.finfo(dtype).eps
    # one rounding of the float32 result (float32: the GEMM's own summation order)
    tol = 4 * eps * want.abs() + (1e-4 if dtype == torch.float32 else 2 * eps)
    assert ((got.double() - want).abs() <= tol).all()
    if dtype != torch.float32:  # the two-step path rounds the GEMM output first
        assert (got.double() - want).abs().mean() <= (plain.double() - want).abs().mean()
    assert torch.equal(off, gelu_new_torch(fc(x)))


def test_layers_take_the_kernels_on_cuda():
    """RMSNorm (both forms), SiluAndMul and RotaryEmbedding on CUDA tensors give the kernels'
    outputs exactly (the layers dispatch to them)."""
    from kernels.jit import use_layer_kernels

    dtype, hidden = torch.bfloat16, 2048
    norm = RMSNorm(hidden, 1e-5).to("cuda", dtype)
    norm.weight.data.copy_(_randn(hidden, dtype=dtype, seed=11))
    x = _randn(5, hidden, dtype=dtype, seed=12)
    r = _randn(5, hidden, dtype=dtype, seed=13)
    assert torch.equal(norm(x), fused_norm.rms_norm(x, norm.weight, 1e-5))
    for got, want in zip(norm(x, r), fused_norm.fused_add_rms_norm(x, r, norm.weight, 1e-5)):
        assert torch.equal(got, want)
    y = _randn(5, 2 * hidden, dtype=dtype, seed=14)
    assert torch.equal(SiluAndMul()(y), silu_and_mul(y))
    rope = RotaryEmbedding(64, 128, {"rope_type": "default", "rope_theta": 10000.0}).cuda()
    q = _randn(5, 4, 64, dtype=torch.float32, seed=15)
    pos = torch.arange(5, device="cuda")
    assert torch.equal(rope(pos, q), apply_rotary(pos, q, rope.cos_sin_cache, 64))
    # Phi-4-mini: 96 of 128 features rotated (LongRoPE, long factors), the rest passed through
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
              "short_factor": [1.0] * 48, "long_factor": [1.0 + i / 8 for i in range(48)],
              "original_max_position_embeddings": 64, "max_position_embeddings": 128}  # fmt: skip
    rope = RotaryEmbedding(128, 128, params, context_len=128).to("cuda", dtype)
    qk = _randn(5, 6, 128, dtype=dtype, seed=16)
    got = rope(pos, qk)
    assert torch.equal(got[..., 96:], qk[..., 96:])
    assert torch.equal(got[..., :96], apply_rotary(pos, qk[..., :96], rope.cos_sin_cache, 96))
    use_layer_kernels(False)
    try:
        torch_code = rope(pos, qk)
    finally:
        use_layer_kernels(True)
    err = (got.float() - torch_code.float()).abs().max().item()
    assert err <= 3 * torch.finfo(dtype).eps * qk.float().abs().amax().item(), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_layer_norm_against_torch_on_cuda(dtype, tokens):
    """GPT-2's LayerNorm (hidden 768, BERT-base's too) with the residual add, against the
    LayerNorm layer's torch path on CUDA (torch's own kernel, float32 inside, rounded once):
    the same sum bit for bit, the normalised rows to the last bit of the mean / variance; and
    the layer takes the kernel."""
    from engine.layers.layernorm import LayerNorm

    hidden = 768
    norm = LayerNorm(hidden, eps=1e-5).to("cuda", dtype)
    norm.weight.data.copy_(_randn(hidden, dtype=dtype, seed=30))
    norm.bias.data.copy_(_randn(hidden, dtype=dtype, seed=31))
    x = _randn(tokens, hidden, dtype=dtype, seed=32, scale=2.0) + 3.0
    r = _randn(tokens, hidden, dtype=dtype, seed=33, scale=5.0)
    got, got_res = fused_norm.fused_add_layer_norm(x, r, norm.weight, norm.bias, 1e-5)
    want_res = x + r
    assert torch.equal(got_res, want_res)
    want = torch.nn.functional.layer_norm(want_res, (hidden,), norm.weight, norm.bias, 1e-5)
    _close(got, want)
    layer_out, layer_res = norm(x, r)
    assert torch.equal(layer_out, got) and torch.equal(layer_res, got_res)
    assert torch.equal(norm(x), fused_norm.fused_add_layer_norm(x, None, norm.weight,
                                                                norm.bias, 1e-5)[0])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 32, 8), (128, 32, 8), (128, 8, 1)])
@pytest.mark.parametrize("tokens", [1, 256])
def test_rotary_with_kv_store_on_cuda(dtype, head_dim, heads, kv_heads, tokens):
    """The rotary kernel's K/V store (`RotaryEmbedding.rotate_and_store` on the Triton and
    flashinfer backends) leaves the pool as the store kernel after the plain rotary does, bit
    for bit, and returns the same q/k."""
    from kernels.kv_store import store_kv
    from kernels.rotary import KVStore

    cache = _randn(4096, head_dim, dtype=dtype, seed=40)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=41)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :]
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    loc = torch.randperm(4096, device="cuda")[:tokens] + 1
    want_k = torch.zeros(4100, kv_heads, head_dim, dtype=dtype, device="cuda")
    want_v, got_k, got_v = want_k.clone(), want_k.clone(), want_k.clone()
    want = apply_rotary(pos, qk, cache, head_dim)
    store_kv(want_k, want_v, loc, want[:, heads:], v)
    got = apply_rotary(pos, qk, cache, head_dim, KVStore(got_k, got_v, loc, v, heads))
    assert torch.equal(got, want)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
