"""FP8 KV cache pieces (engine/mem_cache/kv_quant.py, kv_pool.py, kv_memory.py): rounding and
saturation, checkpoint scale names, what the pool stores, and how many tokens a budget buys.
The attention arithmetic over a float8 cache is tested against transformers in
tests/integration/test_kv_fp8.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineArgs
from engine.mem_cache.kv_memory import DEFAULT_CPU_KV_BYTES, plan_kv_memory
from engine.mem_cache.kv_pool import KVPool
from engine.mem_cache.kv_quant import quantize_kv, resolve_kv_cache_dtype, take_kv_scales

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rounds_to_nearest_and_saturates(dtype):
    x = torch.tensor([0.3, -1.7, 5.0e5, -5.0e5, 0.0])
    got = quantize_kv(x, 1.0, dtype)
    top = torch.finfo(dtype).max
    assert got.dtype == dtype
    assert got.float()[2:4].tolist() == [top, -top]  # saturated, not inf or NaN
    # every finite value rounds to a nearest float8 neighbour
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite()]
    for value, q in zip(x[[0, 1, 4]].tolist(), got.float()[[0, 1, 4]].tolist()):
        assert abs(q - value) == (grid - value).abs().min()


def test_quantize_divides_by_the_scale():
    x = torch.tensor([[100.0, -3.0], [0.1, 700.0]], dtype=torch.bfloat16)  # normal after / 4
    got = quantize_kv(x, 4.0, E4M3)
    want = (x.float() / 4.0).to(E4M3)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    back = got.float() * 4.0
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + 1e-6).all()  # 3 mantissa bits


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == E4M3  # vLLM's name
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float16) == E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model_path="m", kv_cache_dtype="int8")


def test_checkpoint_kv_scales_are_taken_out_by_name():
    weights = [
        ("model.layers.0.self_attn.k_proj.weight", torch.zeros(2, 2)),
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.0.self_attn.v_scale", torch.tensor([2.0])),
        ("model.layers.1.self_attn.kv_scale", torch.tensor(3.0)),  # older: one for both
        ("model.layers.2.self_attn.k_proj.output_scale", torch.tensor(0.25)),  # AutoFP8
        ("model.layers.3.self_attn.v_proj.v_scale", torch.tensor(4.0, dtype=torch.bfloat16)),
        ("model.layers.3.self_attn.q_scale", torch.tensor(9.0)),  # unused: dropped
        ("model.layers.3.self_attn.k_proj.weight_scale", torch.tensor(7.0)),  # a weight's
        ("model.layers.3.self_attn.k_proj.input_scale", torch.tensor(7.0)),  # an input's
        ("h.4.attn.k_scale", torch.tensor(6.0)),  # GPT-2 naming
    ]
    found: dict[int, tuple[float, float]] = {}
    kept = [name for name, _ in take_kv_scales(weights, found)]
    assert kept == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.3.self_attn.k_proj.weight_scale",
        "model.layers.3.self_attn.k_proj.input_scale",
    ]
    assert found == {0: (0.5, 2.0), 1: (3.0, 3.0), 2: (0.25, 1.0), 3: (1.0, 4.0), 4: (6.0, 1.0)}


@pytest.mark.parametrize(
    "tensor,match", [(torch.ones(4), "per-head"), (torch.tensor(0.0), "positive")]
)
def test_unusable_kv_scales_are_refused(tensor, match):
    with pytest.raises(ValueError, match=match):
        list(take_kv_scales([("model.layers.0.self_attn.k_scale", tensor)], {}))


def test_pool_stores_float8_divided_by_its_layer_scales():
    pool = KVPool(16, 2, 2, 4, torch.bfloat16, kv_cache_dtype=E4M3)
    assert pool.quantized and pool.dtype == E4M3 and pool.compute_dtype == torch.bfloat16
    assert pool.k_buffer[0].dtype == E4M3 and pool.k_buffer[0].element_size() == 1
    pool.set_scales({1: (2.0, 0.5)})
    assert (pool.k_scales, pool.v_scales) == ([1.0, 2.0], [1.0, 0.5])
    k = torch.randn(3, 8, dtype=torch.bfloat16) * 50
    v = torch.randn(3, 8, dtype=torch.bfloat16)
    loc = torch.tensor([5, 1, 9])
    pool.set_kv_buffer(1, loc, k, v)
    stored_k, stored_v = pool.k_buffer[1][loc], pool.v_buffer[1][loc]
    assert torch.equal(
        stored_k.view(torch.uint8), quantize_kv(k, 2.0, E4M3).view(3, 2, 4).view(torch.uint8)
    )
    assert torch.equal(
        stored_v.view(torch.uint8), quantize_kv(v, 0.5, E4M3).view(3, 2, 4).view(torch.uint8)
    )
    with pytest.raises(ValueError, match="layer 2"):
        pool.set_scales({2: (1.0, 1.0)})


def test_a_model_dtype_pool_is_unchanged():
    pool = KVPool(8, 1, 1, 4, torch.float32)
    assert not pool.quantized and pool.dtype == pool.compute_dtype == torch.float32
    k = torch.randn(2, 4)
    pool.set_kv_buffer(0, torch.tensor([3, 4]), k, k)
    assert torch.equal(pool.k_buffer[0][3:5, 0], k)
    with pytest.raises(AssertionError):
        pool.set_scales({0: (2.0, 2.0)})


def _model(layers: int = 32, kv_heads: int = 8, head_dim: int = 128) -> SimpleNamespace:
    return SimpleNamespace(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, sliding_windows=None,
        context_len=4096, sliding_window_sizes=(), kv_shared=False,
    )  # fmt: skip


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_float8_cache_holds_twice_the_tokens_of_bfloat16(kv):
    """A Llama-8B-shaped cache (128 KiB per token in bf16) within the CPU budget."""
    mc = _model()
    bf16 = plan_kv_memory(mc, EngineArgs(model_path="m"), torch.bfloat16, torch.device("cpu"))
    fp8 = plan_kv_memory(
        mc, EngineArgs(model_path="m", kv_cache_dtype=kv), torch.bfloat16, torch.device("cpu")
    )
    assert bf16.tokens == DEFAULT_CPU_KV_BYTES // (2 * 32 * 8 * 128 * 2)
    assert fp8.tokens == 2 * bf16.tokens
    assert fp8.kv_dtype == resolve_kv_cache_dtype(kv, torch.bfloat16)
    pool = fp8.make_pool(mc, torch.bfloat16, torch.device("meta"), 1, {0: (2.0, 3.0)})
    assert pool.k_scales[0] == 2.0 and pool.v_scales[0] == 3.0 and pool.k_scales[1] == 1.0
    plain = bf16.make_pool(mc, torch.bfloat16, torch.device("meta"), 1, {0: (2.0, 3.0)})
    assert plain.k_scales[0] == 1.0  # a model-dtype cache ignores the checkpoint's scales
