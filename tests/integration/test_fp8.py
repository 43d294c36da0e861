"""FP8 models against transformers computing the same arithmetic (CPU, float32, torch_native).

The reference is transformers' model with the FP8 checkpoint's weights dequantized and every
quantized layer's input quantized to float8 and back (per token, or per token and 16 columns
for a block-scaled checkpoint), which is W8A8 with a float32 matmul: what `Fp8Linear` computes.
So the engine must agree with it to float32 rounding; a wrong scale, shard offset or block
layout shows up as a large error. Teacher forcing through the model runner (prefill with every
position's logits, then decode steps).

Activation quantization is discontinuous: a float32 rounding difference that moves an
activation across an e4m3 rounding boundary changes it by an fp8 step. So a few positions may
differ by more than rounding; the tests allow 2% of them.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.engine import Engine
from engine.layers.fp8 import FP8_DTYPE, Fp8Linear
from engine.quantization import Fp8Config, quantized_linear_names
from tests.factories import tiny_fp8_model, tiny_lora, tiny_model
from tests.fp8_reference import dequantized_copy, hf_w8a8_logits
from tests.teacher_forcing import (
    assert_same_arithmetic,
    cpu_sequences,
    cpu_teacher_forced,
    score_logits,
)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "glm4", "glm4_moe"])
def test_block_fp8_checkpoint_matches_transformers(arch):
    """Block scales (16 x 16 here, 128 x 128 in Qwen3-*-FP8); transformers reads the
    checkpoint with its own FP8 loader (dequantizing on a CPU), so the format is theirs.
    (Phi-3: the fused q/k/v and gate/up tensors' block rows go to their pieces.)"""
    path = tiny_fp8_model(arch, 16)
    assert_same_arithmetic(
        cpu_teacher_forced(path), hf_w8a8_logits(path, cpu_sequences(), group_cols=16)
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "phi3"])
def test_per_tensor_fp8_checkpoint_matches_transformers(arch):
    """Per-tensor scales (q, k, v each their own, stacked in one layer) and static input
    scales (not used); MoE experts stay float8 (test_float8_experts_stay_float8)."""
    path = tiny_fp8_model(arch, 0)
    assert_same_arithmetic(
        cpu_teacher_forced(path), hf_w8a8_logits(dequantized_copy(path), cpu_sequences(), None)
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "deepseek_v3"])
def test_online_fp8_matches_transformers(arch, tmp_path):
    """(DeepSeek's MoE experts are quantized too: its reference's rounded alike,
    `_experts_rounded`.)"""
    path = tiny_model(arch)
    reference = _experts_rounded(path, str(tmp_path / "rounded"))
    assert_same_arithmetic(
        cpu_teacher_forced(path, quantization="fp8"),
        hf_w8a8_logits(reference, cpu_sequences(), None, quantize_weights=True),
    )


@pytest.mark.parametrize("block", [16, 0])
def test_deepseek_fp8_checkpoint_loads_as_stored(block):
    """A DeepSeek-V3 FP8 checkpoint (16 x 16 blocks, as V3's 128 x 128; or per tensor): every
    projection but kv_b_proj stays float8 with the checkpoint's values and scales, the
    query's and the latent's rope rows reordered within their scale blocks; kv_b_proj
    (read as a matrix by the absorbed attention) is the dequantized checkpoint's. End to end
    against transformers' W8A8: the same greedy tokens at every position and logprobs close.
    (Not `assert_same_arithmetic`: the absorbed attention rounds otherwise than
    transformers' expanded one, so an activation now and then lands across a float8
    boundary, and at a cached position that moves every later one a little: one such
    crossing at position 41 of the 102-token sequence left 13 % of positions over 1e-3.)"""
    from engine.config import ModelConfig
    from engine.loader import iter_safetensors, load_model
    from engine.models.interleaved_rope import deinterleave_rows
    from engine.quantization import resolve_quantization
    from kernels.fp8_gemm import dequantize_groups

    path = tiny_fp8_model("deepseek_v3", block)
    mc = ModelConfig.from_pretrained(path)
    model = load_model(mc, torch.float32, "cpu", resolve_quantization(None, mc.hf_config))
    stored = dict(iter_safetensors(path))
    cfg = mc.hf_config
    head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    rope_rows = {"q_b_proj": (head, cfg.qk_nope_head_dim),
                 "kv_a_proj_with_mqa": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank)}
    checked = 0
    for name, module in model.named_modules():
        if not name.endswith(tuple(rope_rows) + ("q_a_proj", "o_proj", "kv_b_proj")):
            continue
        weight = stored[name + ".weight"]
        scale = stored.get(name + ".weight_scale_inv", stored.get(name + ".weight_scale"))
        groups = (block, block) if block else None
        want = dequantize_groups(weight, scale, groups, torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in rope_rows:
            want = deinterleave_rows(want, *rope_rows[leaf], cfg.qk_rope_head_dim)
        if leaf == "kv_b_proj":
            assert isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32
            got = module.weight
        else:
            assert isinstance(module, Fp8Linear) and module.weight.dtype == weight.dtype
            got = dequantize_groups(module.weight, module.weight_scale, module.group,
                                    torch.float32)  # fmt: skip
        assert torch.equal(got, want), name
        checked += 1
    assert checked == 5 * cfg.num_hidden_layers
    seqs = cpu_sequences()
    if block:
        ref = hf_w8a8_logits(path, seqs, group_cols=block)
    else:
        ref = hf_w8a8_logits(dequantized_copy(path), seqs, None)
    stats = score_logits(cpu_teacher_forced(path), ref)
    assert stats["agreement_tie_aware"] == 1.0 and stats["mean_abs_dlogprob"] < 0.02, stats


@pytest.mark.parametrize(("arch", "block", "parallel"), [
    ("glm4_moe", 16, {}),
    ("qwen3_moe", 0, {}),
    ("qwen3_moe", 0, {"tp_size": 2}),
    ("qwen3_moe", 16, {"tp_size": 2, "ep_size": 2}),
    ("qwen3_moe", 16, {"tp_size": 2}),
], ids=["block", "tensor", "tensor-two-ranks", "block-two-expert-groups", "block-cut"])  # fmt: skip
def test_float8_experts_stay_float8(arch, block, parallel):
    """A MoE FP8 checkpoint's experts stay float8 (`Fp8ExpertWeights`: the checkpoint's
    values, its block or tensor scales held per row) and run as W8A16, their inputs not
    rounded (transformers' fused experts are no Linear layers: its reference leaves them so
    too): the same arithmetic as transformers' on the dequantized weights. Over two ranks
    each holds half of every expert's features (per-tensor scales: any split), or half of
    the experts whole; where a rank's half of the down projection's 44 columns (22) cuts
    its 16-column blocks, that rank keeps the scales of the blocks it overlaps (rank 1's
    part starts 6 columns into one: `Fp8Experts.offset`)."""
    from engine.layers.fp8_experts import Fp8ExpertWeights
    from kernels.fp8_gemm import dequantize_groups

    path = tiny_fp8_model(arch, block)
    # (the dequantized copy: transformers' FP8 loader refuses Qwen3-MoE's experts, whose 44
    # features are no whole 16-column blocks)
    ref = hf_w8a8_logits(dequantized_copy(path), cpu_sequences(), block or None,
                         split=parallel.get("tp_size", 1))  # fmt: skip
    ours = cpu_teacher_forced(path, **parallel)
    if "tp_size" in parallel and block:
        _assert_same_arithmetic_over_ranks(ours, ref)
    else:
        assert_same_arithmetic(ours, ref)
    if parallel.get("ep_size"):  # (rank 0 holds half of the experts: checked below alone)
        return
    with Engine(model_path=path, disable_overlap_schedule=True, **parallel) as engine:
        model = engine.scheduler.model_runner.model
        experts = [m for m in model.modules() if isinstance(m, Fp8ExpertWeights)]
    layers = [n for n, m in model.named_modules() if type(m).__name__ == "FusedMoE"]
    assert len(experts) == 2 * len(layers)
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in experts)
    if parallel:
        return
    from safetensors.torch import load_file

    stored = load_file(os.path.join(path, "model.safetensors"))
    down = model.get_submodule(layers[0]).w2  # (expert 3's down projection, as stored)
    name = f"{layers[0]}.3.down_proj.weight"
    scale = stored.get(name + "_scale_inv", stored.get(name + "_scale"))
    want = dequantize_groups(stored[name], scale, (block, block) if block else None)
    got = down.operand()[3].float()
    assert torch.equal(got, want)


def _assert_same_arithmetic_over_ranks(ours: list, ref: list) -> None:
    """`assert_same_arithmetic` where the ranks' all-reduce sums in another order than one
    rank does: on these MoE models 2-3 % of positions then move an activation across a
    float8 step, beyond the 2 % its bar allows (the same with the experts float8 or 16-bit),
    while the mean stays at 1e-4; a wrong scale (an expert's scales on other rows, a rank's
    down projection rounded per whole row) moves it by 0.1 and more."""
    stats = score_logits(ours, ref)
    assert stats["agreement_tie_aware"] == 1.0 and stats["mean_abs_dlogprob"] < 2e-3, stats


def _experts_rounded(path: str, out: str, split: int = 1) -> str:
    """`path` if the 16-bit model has no MoE experts, else a copy whose experts' weights are
    rounded as `--quantization fp8` rounds them (float8, a scale per row: `quantize_groups`;
    over `split` ranks, per row of each rank's columns of the down projection), in float32."""
    from safetensors.torch import load_file, save_file

    from kernels.fp8_gemm import dequantize_groups, quantize_groups

    tensors = load_file(os.path.join(path, "model.safetensors"))
    experts = [n for n in tensors if ".experts." in n and n.endswith("_proj.weight")]
    if not experts:
        return path
    shutil.copytree(path, out)
    for name in experts:
        w = tensors[name].float()
        cols = w.shape[1] // split if name.endswith("down_proj.weight") else w.shape[1]
        tensors[name] = dequantize_groups(*quantize_groups(w, 1, cols), (1, cols))
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("parallel", [{}, {"tp_size": 2}], ids=["one-rank", "two-ranks"])
def test_online_fp8_quantizes_the_experts(tmp_path, parallel):
    """`--quantization fp8` on a 16-bit MoE checkpoint quantizes its experts too (float8, a
    scale per row of each rank's part), run as W8A16: transformers on the model with its
    experts rounded so, the blocks' projections W8A8 as for the dense models."""
    from engine.layers.fp8_experts import Fp8ExpertWeights

    path, split = tiny_model("qwen3_moe"), parallel.get("tp_size", 1)
    ref = hf_w8a8_logits(_experts_rounded(path, str(tmp_path / "rounded"), split),
                         cpu_sequences(), None, quantize_weights=True, split=split)  # fmt: skip
    ours = cpu_teacher_forced(path, quantization="fp8", **parallel)
    if parallel:
        _assert_same_arithmetic_over_ranks(ours, ref)
    else:
        assert_same_arithmetic(ours, ref)
    with Engine(model_path=path, quantization="fp8", disable_overlap_schedule=True,
                **parallel) as engine:  # fmt: skip
        model = engine.scheduler.model_runner.model
        experts = [m for m in model.modules() if isinstance(m, Fp8ExpertWeights)]
        assert len(experts) == 2 * 2 and all(m.weight.dtype == FP8_DTYPE for m in experts)
        assert all(m.group == m.in_features for m in experts)


def test_fp8_checkpoint_loads_as_stored_and_holds_a_quarter_of_the_bytes():
    from safetensors.torch import load_file

    from engine.config import ModelConfig
    from engine.loader import load_model
    from engine.quantization import resolve_quantization

    path = tiny_fp8_model("llama", 16)
    mc = ModelConfig.from_pretrained(path)
    model = load_model(mc, torch.float32, "cpu", resolve_quantization(None, mc.hf_config))
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * mc.num_layers  # qkv, o, gate_up, down
    stored = load_file(os.path.join(path, "model.safetensors"))
    qkv = model.model.layers[1].self_attn.qkv_proj
    want = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.view(torch.uint8), want.view(torch.uint8))
    scales = [stored[f"model.layers.1.self_attn.{p}_proj.weight_scale_inv"] for p in "qkv"]
    assert torch.equal(qkv.weight_scale, torch.cat(scales))
    full = load_model(mc.__class__.from_pretrained(tiny_model("llama")), torch.float32, "cpu")
    fp8_bytes = sum(m.weight.nbytes for m in layers)
    full_bytes = sum(
        full.get_submodule(n).weight.nbytes for n in quantized_linear_names(full, Fp8Config(True))
    )
    assert fp8_bytes * 4 == full_bytes


def test_engine_serves_fp8_with_overlap_and_lora():
    """The whole engine: the overlap loop's device process loads the FP8 model too, and a LoRA
    adapter wraps FP8 layers (its delta in float32 beside them)."""
    base = tiny_model("llama")
    path = tiny_fp8_model("llama", 16)
    adapter = tiny_lora(base, seed=1)
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    prompts = [list(s[:20]) for s in cpu_sequences()]
    with Engine(model_path=path, lora_paths=[f"a={adapter}"]) as engine:
        assert not engine.args.disable_overlap_schedule
        plain = engine.generate(input_ids=prompts, sampling_params=params)
        adapted = engine.generate(input_ids=prompts, sampling_params=params, lora_path="a")
    with Engine(model_path=path, disable_overlap_schedule=True) as engine:
        again = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in plain] == [o["output_ids"] for o in again]
    assert [o["output_ids"] for o in adapted] != [o["output_ids"] for o in plain]
    assert all(len(o["output_ids"]) == 8 for o in plain + adapted)


def test_unsupported_quantization_is_refused_at_start(tmp_path):
    """(bitsandbytes; AWQ and GPTQ run since: tests/integration/test_int_weight.py and
    test_gptq.py)"""
    path = str(tmp_path / "bnb")
    shutil.copytree(tiny_model("llama"), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes'"):
        Engine(model_path=path, disable_overlap_schedule=True)


def test_the_reference_is_dequantized_where_transformers_sees_a_gpu(monkeypatch):
    """With a GPU present transformers keeps an FP8 checkpoint's float8 weights apart from
    their scales, and the reference's cast to its dtype then dropped the scales (on the H100:
    agreement 0.004 against it). `hf_w8a8_logits` asks for the dequantized weights, so the
    reference is the same whether transformers sees a GPU or not."""
    path = tiny_fp8_model("llama", 16)
    seqs = cpu_sequences()[:2]
    want = hf_w8a8_logits(path, seqs, group_cols=16)
    import transformers.utils.import_utils as hf_imports

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    try:
        got = hf_w8a8_logits(path, seqs, group_cols=16)
    finally:  # transformers caches what it learnt of CUDA: forget the pretended GPU
        for name in ("is_torch_cuda_available", "is_cuda_platform", "get_cuda_runtime_version"):
            cached = getattr(hf_imports, name, None)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_gpu_comparison_in_float32_on_the_cpu(tmp_path):
    """tests/gpu/test_fp8_gpu.py's float32 comparison (its models, sequences and runs), here on
    the CPU: its checkpoint is float32 so that transformers' dequantized weights are exactly
    sluice's (from a bf16 checkpoint it dequantizes into bf16, which left the float32
    reference at 0.60 agreement), and the two agree as the GPU test requires."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from kernels.fp8_gemm import dequantize_groups
    from tests.fp8_reference import FP8_BLOCK, fp8_models, w8a8_ours, w8a8_reference
    from tests.teacher_forcing import BF16_QK_SCALE, score_logits

    models = fp8_models(str(tmp_path), "llama", BF16_QK_SCALE)
    name = "model.layers.0.mlp.down_proj"
    tensors = load_file(os.path.join(models[1], "model.safetensors"))
    ours = dequantize_groups(tensors[name + ".weight"], tensors[name + ".weight_scale_inv"],
                             (FP8_BLOCK, FP8_BLOCK))  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(
        models[1], quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    assert torch.equal(hf.get_submodule(name).weight, ours)
    stats = score_logits(w8a8_ours(models, "checkpoint", 5, "cpu", "torch_native", "float32"),
                         w8a8_reference(models, "checkpoint", 5, "cpu", "float32"))  # fmt: skip
    assert stats["agreement_tie_aware"] >= 0.99 and stats["agreement"] >= 0.95, stats
