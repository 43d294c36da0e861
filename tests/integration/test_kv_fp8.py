"""FP8 KV cache (`kv_cache_dtype`) against transformers computing the same arithmetic (CPU,
float32): its attention layers' keys and values rounded to float8 and back, with the same
per-layer scales (tests/kv_fp8_reference.py). Teacher forcing through the model runner: one
prefill with every position's logits (the prompt's keys read back from the float8 pool), then
decode steps (every earlier key read from the pool).

On these random models rounding K/V to float8 moves the logits by several units (the argmax
at 10-25% of positions, see `test_rounding_is_visible`), so a cache that stored 16-bit values,
lost a scale, or applied one twice fails the bar by far.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.engine import Engine
from tests.factories import tiny_model
from tests.kv_fp8_reference import hf_fp8_kv_logits
from tests.teacher_forcing import (
    assert_same_arithmetic,
    close_positions,
    cpu_sequences,
    cpu_teacher_forced,
    score_logits,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def scaled_model(arch: str) -> tuple[str, dict[int, tuple[float, float]]]:
    """`tiny_model(arch)` with per-layer KV-cache scales in its checkpoint, named as
    calibration tools write them (`self_attn.k_scale`, `self_attn.v_scale`), and the scales."""
    from safetensors.torch import load_file, save_file

    src = tiny_model(arch)
    out = src + "-kvscales"
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    layers = config.get("num_hidden_layers") or config["n_layer"]
    # one scale above 1 and one below per layer: stored values |K| / k_scale; 1/4 makes small
    # keys use float8's coarser range, 3 its finer one
    scales = {i: (0.25 if i % 2 else 3.0, 3.0 if i % 2 else 0.25) for i in range(layers)}
    if not os.path.exists(os.path.join(out, "config.json")):
        shutil.copytree(src, out + ".tmp", dirs_exist_ok=True)
        file = os.path.join(out + ".tmp", "model.safetensors")
        tensors = load_file(file)
        prefix = "h" if arch == "gpt2" else "model.layers"
        attn = "attn" if arch == "gpt2" else "self_attn"
        for i, (k, v) in scales.items():
            tensors[f"{prefix}.{i}.{attn}.k_scale"] = torch.tensor(k)
            tensors[f"{prefix}.{i}.{attn}.v_scale"] = torch.tensor(v)
        save_file(tensors, file, metadata={"format": "pt"})
        os.replace(out + ".tmp", out)
    return out, scales


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2"])
def test_fp8_e4m3_cache_matches_transformers(arch):
    """Llama (GQA), Qwen3 (key norm before the cache), Gemma 2 (soft-capped scores, a sliding
    window of 32 shorter than the 90-token prompt), GPT-2 (its own attention)."""
    path = tiny_model(arch)
    seqs = cpu_sequences()
    assert_same_arithmetic(
        cpu_teacher_forced(path, kv_cache_dtype="fp8"), hf_fp8_kv_logits(path, seqs, E4M3)
    )


def test_fp8_e5m2_cache_matches_transformers():
    path = tiny_model("llama")
    ref = hf_fp8_kv_logits(path, cpu_sequences(), E5M2)
    assert_same_arithmetic(cpu_teacher_forced(path, kv_cache_dtype="fp8_e5m2"), ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_checkpoint_kv_scales_are_applied(arch):
    """The checkpoint's per-layer scales: keys and values stored divided by them, multiplied
    back in attention. Against the reference without them the result is far off."""
    path, scales = scaled_model(arch)
    seqs = cpu_sequences()
    ours = cpu_teacher_forced(path, kv_cache_dtype="fp8_e4m3")
    assert_same_arithmetic(ours, hf_fp8_kv_logits(path, seqs, E4M3, scales))
    unscaled = hf_fp8_kv_logits(path, seqs, E4M3)
    assert close_positions(ours, unscaled) < 0.5


def test_kv_scales_unused_without_an_fp8_cache():
    """kv_cache_dtype auto: the checkpoint loads (its scales are not weights) and the cache
    holds the model's values: transformers' own logits."""
    path, _ = scaled_model("llama")
    ref = hf_fp8_kv_logits(path, cpu_sequences(), None)
    stats = assert_same_arithmetic(cpu_teacher_forced(path), ref)
    assert stats["agreement"] == 1.0


def test_rounding_is_visible():
    """The bar above can fail: the FP8 cache's logits against transformers without rounding."""
    path = tiny_model("llama")
    ours = cpu_teacher_forced(path, kv_cache_dtype="fp8")
    plain = hf_fp8_kv_logits(path, cpu_sequences(), None)
    assert close_positions(ours, plain) < 0.2
    assert score_logits(ours, plain)["agreement"] < 0.95


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_transformers(page_size):
    """The Triton kernels (interpreted) read the float8 pool and the new tokens' stored
    values, scales folded in."""
    path, scales = scaled_model("llama")
    seqs = cpu_sequences()
    ours = cpu_teacher_forced(path, "triton", kv_cache_dtype="fp8", page_size=page_size)
    assert_same_arithmetic(ours, hf_fp8_kv_logits(path, seqs, E4M3, scales))


def test_engine_fp8_cache_with_prefix_cache_chunked_prefill_and_overlap():
    """The whole engine (overlap loop in its device process): chunked prefill and radix-cache
    hits read float8 prefixes; the same greedy tokens with and without the overlap loop."""
    path = tiny_model("llama")
    seqs = cpu_sequences()
    prompts = [list(s[:60]) for s in seqs[:2]] + [list(seqs[0][:60]) + [9, 10, 11]]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for overlap in (True, False):
        kw = dict(disable_overlap_schedule=not overlap, chunked_prefill_size=32)
        with Engine(model_path=path, kv_cache_dtype="fp8", **kw) as engine:
            outs[overlap] = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
            if not overlap:
                k_buf, _ = engine.scheduler.model_runner.kv_pool.get_kv_buffer(0)
                assert k_buf.dtype == E4M3
    assert [o["output_ids"] for o in outs[True]] == [o["output_ids"] for o in outs[False]]
    assert outs[False][2]["meta_info"]["cached_tokens"] >= 32  # the first prompt's prefix


def test_hybrid_window_memory_over_an_fp8_cache():
    """Gemma 2 (windowed layers of 32 keys) with its windowed layers' float8 K/V in the smaller
    window pool: the same greedy tokens as the float8 cache without it."""
    path = tiny_model("gemma2")
    prompts = [list(s[:70]) for s in cpu_sequences()[:3]]
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for hybrid in (False, True):
        with Engine(model_path=path, kv_cache_dtype="fp8", hybrid_swa_memory=hybrid,
                    swa_full_tokens_ratio=0.5, disable_overlap_schedule=True,
                    max_total_tokens=2048, chunked_prefill_size=64) as engine:  # fmt: skip
            outs.append(
                [
                    o["output_ids"]
                    for o in engine.generate(input_ids=prompts, sampling_params=params)
                ]
            )
            pool = engine.scheduler.model_runner.kv_pool
            assert {b.dtype for b in pool.k_buffer} == {E4M3}
            if hybrid:
                assert len({b.shape[0] for b in pool.k_buffer}) == 2  # window and full pools
    assert outs[0] == outs[1]
