"""Multi-head latent attention's cache (DeepSeek, engine/models/deepseek.py): one latent K/V
head per token in a pool whose V buffers are its K buffers, sized and released once."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.mem_cache.kv_pool import KVPool
from tests.factories import tiny_model


def test_the_config_describes_one_latent_head():
    mc = ModelConfig.from_pretrained(tiny_model("deepseek_v3"))
    hf = mc.hf_config
    assert hf.num_key_value_heads == hf.num_attention_heads  # (transformers' view)
    assert (mc.num_kv_heads, mc.head_dim) == (1, hf.kv_lora_rank + hf.qk_rope_head_dim)
    assert mc.kv_shared and not ModelConfig.from_pretrained(tiny_model("llama")).kv_shared


def test_a_shared_pool_keeps_one_buffer_per_layer():
    pool = KVPool(32, 3, 1, 48, torch.float32, shared=True)
    plain = KVPool(32, 3, 1, 48, torch.float32)
    assert all(k is v for k, v in zip(pool.k_buffer, pool.v_buffer))
    assert len(pool.buffers()) == 3 and len(plain.buffers()) == 6
    assert KVPool.bytes_per_token(3, 1, 48, torch.float32, shared=True) == 3 * 48 * 4
    assert KVPool.bytes_per_token(3, 1, 48, torch.float32) == 2 * 3 * 48 * 4
    latent = torch.randn(2, 48)
    pool.set_kv_buffer(1, torch.tensor([5, 9]), latent, latent)
    k, v = pool.get_kv_buffer(1)
    assert torch.equal(k[5, 0], latent[0]) and torch.equal(v[9, 0], latent[1])


def test_a_shared_float8_pool_refuses_different_k_and_v_scales():
    pool = KVPool(8, 2, 1, 16, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn, shared=True)
    pool.set_scales({0: (0.5, 0.5)})
    assert pool.k_scales[0] == pool.v_scales[0] == 0.5
    with pytest.raises(ValueError, match="k_scale and v_scale must be equal"):
        pool.set_scales({1: (0.5, 0.25)})


def test_the_engine_holds_twice_the_tokens_in_the_same_bytes(monkeypatch):
    """The KV budget buys tokens at the latent's size once, not twice (K and V)."""
    from engine.config import EngineArgs
    from engine.mem_cache import kv_memory

    monkeypatch.setattr(kv_memory, "DEFAULT_CPU_KV_TOKENS", 10**12)  # (the bytes decide)
    mc = ModelConfig.from_pretrained(tiny_model("deepseek_v3"))
    args = EngineArgs(model_path=mc.path)
    cpu = torch.device("cpu")
    shared = kv_memory.plan_kv_memory(mc, args, torch.float32, cpu).tokens
    unshared = ModelConfig(**{**mc.__dict__, "kv_shared": False})
    unshared_tokens = kv_memory.plan_kv_memory(unshared, args, torch.float32, cpu).tokens
    assert abs(shared - 2 * unshared_tokens) <= 2


def test_reading_back_a_reordered_projection_is_refused_with_the_reason():
    """`/get_weights_by_name`: q_b_proj's and kv_a_proj_with_mqa's rope rows are reordered as
    they load, so the served tensor is not the checkpoint's: refused, saying so; kv_b_proj
    (loaded as stored) reads back as the checkpoint holds it."""
    from safetensors import safe_open

    from engine.engine import Engine
    from engine.loader import safetensors_files

    path = tiny_model("deepseek_v3")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        stored = f.get_tensor(name)
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        for reordered in ("q_b_proj", "kv_a_proj_with_mqa"):
            with pytest.raises(ValueError, match="cannot be read back"):
                engine.get_weights_by_name(f"model.layers.0.self_attn.{reordered}.weight")
        got = engine.get_weights_by_name(name)
    got = torch.as_tensor(got, dtype=stored.dtype)  # (SGLang's: its first values, flattened)
    assert got.numel() > 0 and torch.equal(got, stored.flatten()[: got.numel()])
